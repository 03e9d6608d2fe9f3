"""analysis/stats.py on known numbers: Holm on a textbook case, Welch's p by hand, Hedges' g by hand, the
bootstrap's coverage over repeated draws and exact values on degenerate cases."""
from __future__ import annotations

import math

import numpy as np
import pytest

from analysis import stats


def test_holm_on_a_textbook_example():
    # Holm (1979)-style example: sorted 0.005, 0.01, 0.03, 0.04 -> x4, x3, x2, x1, then made monotone
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    # capped at 1, missing values kept out of m, a mapping keeps its keys
    assert stats.holm({"a": 0.5, "b": None, "c": 0.4}) == {"a": pytest.approx(0.8), "b": None, "c": pytest.approx(0.8)}
    assert stats.holm([0.6, 0.9]) == [1.0, 1.0]
    assert stats.holm([]) == []


def test_welch_p_against_the_hand_computed_statistic():
    a, b = [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0, 10.0]
    va, vb = 5 / 3, 10.0  # sample variances
    se2 = va / 4 + vb / 5
    t = (2.5 - 6.0) / math.sqrt(se2)
    df = se2 ** 2 / ((va / 4) ** 2 / 3 + (vb / 5) ** 2 / 4)
    assert t == pytest.approx(-2.2514, abs=1e-4) and df == pytest.approx(5.5207, abs=1e-4)
    from scipy.special import betainc

    two_sided = betainc(df / 2, 0.5, df / (df + t * t))  # P(|T_df| > |t|) from the incomplete beta function
    assert stats.welch_p(a, b) == pytest.approx(two_sided, rel=1e-9)
    assert stats.welch_p(a, b, "less") == pytest.approx(two_sided / 2, rel=1e-9)
    assert stats.welch_p(a, b, "greater") == pytest.approx(1 - two_sided / 2, rel=1e-9)
    assert stats.welch_p([1.0], b) is None  # one seed: no test
    assert stats.welch_p([1.0, 1.0], [0.0, 0.0], "greater") == 0.0 and stats.welch_p([1.0, 1.0], [1.0, 1.0]) == 1.0


def test_one_sample_p_against_the_hand_computed_statistic():
    values = [-0.9, -0.5, -0.7, 0.1]  # e.g. per-seed correlations
    mean, sd = -0.5, math.sqrt(((-0.4) ** 2 + 0 + (-0.2) ** 2 + 0.6 ** 2) / 3)
    t, df = mean / (sd / 2), 3
    from scipy.special import betainc

    two_sided = betainc(df / 2, 0.5, df / (df + t * t))
    assert stats.one_sample_p(values) == pytest.approx(two_sided, rel=1e-9)
    assert stats.one_sample_p(values, alternative="less") == pytest.approx(two_sided / 2, rel=1e-9)
    assert stats.one_sample_p([v + 1 for v in values], mu=1.0, alternative="greater") == pytest.approx(1 - two_sided / 2)
    assert stats.one_sample_p([0.3]) is None and stats.one_sample_p([0.3, None, float("nan")]) is None
    assert stats.one_sample_p([0.2, 0.2], alternative="greater") == 0.0 and stats.one_sample_p([0.0, 0.0]) == 1.0


def test_permutation_p_is_exact_on_a_tiny_case():
    # 3 vs 3 fully separated: only 1 of the C(6,3) = 20 relabellings is as extreme in the "greater" direction
    assert stats.permutation_p([4.0, 5.0, 6.0], [1.0, 2.0, 3.0], "greater") == pytest.approx(1 / 20)
    assert stats.permutation_p([4.0, 5.0, 6.0], [1.0, 2.0, 3.0]) == pytest.approx(2 / 20)


def test_hedges_g_by_hand():
    a, b = [1.0, 2.0, 3.0, 4.0], [2.0, 4.0, 6.0, 8.0, 10.0]
    pooled = math.sqrt((3 * 5 / 3 + 4 * 10.0) / 7)
    assert stats.hedges_g(a, b) == pytest.approx((2.5 - 6.0) / pooled * (1 - 3 / (4 * 9 - 9)))
    assert stats.hedges_g([1.0, 1.0], [1.0, 1.0]) is None and stats.hedges_g([1.0], b) is None


def test_bootstrap_ci_covers_the_mean_at_about_the_stated_rate():
    rng = np.random.default_rng(123)
    draws = 300
    covered = 0
    for i in range(draws):
        lo, hi = stats.bootstrap_ci(rng.normal(3.0, 2.0, size=30), resamples=999, seed=i)
        covered += lo <= 3.0 <= hi
    # the percentile interval at n=30 is a little narrow (~93% for 95%); 300 draws: SE ~1.4 points
    assert 0.89 <= covered / draws <= 0.98


