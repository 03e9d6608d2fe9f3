"""The statistics of the experiment tables: bootstrap intervals, two-group tests, Holm's correction, effect sizes.

Every interval here is a seeded percentile bootstrap whose resampling units are given explicitly by the
caller: seeds (one value per seed), or validation blocks (one row of counts per block, so a block's tokens
are resampled together, never the tokens of one sequence on their own). ``hierarchical_ratio_ci`` resamples
seeds, then blocks within each drawn seed (the two sources of variation of a seed-mean accuracy).

Two groups of per-seed values are tested with Welch's t-test (``scipy.stats.ttest_ind(equal_var=False)``);
``permutation_p`` is the exact/Monte Carlo permutation test of the difference in means for the small n
where the t-test's normality is a stretch. A family of tests (one per variant) is corrected with Holm's
step-down method (``holm``; scipy has Benjamini-Hochberg only, which controls another error rate).
Effect sizes: Hedges' g (bias-corrected standardised difference) and the difference in means with its
bootstrap interval (each group resampled on its own).
"""
from __future__ import annotations

import math
from typing import Dict, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 2000
SEED = 0  # every interval is seeded: the same numbers give the same interval
SOLVED = 0.9  # a seed "solves" a level when its accuracy reaches this

Interval = Tuple[Optional[float], Optional[float]]
K = TypeVar("K")


def finite(values: Sequence[Optional[float]]) -> np.ndarray:
    """The values that exist and are finite, as float64."""
    return np.asarray([float(v) for v in values if v is not None and math.isfinite(float(v))], dtype=np.float64)


def _percentile(samples: np.ndarray, confidence: float) -> Interval:
    alpha = (1.0 - confidence) / 2.0
    lo, hi = np.quantile(samples, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def bootstrap_ci(values: Sequence[Optional[float]], confidence: float = CONFIDENCE, resamples: int = RESAMPLES,
                 seed: int = SEED) -> Interval:
    """Percentile bootstrap interval of the mean of ``values`` (the units: one value each, e.g. one per seed);
    (None, None) with fewer than two values. Constant values give the degenerate interval (v, v)."""
    x = finite(values)
    if len(x) < 2:
        return None, None
    if np.ptp(x) == 0:
        return float(x[0]), float(x[0])
    from scipy.stats import bootstrap

    result = bootstrap((x,), np.mean, confidence_level=confidence, n_resamples=resamples, method="percentile",
                       vectorized=True, random_state=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def ratio_ci(numerators: Sequence[float], denominators: Sequence[float], confidence: float = CONFIDENCE,
             resamples: int = RESAMPLES, seed: int = SEED) -> Interval:
    """Percentile bootstrap interval of sum(numerators) / sum(denominators), resampling the units (e.g.
    validation blocks: correct answers and labelled tokens of each block) together."""
    num, den = np.asarray(numerators, np.float64), np.asarray(denominators, np.float64)
    keep = den > 0
    num, den = num[keep], den[keep]
    if len(den) < 2:
        return None, None
    rng = np.random.default_rng(seed)
    draws = rng.integers(0, len(den), size=(resamples, len(den)))
    return _percentile(num[draws].sum(1) / den[draws].sum(1), confidence)


def hierarchical_ratio_ci(numerators: Sequence[Sequence[float]], denominators: Sequence[Sequence[float]],
                          confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = SEED) -> Interval:
    """Interval of the seed mean of per-seed ratios (accuracy = correct / tokens over a seed's blocks):
    each resample draws seeds with replacement, then blocks with replacement within each drawn seed.
    ``numerators[s][b]``: seed s, block b. Seeds without any counted unit are left out."""
    seeds = [(np.asarray(n, np.float64), np.asarray(d, np.float64)) for n, d in zip(numerators, denominators)]
    seeds = [(n[d > 0], d[d > 0]) for n, d in seeds]
    seeds = [(n, d) for n, d in seeds if len(d)]
    if len(seeds) < 2 and not (seeds and len(seeds[0][1]) >= 2):
        return None, None
    rng = np.random.default_rng(seed)
    chosen = rng.integers(0, len(seeds), size=(resamples, len(seeds)))
    drawn = np.empty((resamples, len(seeds)))
    for j in range(len(seeds)):  # the j-th seed drawn: its own block resample, whichever seed it is
        for s, (n, d) in enumerate(seeds):
            rows = np.flatnonzero(chosen[:, j] == s)
            blocks = rng.integers(0, len(d), size=(len(rows), len(d)))
            drawn[rows, j] = n[blocks].sum(1) / d[blocks].sum(1)
    means = drawn.mean(1)
    return _percentile(means, confidence)


def welch_p(a: Sequence[Optional[float]], b: Sequence[Optional[float]], alternative: str = "two-sided") -> Optional[float]:
    """p-value of Welch's t-test of mean(a) vs mean(b) (``alternative``: "two-sided", "greater": a > b,
    "less"); None with fewer than two values in a group. Two constant groups: 0 or 1 (the t statistic is
    infinite or undefined: the direction decides)."""
    x, y = finite(a), finite(b)
    if len(x) < 2 or len(y) < 2:
        return None
    if np.ptp(x) == 0 and np.ptp(y) == 0:
        return _constant_p(x[0] - y[0], alternative)
    import warnings

    from scipy.stats import ttest_ind

    with warnings.catch_warnings():  # nearly equal groups: scipy warns of precision loss, the p-value stands
        warnings.simplefilter("ignore", RuntimeWarning)
        return float(ttest_ind(x, y, equal_var=False, alternative=alternative).pvalue)


def _constant_p(diff: float, alternative: str) -> float:
    """The p-value of a t-test whose groups have no spread (the statistic is infinite or undefined): 1 with no
    difference, else 0 or 1 as the difference's sign meets ``alternative``."""
    if diff == 0:
        return 1.0
    return 0.0 if {"two-sided": True, "greater": diff > 0, "less": diff < 0}[alternative] else 1.0


def one_sample_p(values: Sequence[Optional[float]], mu: float = 0.0, alternative: str = "two-sided") -> Optional[float]:
    """p-value of the one-sample t-test of mean(values) against ``mu`` (e.g. per-seed correlations against 0;
    ``alternative`` as in ``welch_p``); None with fewer than two values. Constant values: 0 or 1 (the direction
    decides)."""
    x = finite(values)
    if len(x) < 2:
        return None
    if np.ptp(x) == 0:
        return _constant_p(x[0] - mu, alternative)
    from scipy.stats import ttest_1samp

    return float(ttest_1samp(x, mu, alternative=alternative).pvalue)


def permutation_p(a: Sequence[Optional[float]], b: Sequence[Optional[float]], alternative: str = "two-sided",
                  resamples: int = 9999, seed: int = SEED) -> Optional[float]:
    """p-value of the permutation test of the difference in means (exact when the relabellings are fewer than
    ``resamples``); None with an empty group."""
    x, y = finite(a), finite(b)
    if not len(x) or not len(y):
        return None
    from scipy.stats import permutation_test

    result = permutation_test((x, y), lambda u, v, axis: np.mean(u, axis=axis) - np.mean(v, axis=axis),
                              permutation_type="independent", alternative=alternative, n_resamples=resamples,
                              vectorized=True, random_state=np.random.default_rng(seed))
    return float(result.pvalue)


def holm(pvalues: Union[Mapping[K, Optional[float]], Sequence[Optional[float]]]) -> Union[Dict[K, Optional[float]], List[Optional[float]]]:
    """Holm-Bonferroni adjusted p-values (step-down: the i-th smallest of m times (m - i + 1), made monotone,
    capped at 1). Missing p-values (None) stay None and do not count in m. A mapping gives a mapping."""
    keys = list(pvalues) if isinstance(pvalues, Mapping) else list(range(len(pvalues)))
    values = [pvalues[k] for k in keys]
    present = sorted((p, i) for i, p in enumerate(values) if p is not None and math.isfinite(p))
    m = len(present)
    adjusted: List[Optional[float]] = [None] * len(values)
    running = 0.0
    for rank, (p, i) in enumerate(present):
        running = max(running, min(1.0, (m - rank) * p))
        adjusted[i] = running
    return dict(zip(keys, adjusted)) if isinstance(pvalues, Mapping) else adjusted


def hedges_g(a: Sequence[Optional[float]], b: Sequence[Optional[float]]) -> Optional[float]:
    """Hedges' g of a vs b: (mean a - mean b) / pooled sample std, times the small-sample correction
    1 - 3 / (4 (n_a + n_b) - 9). None with fewer than two values in a group or no spread at all."""
    x, y = finite(a), finite(b)
    if len(x) < 2 or len(y) < 2:
        return None
    pooled = math.sqrt(((len(x) - 1) * x.var(ddof=1) + (len(y) - 1) * y.var(ddof=1)) / (len(x) + len(y) - 2))
    if pooled == 0:
        return None
    return float((x.mean() - y.mean()) / pooled * (1.0 - 3.0 / (4.0 * (len(x) + len(y)) - 9.0)))


def mean_difference_ci(a: Sequence[Optional[float]], b: Sequence[Optional[float]], confidence: float = CONFIDENCE,
                       resamples: int = RESAMPLES, seed: int = SEED) -> Interval:
    """Percentile bootstrap interval of mean(a) - mean(b), each group's units (seeds) resampled on their own."""
    x, y = finite(a), finite(b)
    if len(x) < 2 or len(y) < 2:
        return None, None
    rng = np.random.default_rng(seed)
    diffs = (x[rng.integers(0, len(x), (resamples, len(x)))].mean(1)
             - y[rng.integers(0, len(y), (resamples, len(y)))].mean(1))
    return _percentile(diffs, confidence)


def solved_share(values: Sequence[Optional[float]], threshold: float = SOLVED) -> Optional[float]:
    """Share of the seeds whose value (a level's accuracy) reaches ``threshold``; None without values."""
    x = finite(values)
    return float((x >= threshold).mean()) if len(x) else None


def compare_groups(a: Sequence[Optional[float]], b: Sequence[Optional[float]], alternative: str = "two-sided",
                   seed: int = SEED) -> Dict[str, Optional[float]]:
    """a against b (e.g. a variant's seeds against the best dense model's): the difference in means with
    its bootstrap interval, Welch's p (``alternative`` as in ``welch_p``), Hedges' g, and the n of each."""
    x, y = finite(a), finite(b)
    lo, hi = mean_difference_ci(x, y, seed=seed)
    return {"difference": float(x.mean() - y.mean()) if len(x) and len(y) else None, "ci_low": lo, "ci_high": hi,
            "p": welch_p(x, y, alternative), "hedges_g": hedges_g(x, y), "n": len(x), "n_baseline": len(y)}


def with_holm(tests: Mapping[K, Dict[str, Optional[float]]], key: str = "p") -> Dict[K, Dict[str, Optional[float]]]:
    """The tests (``compare_groups`` results) with ``p_holm``: Holm's adjustment over the family of them."""
    adjusted = holm({k: t.get(key) for k, t in tests.items()})
    return {k: {**t, "p_holm": adjusted[k]} for k, t in tests.items()}


def seed_summary(values: Sequence[Optional[float]]) -> Dict[str, object]:
    """One figure over seeds: the per-seed values, their mean and sample std, and the bootstrap interval of the mean
    over seeds (``bootstrap_ci``: the seeds are the units). Mean and std None without finite values."""
    x = finite(values)
    return {"seeds": list(values), "mean": float(x.mean()) if len(x) else None,
            "std": float(x.std(ddof=1)) if len(x) > 1 else (0.0 if len(x) else None), "ci": bootstrap_ci(x)}


def lowest_mean(means: Mapping[K, Optional[float]]) -> K:
    """The key with the lowest mean (a missing or non-finite mean never wins); the first of equal ones."""
    if not means:
        raise ValueError("lowest_mean: no candidates")
    return min(means, key=lambda k: means[k] if means[k] is not None and math.isfinite(means[k]) else math.inf)


def against_baseline(groups: Mapping[K, Sequence[Optional[float]]], baseline: Sequence[Optional[float]],
                     alternative: str = "less") -> Dict[K, Dict[str, Optional[float]]]:
    """Every group's seeds against the baseline's (``compare_groups``), Holm's correction over the groups."""
    return with_holm({k: compare_groups(v, baseline, alternative) for k, v in groups.items()})


def passes(test: Mapping[str, Optional[float]], alpha: float = 0.05) -> bool:
    """A corrected test passes: its Holm-adjusted p-value exists and is below ``alpha``."""
    return test.get("p_holm") is not None and test["p_holm"] < alpha