def test_bootstrap_intervals_on_degenerate_and_tiny_cases():
    assert stats.bootstrap_ci([2.0, 2.0, 2.0]) == (2.0, 2.0)
    assert stats.bootstrap_ci([1.0]) == (None, None) and stats.bootstrap_ci([None, float("nan"), 1.0]) == (None, None)
    lo, hi = stats.bootstrap_ci([0.0, 1.0])
    assert 0.0 <= lo <= 0.5 <= hi <= 1.0
    assert stats.bootstrap_ci([0.0, 1.0, 5.0], seed=4) == stats.bootstrap_ci([0.0, 1.0, 5.0], seed=4)  # seeded
    # blocks with equal accuracy: every resample has that accuracy
    assert stats.ratio_ci([1, 2, 3], [2, 4, 6]) == pytest.approx((0.5, 0.5))
    assert stats.hierarchical_ratio_ci([[1, 2], [3, 3]], [[2, 4], [6, 6]]) == pytest.approx((0.5, 0.5))
    assert stats.ratio_ci([1], [2]) == (None, None)


def test_ratio_ci_resamples_blocks_not_tokens():
    # two blocks: one all right (10 tokens), one all wrong (10 tokens); resampling blocks gives 0, 0.5 or 1
    lo, hi = stats.ratio_ci([10, 0], [10, 10], resamples=4000)
    assert (lo, hi) == (0.0, 1.0)
    # the same 20 tokens pooled in 20 blocks of one token each: a much narrower interval around 0.5
    lo, hi = stats.ratio_ci([1] * 10 + [0] * 10, [1] * 20, resamples=4000)
    assert 0.2 < lo < 0.5 < hi < 0.8


def test_hierarchical_interval_widens_with_the_spread_between_seeds():
    blocks = [1] * 8
    close = stats.hierarchical_ratio_ci([[1, 1, 0, 1, 1, 1, 0, 1]] * 4, [blocks] * 4)
    apart = stats.hierarchical_ratio_ci([[1] * 8, [0] * 8, [1] * 8, [0] * 8], [blocks] * 4)
    assert apart[1] - apart[0] > close[1] - close[0]
    assert close[0] <= 0.75 <= close[1]


def test_mean_difference_and_group_comparison():
    a, b = [3.0, 3.2, 2.9, 3.1, 3.0], [2.0, 2.1, 1.9, 2.0, 2.2]
    lo, hi = stats.mean_difference_ci(a, b)
    assert lo <= 1.0 <= hi and lo > 0.6
    result = stats.compare_groups(a, b, alternative="greater")
    assert result["difference"] == pytest.approx(np.mean(a) - np.mean(b)) and result["p"] < 1e-4
    assert result["hedges_g"] > 3 and result["n"] == result["n_baseline"] == 5
    tests = stats.with_holm({"x": {"p": 0.01}, "y": {"p": 0.04}, "z": {"p": None}})
    assert tests["x"]["p_holm"] == pytest.approx(0.02) and tests["y"]["p_holm"] == pytest.approx(0.04)
    assert tests["z"]["p_holm"] is None


def test_solved_share():
    assert stats.solved_share([0.95, 0.2, 0.9, None]) == pytest.approx(2 / 3)
    assert stats.solved_share([]) is None


def test_seed_summary_lowest_mean_and_corrected_tests_against_a_baseline():
    summary = stats.seed_summary([1.0, 3.0, None])
    assert summary["mean"] == 2.0 and summary["std"] == pytest.approx(math.sqrt(2.0))
    assert summary["ci"] == stats.bootstrap_ci([1.0, 3.0]) and summary["seeds"] == [1.0, 3.0, None]
    assert stats.seed_summary([]) == {"seeds": [], "mean": None, "std": None, "ci": (None, None)}
    assert stats.lowest_mean({"a": 2.0, "b": None, "c": 1.5, "d": float("nan")}) == "c"
    groups = {"low": [1.0, 1.1, 0.9], "same": [2.0, 2.1, 1.9], "none": [1.0]}
    tests = stats.against_baseline(groups, [2.0, 2.2, 1.8], "less")
    raw = {k: stats.compare_groups(v, [2.0, 2.2, 1.8], "less")["p"] for k, v in groups.items()}
    assert {k: t["p"] for k, t in tests.items()} == raw and tests["none"]["p_holm"] is None
    assert {k: t["p_holm"] for k, t in tests.items()} == stats.holm(raw)
    assert stats.passes(tests["low"]) and not stats.passes(tests["same"]) and not stats.passes(tests["none"])
