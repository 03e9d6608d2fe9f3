"""The leaderboard of a set of training runs, as data: read run folders, check they are comparable, group
seeds, rank, test against a baseline, write markdown / CSV / JSON / plot. The command line and what the
table shows: ``experiments/compare.py`` (``python -m experiments.compare``).
"""
from __future__ import annotations

import csv
import dataclasses
import glob
import io
import json
import math
import pathlib
import re
import statistics
import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from architectures.config import ConfigError, flatten

# Options that do not make a different configuration: the seed, and where the run read or wrote files
# that do not change what it computed.
IGNORED = ("seed", "log_dir", "version", "ckpt_path", "config", "__path__", "data.cache_dir", "data.num_workers",
           "trainer.default_root_dir")
# Options that are only caps in runs a FLOPs budget stopped (experiments.repro sizes them per variant).
BUDGET_CAPS = ("trainer.max_steps", "val_every")
# Short names accepted by --group_by (as on experiments.run's command line).
GROUP_ALIASES = {"variant": "model.variant", "size": "model.size", "data": "data.name", "tokenizer": "data.tokenizer",
                 "max_steps": "trainer.max_steps", "batch_size": "data.batch_size"}
# The measured columns: (key, header). Each is aggregated over the seeds of a configuration.
METRICS = (("steps", "steps"), ("tokens", "tokens"), ("train_flops", "train FLOPs"), ("val_loss", "val loss"),
           ("val_loss_causal", "causal val loss"), ("flops_per_token", "fwd FLOPs/token"),
           ("step_time_s", "step s"), ("parameters", "params"))
# Routing-probe runs (datamodules/probe.py) add their accuracy per difficulty level, for every level a run logged
# (--callbacks.probe_levels sets how many: probe-v6/bounce has 8).
_PROBE_ACC = re.compile(r"probe/level(\d+)/acc")
# The loss rows are ranked and plotted by: the causal loss where the run has one (routing that sees the future
# cannot generate that way), else the loss; what summary.json's final_val_loss holds since it names its metric.
HEADLINE = "headline_val_loss"
# A row's test against --baseline (analysis.stats.compare_groups, with Holm's correction).
BASELINE_FIELDS = ("difference", "ci_low", "ci_high", "hedges_g", "p", "p_holm")


class CompareError(ConfigError):
    """The runs cannot be tabulated (one line: what, which file or option, what to do)."""


@dataclasses.dataclass
class Run:
    folder: pathlib.Path
    config: Dict[str, Any]  # flattened resolved config.yaml ("model.d_model": 64, ...)
    summary: Dict[str, Any]
    fingerprints: Optional[Dict[str, str]]  # data/tokenizer fingerprints saved in the checkpoint

    @property
    def seed(self) -> Any:
        return self.config.get("seed")

    def metrics(self) -> Dict[str, Optional[float]]:
        s = self.summary
        per_token, val = s.get("flops_per_token") or {}, s.get("val_metrics") or {}
        loss, causal = val.get("val/loss", s.get("final_val_loss")), val.get("val/loss_causal")
        return {"steps": s.get("steps"), "tokens": s.get("tokens_seen"), "train_flops": train_flops_spent(s),
                "val_loss": loss, "val_loss_causal": causal, "flops_per_token": per_token.get("forward"),
                "step_time_s": s.get("median_step_time_s"), "parameters": s.get("parameters"),
                HEADLINE: causal if causal is not None else loss,
                **{f"probe_acc_L{int(m.group(1))}": v for k, v in val.items() if (m := _PROBE_ACC.fullmatch(k))}}

    def first_solved_steps(self) -> Optional[Dict[str, Optional[int]]]:
        """Per probe level (``probe_acc_L<k>``): the optimiser steps done at the first validation whose accuracy on
        that level reached ``analysis.stats.SOLVED`` (None: no validation did); None for a run whose summary has no
        ``val_history`` (written before the recorder kept one, and not published since)."""
        from analysis.stats import SOLVED

        history = self.summary.get("val_history")
        if not history:
            return None
        first: Dict[str, Optional[int]] = {}
        for step, metrics in history:
            for tag, value in metrics.items():
                if (m := _PROBE_ACC.fullmatch(tag)) is not None:
                    key = f"probe_acc_L{int(m.group(1))}"
                    if first.get(key) is None:
                        first[key] = int(step) if value is not None and value >= SOLVED else None
        return first


def probe_columns(runs: Sequence[Run]) -> List[Tuple[str, str]]:
    """(key, header) of the probe accuracy of every level some run logged, in level order (L10 after L9)."""
    levels = {int(k[len("probe_acc_L"):]) for r in runs for k in r.metrics() if k.startswith("probe_acc_L")}
    return [(f"probe_acc_L{level}", f"acc L{level}") for level in sorted(levels)]


def train_flops_spent(summary: Dict[str, Any]) -> Optional[float]:
    """Training FLOPs the run spent: the measured count of a run with a FLOPs budget (``train_flops``; None
    without a budget), else the routing-aware training FLOPs per token of the last step times the tokens seen."""
    if isinstance(summary.get("train_flops"), (int, float)):
        return float(summary["train_flops"])
    per_token = (summary.get("flops_per_token") or {}).get("training")
    tokens = summary.get("tokens_seen")
    return float(per_token) * float(tokens) if per_token is not None and tokens is not None else None


# ---------------------------------------------------------------------------- finding and reading runs
def find_run_folders(patterns: Sequence[str]) -> List[pathlib.Path]:
    """Run folders (holding config.yaml or summary.json) named by, or found below, each path or glob."""
    found: Dict[pathlib.Path, None] = {}
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) or ([pattern] if pathlib.Path(pattern).exists() else [])
        folders = [folder for match in map(pathlib.Path, matches) for folder in _run_folders_in(match)]
        if not folders and len(patterns) > 1:
            warn(f"{pattern} matched no run folder")
        for folder in folders:
            found.setdefault(folder.resolve(), None)
    if not found:
        raise CompareError(f"no run folders matched {' '.join(patterns)}: give run folders of experiments.run "
                           "(holding config.yaml), folders above them, or globs of either")
    return list(found)


def _run_folders_in(path: pathlib.Path) -> List[pathlib.Path]:
    if path.is_file():  # a run folder's own file (a glob of */summary.json) names that folder; other files none
        return [path.parent] if path.name in ("config.yaml", "summary.json") else []
    if _is_run_folder(path):
        return [path]
    if not path.is_dir():
        return []
    below = {p.parent for name in ("config.yaml", "summary.json") for p in path.rglob(name)}
    return sorted(p for p in below if _is_run_folder(p) and "checkpoints" not in p.parts)


def _is_run_folder(path: pathlib.Path) -> bool:
    return (path / "config.yaml").is_file() or (path / "summary.json").is_file()


def read_run(folder: pathlib.Path) -> Optional[Run]:
    """The run, or None (with a warning on stderr) when it has not finished."""
    if not (folder / "summary.json").is_file():
        warn(f"skipping {folder}: unfinished (no summary.json yet)")
        return None
    summary = _read_json(folder / "summary.json")
    config = without_unused_groups(flatten(_read_yaml(folder / "config.yaml")))
    stale = unfinished_reason(config, summary)
    if stale:
        warn(f"skipping {folder}: unfinished ({stale})")
        return None
    return Run(folder, config, summary, _checkpoint_fingerprints(folder))


def without_unused_groups(config: Dict[str, Any]) -> Dict[str, Any]:
    """The config without the option groups its variant does not read (``model.mom.*`` of a MoD run: a
    config.yaml written before configs held only their variant's groups holds every group at its defaults,
    which are no difference between runs). A variant the registry does not know keeps all its options."""
    from architectures.config import config_groups
    from architectures.registry import VARIANTS

    variant = VARIANTS.get(str(config.get("model.variant")))
    if variant is None:
        return config
    used = set(getattr(variant.model_class(), "config_groups", {}) or {})
    unused = {f"model.{group}." for group in config_groups() if group not in used}
    return {k: v for k, v in config.items() if not any(k.startswith(prefix) for prefix in unused)}


def unfinished_reason(config: Dict[str, Any], summary: Dict[str, Any]) -> Optional[str]:
    """A summary written before the run's last step: a resumed run still training toward a larger max_steps.
    Runs that stop early by design (a FLOPs or time budget) are finished."""
    max_steps, steps = config.get("trainer.max_steps"), summary.get("steps")
    budget = any(k.rsplit(".", 1)[-1] == "max_train_flops" and v for k, v in config.items())
    epochs = config.get("trainer.max_epochs") not in (None, -1)
    by_design = summary.get("stopped_by", "max_steps") != "max_steps"  # e.g. "max_train_flops"
    if budget or epochs or by_design or config.get("trainer.max_time"):
        return None
    if isinstance(max_steps, int) and isinstance(steps, int) and 0 <= steps < max_steps:
        return f"summary.json at step {steps} of trainer.max_steps {max_steps}"
    return None


def _read_json(path: pathlib.Path) -> Dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CompareError(f"{path}: unreadable ({err}); delete the run folder or re-run it") from None
    if not isinstance(data, dict):
        raise CompareError(f"{path}: holds a {type(data).__name__}, not the JSON object experiments.run writes")
    return data


def _read_yaml(path: pathlib.Path) -> Dict[str, Any]:
    import yaml

    if not path.is_file():
        raise CompareError(f"{path}: missing; every run folder of experiments.run holds its resolved config.yaml")
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as err:
        reason = " ".join(str(err).split())[:160]
        raise CompareError(f"{path}: unreadable ({reason}); restore it from the run's command line") from None
    if data is None:  # read as no settings at all, it made runs look trained on "different validation sets"
        raise CompareError(f"{path}: empty; every run folder of experiments.run holds its resolved config.yaml; "
                           "restore it from the run's command line")
    if not isinstance(data, dict):
        raise CompareError(f"{path}: holds a {type(data).__name__}, not a run configuration")
    return data


def _checkpoint_fingerprints(folder: pathlib.Path) -> Optional[Dict[str, str]]:
    """The data/tokenizer fingerprints ``LMDataModule`` saved in the run's last checkpoint (None without one)."""
    from model_tools.weights import read_checkpoint, saved_fingerprints

    path = folder / "checkpoints" / "last.ckpt"
    if not path.is_file():
        return None
    blob = read_checkpoint(path, option="checkpoint")  # a truncated file: one line naming it
    return saved_fingerprints(blob)


def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def read_runs(folders: Iterable[pathlib.Path]) -> List[Run]:
    folders = list(folders)
    runs = [run for run in map(read_run, folders) if run is not None]
    if not runs:
        raise CompareError(f"none of the {len(folders)} run folders matched has finished (see the warnings "
                           "above); wait for the runs to end, or resume them with experiments.run --ckpt_path last")
    return runs


# ---------------------------------------------------------------------------- comparability
def comparability(runs: Sequence[Run]) -> Dict[str, Dict[str, Any]]:
    """{what must agree: {run folder: value}}: the tokenizer, and what decides the validation set."""
    exact = all(r.fingerprints for r in runs)
    if not exact:
        missing = sum(1 for r in runs if not r.fingerprints)
        warn(f"{missing} run(s) have no checkpoint with data/tokenizer fingerprints; compared by their "
             "config.yaml data options instead")
    checks: Dict[str, Dict[str, Any]] = {"tokenizer": {}, "validation set": {}}
    for r in runs:
        c = r.config
        data = r.fingerprints["data"] if exact else " ".join(f"{k}={c[k]}" for k in sorted(c)
                                                             if k.startswith("data.") and k not in _DATA_NOT_CONTENT)
        labels = (r.fingerprints or {}).get("labels", "none")
        if exact and labels != "none":  # a label file / loss mask: val/loss is the masked objective
            data += f" labels {labels}"
        tokenizer = r.fingerprints["tokenizer"] if exact else f"data.tokenizer={c.get('data.tokenizer')} ({data})"
        val_fraction = r.fingerprints.get("val_fraction") if exact else c.get("data.val_fraction")
        checks["tokenizer"][str(r.folder)] = tokenizer
        checks["validation set"][str(r.folder)] = (
            f"data {data}, val_fraction {val_fraction}, block_size {c.get('model.block_size')}, "
            f"{evaluated_blocks(c)} val blocks")
    return checks


def evaluated_blocks(config: Dict[str, Any]) -> Any:
    """The global number of blocks each validation evaluated: ``val_blocks``, or for runs from before it
    ``val_batches`` x ``data.batch_size`` (also a global count since issue 20, split across the ranks)."""
    if config.get("val_blocks") is not None:
        return config["val_blocks"]
    if config.get("val_batches") is not None and config.get("data.batch_size") is not None:
        return config["val_batches"] * config["data.batch_size"]
    return None


# data options that change neither the tokens nor the tokenizer (the validation split is checked on its own)
_DATA_NOT_CONTENT = {"data.batch_size", "data.num_workers", "data.cache_dir", "data.streaming", "data.num_proc",
                     "data.val_fraction"}


def refuse_incomparable(runs: Sequence[Run]) -> None:
    for what, values in comparability(runs).items():
        distinct = list(dict.fromkeys(values.values()))
        if len(distinct) > 1:
            first = {v: folder for folder, v in reversed(list(values.items()))}
            shown = "; ".join(f"{v} ({first[v]})" for v in distinct[:2])
            raise CompareError(f"runs with different {what}s cannot be compared (their losses are not comparable): "
                               f"{shown}{' and more' if len(distinct) > 2 else ''}; pass only runs trained and "
                               f"validated on the same data, tokenizer and validation settings")


# ---------------------------------------------------------------------------- grouping and aggregation
def differing_options(runs: Sequence[Run]) -> List[str]:
    """Config keys whose values differ between the runs (seed and output paths excluded)."""
    keys = sorted({k for r in runs for k in r.config if not _ignored(k)})
    differ = [k for k in keys if _differs(k, runs)]
    # runs that a FLOPs budget stopped: --max_steps (and the validation interval set to it) was only a cap
    if all(r.summary.get("stopped_by") == "max_train_flops" for r in runs):
        differ = [k for k in differ if k not in BUDGET_CAPS]
    # model.preset follows the variant (the preset of each variant): it adds nothing to the variant column
    if all(r.config.get("model.preset") in (None, r.config.get("model.variant")) for r in runs):
        differ = [k for k in differ if k != "model.preset"]
    return differ


def _differs(key: str, runs: Sequence[Run]) -> bool:
    """An option differs when two runs hold different values. A group option (``model.<group>.<field>``) is
    compared among the runs whose variant reads the group only (``without_unused_groups``), and also counts
    when they all hold one value other than the group's default (a MoD row at capacity 0.25 next to vanilla)."""
    group = _group_option(key)
    values = {_key(r.config.get(key)) for r in runs if group is None or key in r.config}
    if len(values) > 1:
        return True
    return group is not None and values != {_key(_group_default(*group))}


def _group_option(key: str) -> Optional[Tuple[str, str]]:
    from architectures.config import config_groups

    parts = key.split(".")
    return (parts[1], parts[2]) if len(parts) == 3 and parts[0] == "model" and parts[1] in config_groups() else None


def _group_default(group: str, field: str) -> Any:
    import dataclasses

    from architectures.config import config_groups

    default = config_groups()[group]()
    value = getattr(default, field, None)
    return dataclasses.asdict(value) if dataclasses.is_dataclass(value) else value


def _ignored(key: str) -> bool:
    return key in IGNORED or key.startswith("__")


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True, default=str)


def resolve_group_by(group_by: Optional[Sequence[str]], runs: Sequence[Run]) -> Optional[List[str]]:
    if not group_by:
        return None
    known = {k for r in runs for k in r.config}
    keys = []
    for name in group_by:
        key = GROUP_ALIASES.get(name, name)
        if key not in known:
            raise CompareError(f"--group_by: unknown option {name!r}; use variant, size or a config key such as "
                               f"{', '.join(differing_options(runs)[:6]) or 'model.d_model'}")
        keys.append(key)
    return keys


def group_runs(runs: Sequence[Run], keys: Optional[Sequence[str]]) -> List[List[Run]]:
    """Runs grouped by ``keys`` (None: by every option but the seed and output paths), in first-seen order."""
    groups: Dict[str, List[Run]] = {}
    for r in runs:
        identity = keys if keys is not None else [k for k in r.config if not _ignored(k)]
        groups.setdefault(_key({k: r.config.get(k) for k in sorted(identity)}), []).append(r)
    return list(groups.values())


def mean_std(values: Sequence[Optional[float]]) -> Dict[str, Optional[float]]:
    """Mean, sample standard deviation (None for a single value) and n of the values that exist."""
    present = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not present:
        return {"mean": None, "std": None, "n": 0}
    return {"mean": statistics.fmean(present), "std": statistics.stdev(present) if len(present) > 1 else None,
            "n": len(present)}


def metric_columns(runs: Sequence[Run]) -> List[Tuple[str, str]]:
    """The measured columns of a table of these runs: ``METRICS``, and the probe accuracies where a run has them."""
    return [*METRICS, *probe_columns(runs)]


def aggregate(group: Sequence[Run], options: Sequence[str], probe_keys: Sequence[str] = ()) -> Dict[str, Any]:
    """One leaderboard row: the group's options (all values where they vary), seeds and metric statistics
    (``probe_keys``: the table's probe accuracy columns, which a row without them holds as empty)."""
    per_run = [r.metrics() for r in group]
    row: Dict[str, Any] = {"variant": _values(group, "model.variant")}
    row.update({k: _values(group, k) for k in options})
    row["varies"] = [k for k in ("variant", *options) if _varies(group, "model.variant" if k == "variant" else k)]
    row["n"] = len(group)
    row["seeds"] = [r.seed for r in group]
    row.update({key: mean_std([m.get(key) for m in per_run]) for key in (*[k for k, _ in METRICS], *probe_keys, HEADLINE)})
    row["runs"] = [str(r.folder) for r in group]
    row["headline_values"] = [m[HEADLINE] for m in per_run]  # per seed: the units of the intervals and tests
    row["probe_acc_values"] = {k: [m.get(k) for m in per_run] for k in probe_keys
                               if any(m.get(k) is not None for m in per_run)}  # per seed, per level
    firsts = [f for f in (r.first_solved_steps() for r in group) if f is not None]
    # per level, the runs whose history has it: one that never validated the level is no "never"
    row["probe_first_solved"] = ({k: [f[k] for f in firsts if k in f] for k in row["probe_acc_values"]}
                                 if firsts else {})
    return row


def _values(group: Sequence[Run], key: str) -> Any:
    """The option's value in the group, or the list of its values when it varies inside the group."""
    decoded = [json.loads(v) for v in dict.fromkeys(_key(r.config.get(key)) for r in group)]
    return decoded[0] if len(decoded) == 1 else decoded


def _varies(group: Sequence[Run], key: str) -> bool:
    return len({_key(r.config.get(key)) for r in group}) > 1


def warn_duplicate_seeds(groups: Sequence[Sequence[Run]]) -> None:
    """Two runs of one configuration with the same seed are (nearly) the same run: both count in n."""
    for group in groups:
        seen: Dict[str, pathlib.Path] = {}
        for r in group:
            if _key(r.seed) in seen:
                warn(f"{seen[_key(r.seed)]} and {r.folder} have the same configuration and seed; both count in n")
            seen.setdefault(_key(r.seed), r.folder)


def pareto_front(points: Sequence[Tuple[Optional[float], Optional[float]]]) -> List[bool]:
    """For each (cost, loss): True when no other point has cost <= and loss <= with one strictly lower."""
    def dominated(i: int) -> bool:
        c, l = points[i]
        return any(j != i and c2 <= c and l2 <= l and (c2 < c or l2 < l)
                   for j, (c2, l2) in enumerate(points) if c2 is not None and l2 is not None)

    return [c is not None and l is not None and not dominated(i) for i, (c, l) in enumerate(points)]


def _label_counts(runs: Sequence[Run], label) -> Dict[str, int]:
    import collections

    return dict(collections.Counter(label(r.summary) for r in runs))


def code_versions(runs: Sequence[Run]) -> Dict[str, int]:
    """{code label (commit, '+dirty:<diff hash>', 'unknown'): runs}; warns in one line when there are several."""
    from analysis.provenance import code_label

    return _warn_if_mixed(runs, code_label, "code versions", "rows trained by other code may differ for that reason "
                          "alone: retrain them at one commit (python -m experiments.repro ... --no_reuse)")


def kernel_paths(runs: Sequence[Run]) -> Dict[str, int]:
    """{CPU kernel path label: runs}; warns in one line when there are several (they differ like seeds)."""
    from analysis.provenance import kernel_label

    return _warn_if_mixed(runs, kernel_label, "CPU kernel paths", "the same command on other kernels differs like "
                          "another seed (docs/results.md, 'Reproducibility')")


def _warn_if_mixed(runs: Sequence[Run], label, what: str, consequence: str) -> Dict[str, int]:
    counts = _label_counts(runs, label)
    if len(counts) > 1:
        warn(f"the table mixes {what}: {_code_list(counts)}; {consequence}")
    return counts


def _code_list(counts: Dict[str, int]) -> str:
    ordered = sorted(counts.items(), key=lambda item: (-item[1], item[0]))  # the most runs first
    return ", ".join(f"{label} ({n} run{'s' * (n != 1)})" for label, n in ordered)


def find_baseline(rows: Sequence[Dict[str, Any]], options: Sequence[str], name: str) -> Dict[str, Any]:
    """The row named ``name``: its label (as in the plot's legend) or, when only one row has it, its variant."""
    labels = [row_label(r, options) for r in rows]
    exact = [r for r, label in zip(rows, labels) if label == name]
    by_variant = [r for r in rows if r["variant"] == name]
    if len(exact) == 1 or (not exact and len(by_variant) == 1):
        return (exact or by_variant)[0]
    raise CompareError(f"--baseline: {name!r} names {'several rows' if exact or by_variant else 'no row'}; "
                       f"use one of the row labels: {'; '.join(labels)}")


def add_statistics(rows: Sequence[Dict[str, Any]], options: Sequence[str], baseline: Optional[str]) -> Optional[str]:
    """Each row's bootstrap interval of its mean ranking loss (over its seeds) and, with a baseline, its
    comparison with it: the difference in means with its interval, Hedges' g, Welch's two-sided p and that p
    after Holm's correction over every other row. Returns the baseline row's label."""
    from analysis import stats

    for row in rows:
        row["headline_ci"] = stats.bootstrap_ci(row["headline_values"])
        row["probe_levels"] = {k: {"ci": stats.bootstrap_ci(v), "solved": stats.solved_share(v),
                                   "solved_n": int(len(stats.finite(v)))} for k, v in row["probe_acc_values"].items()}
        for k, steps in row["probe_first_solved"].items():
            row["probe_levels"][k]["first_solved"] = first_solved_summary(steps)
    if baseline is None:
        return None
    base = find_baseline(rows, options, baseline)
    tests = {i: stats.compare_groups(r["headline_values"], base["headline_values"])
             for i, r in enumerate(rows) if r is not base}
    for i, test in stats.with_holm(tests).items():
        rows[i]["vs_baseline"] = test
    for key, base_values in base["probe_acc_values"].items():  # each level: its own family over the other rows
        level_tests = {i: stats.compare_groups(r["probe_acc_values"][key], base_values) for i, r in enumerate(rows)
                       if r is not base and key in r["probe_acc_values"]}
        for i, test in stats.with_holm(level_tests).items():
            rows[i]["probe_levels"][key]["vs_baseline"] = test
    return row_label(base, options)


def first_solved_summary(steps: Sequence[Optional[int]]) -> Dict[str, Optional[float]]:
    """The seeds' first solving steps (None: never solved): median, least and most over the seeds that solved, how
    many did, and of how many runs with a validation history."""
    solved = sorted(s for s in steps if s is not None)
    middle = statistics.median(solved) if solved else None
    return {"median": middle, "min": solved[0] if solved else None, "max": solved[-1] if solved else None,
            "solving": len(solved), "n": len(steps)}


def leaderboard(runs: Sequence[Run], group_by: Optional[Sequence[str]] = None,
                baseline: Optional[str] = None) -> Dict[str, Any]:
    """The table: rows sorted by mean validation loss, with the columns that describe them (and, with
    ``baseline``, each row's test against that row)."""
    refuse_incomparable(runs)
    kernel_paths(runs)
    code = code_versions(runs)
    options = differing_options(runs)
    keys = resolve_group_by(group_by, runs)
    # the grouping options first, then the other options that differ (listed with every value in a group)
    columns = [k for k in dict.fromkeys([*(keys or []), *options]) if k != "model.variant"]
    groups = group_runs(runs, keys)
    if keys is None:
        warn_duplicate_seeds(groups)
    probe_keys = [k for k, _ in probe_columns(runs)]
    rows = [aggregate(g, columns, probe_keys) for g in groups]
    rows.sort(key=lambda r: (r[HEADLINE]["mean"] is None, r[HEADLINE]["mean"] or 0.0))
    front = pareto_front([(r["train_flops"]["mean"], r[HEADLINE]["mean"]) for r in rows])
    for row, on_front in zip(rows, front):
        row["pareto"] = on_front
    base_label = add_statistics(rows, ["variant", *columns], baseline)
    return {"group_by": keys or "configuration (every option but the seed and output paths)", "code": code,
            "baseline": base_label,
            "options": ["variant", *columns], "metrics": [*[k for k, _ in metric_columns(runs)], HEADLINE],
            "headers": [h for _, h in metric_columns(runs)], "rows": rows,
            "runs": [{"run_dir": str(r.folder), "seed": r.seed, "variant": r.config.get("model.variant"), **r.metrics()}
                     for r in runs]}


# ---------------------------------------------------------------------------- outputs
def _cell(value: Any, varies: bool = False) -> str:
    """An option's value; the values of an option that varies inside a group joined with " / "."""
    from analysis.tables import fmt

    if varies:
        return " / ".join(_cell(v) for v in value)
    return json.dumps(value) if isinstance(value, (list, dict)) else fmt(value)


def _stat_cell(stat: Dict[str, Optional[float]], runs: int, integer: bool = False) -> str:
    """'mean ± std' (a single run: the value alone), '(n=k)' when only k of the row's runs have the number."""
    from analysis.tables import fmt

    if stat["mean"] is None:
        return "-"
    mean, std = stat["mean"], stat["std"]
    scientific = mean != 0 and (abs(mean) >= 1e5 or abs(mean) < 1e-3)
    text = fmt(int(round(mean))) if integer and std in (None, 0.0) else fmt(mean)
    if std is not None:
        text += " ± " + ("0" if std == 0 else f"{std:.3e}" if scientific else fmt(std))
    return text if stat["n"] == runs else f"{text} (n={stat['n']})"


def to_markdown(board: Dict[str, Any]) -> str:
    from analysis.tables import markdown_table

    headers = [*board["options"], "n", *board["headers"], "Pareto", "loss 95% CI"]
    integer = {"steps", "tokens", "parameters"}
    measured = [k for k in board["metrics"] if k != HEADLINE]
    rows = [[*[_cell(r[k], k in r["varies"]) for k in board["options"]], r["n"],
             *[_stat_cell(r[k], r["n"], k in integer) for k in measured], "*" if r["pareto"] else "",
             _interval(r.get("headline_ci", (None, None)))] for r in board["rows"]]
    if board.get("baseline"):
        headers += [f"Δ loss vs {board['baseline']} [95% CI]", "Hedges' g", "Welch p", "p (Holm)"]
        for cells, r in zip(rows, board["rows"]):
            cells.extend(_baseline_cells(r.get("vs_baseline")))
    note = ("Mean ± std (sample) over the n runs of each row (the seeds of one configuration, unless --group_by "
            "merges configurations; (n=k): only k of them have the number); train FLOPs: measured (routing-aware) "
            "training FLOPs spent; causal val loss: with the routing used in generation, for routing that sees the "
            "future; rows ranked by it where they have it, else by val loss; step s: median step time; Pareto *: "
            "no other row has both fewer training FLOPs and a lower (causal where present) validation loss; acc L<k> "
            "(routing probes only): next-token accuracy on the tokens of difficulty level k.")
    note += (" Loss 95% CI: percentile bootstrap over the row's seeds of the mean ranking loss (seeded; '-' with one "
             "seed).")
    if board.get("baseline"):
        note += (f" Against the baseline {board['baseline']}: difference in mean ranking loss (negative: lower loss) "
                 "with its bootstrap interval (each row's seeds resampled on their own), Hedges' g over seeds, Welch's "
                 "two-sided t-test over seeds, and its p after Holm's correction over the other rows.")
    code = board.get("code") or {}
    if len(code) > 1:
        note = f"**Warning: the table mixes code versions**: {_code_list(code)}.\n\n" + note
    elif code:
        note += f" Code: {next(iter(code))} (every run)."
    return markdown_table(headers, rows) + "\n\n" + note + "\n" + probe_levels_markdown(board)


def probe_levels_markdown(board: Dict[str, Any]) -> str:
    """The routing probes' second table: per row and difficulty level, the accuracy's seed mean with its bootstrap
    interval over seeds and the seeds that solve the level, and (with a baseline) the difference from the
    baseline's with Welch's two-sided p after Holm's correction over the other rows, level by level. '' for
    tables without probe runs."""
    from analysis.stats import SOLVED
    from analysis.tables import markdown_table

    levels = [k for k in board["metrics"] if k.startswith("probe_acc_L") and any(k in r.get("probe_levels", {})
                                                                                   for r in board["rows"])]
    if not levels:
        return ""
    headers = ["row", "n", *[f"acc {k[len('probe_acc_'):]} [95% CI] (seeds >= {SOLVED})" for k in levels]]
    if board.get("baseline"):
        headers += [f"Δ {k[len('probe_acc_'):]} vs baseline [95% CI], p (Holm)" for k in levels]
    timed = any(r.get("probe_first_solved") for r in board["rows"])
    if timed:
        headers += [f"first step {k[len('probe_acc_'):]} >= {SOLVED}: median [min, max] (seeds)" for k in levels]
    rows = []
    for r in board["rows"]:
        cells = [row_label(r, board["options"]), r["n"], *[_level_cell(r, k) for k in levels]]
        if board.get("baseline"):
            cells += [_level_test_cell(r.get("probe_levels", {}).get(k), r is _baseline_row(board)) for k in levels]
        if timed:
            cells += [_first_solved_cell(r.get("probe_levels", {}).get(k, {}).get("first_solved")) for k in levels]
        rows.append(cells)
    note = ("Accuracy per difficulty level: the seed mean of each run's last-validation accuracy on the tokens of that "
            "level, its 95% percentile bootstrap interval over the row's seeds (the runs are the units, never tokens), "
            f"and how many seeds reach {SOLVED} (solve the level).")
    if board.get("baseline"):
        note += (f" Against the baseline {board['baseline']}: difference in mean accuracy (positive: more accurate) "
                 "with its bootstrap interval, Welch's two-sided t-test over seeds, Holm's correction over the other "
                 "rows, each level its own family.")
    if timed:
        note += (f" First step >= {SOLVED}: the optimiser steps done at each run's first validation (every val_every "
                 "steps, so at that resolution) reaching it on the level, from summary.json's val_history: the median, "
                 "least and most over the seeds that reach it, and how many do of the runs with a history ('never': "
                 "none; '-': no run of the row has a history).")
    return "\n" + markdown_table(headers, rows) + "\n\n" + note + "\n"


def _baseline_row(board: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    return next((r for r in board["rows"] if row_label(r, board["options"]) == board.get("baseline")), None)


def _level_cell(row: Dict[str, Any], key: str) -> str:
    from analysis.tables import fmt

    level = row.get("probe_levels", {}).get(key)
    if level is None or row[key]["mean"] is None:
        return "-"
    text = fmt(row[key]["mean"], 3) + (f" {_interval(level['ci'], 3)}" if level["ci"][0] is not None else "")
    solved = round(level["solved"] * level["solved_n"]) if level["solved"] is not None else 0
    return f"{text} ({solved}/{level['solved_n']})"


def _first_solved_cell(first: Optional[Dict[str, Optional[float]]]) -> str:
    from analysis.tables import fmt

    if not first or not first["n"]:
        return "-"
    count = f"({first['solving']}/{first['n']})"
    if first["median"] is None:
        return f"never {count}"
    step = lambda v: fmt(int(v)) if float(v).is_integer() else f"{v:,.1f}"  # noqa: E731  (a median of two: x.5)
    return f"{step(first['median'])} [{step(first['min'])}, {step(first['max'])}] {count}"


def _level_test_cell(level: Optional[Dict[str, Any]], is_baseline: bool) -> str:
    from analysis.tables import fmt

    if is_baseline:
        return "baseline"
    test = (level or {}).get("vs_baseline")
    if test is None or test["difference"] is None:
        return "-"
    text = f"{test['difference']:+.3f}"
    if test["ci_low"] is not None:
        text += f" [{test['ci_low']:+.3f}, {test['ci_high']:+.3f}]"
    return text + f", p {fmt(test['p_holm'], 3)}"


def _interval(ci, digits: int = 4) -> str:
    from analysis.tables import fmt

    lo, hi = ci
    return "-" if lo is None else f"[{fmt(lo, digits)}, {fmt(hi, digits)}]"


def _baseline_cells(test: Optional[Dict[str, Any]]) -> List[str]:
    """Δ [CI], g, p, p (Holm) of a row against the baseline; the baseline row itself says so."""
    from analysis.tables import fmt

    if test is None:
        return ["baseline", "", "", ""]
    diff = "-" if test["difference"] is None else f"{test['difference']:+.4f}"
    if test["ci_low"] is not None:
        diff += f" [{test['ci_low']:+.4f}, {test['ci_high']:+.4f}]"
    return [diff, fmt(test["hedges_g"], 2), fmt(test["p"], 3), fmt(test["p_holm"], 3)]


def write_csv(board: Dict[str, Any], path: pathlib.Path) -> None:
    header = [*board["options"], "n", "seeds", *[f"{k}_{s}" for k in board["metrics"] for s in ("mean", "std")],
              "pareto", "runs", "headline_ci_low", "headline_ci_high", *[f"vs_baseline_{k}" for k in BASELINE_FIELDS]]
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for r in board["rows"]:
            writer.writerow([*[_csv(r[k]) for k in board["options"]], r["n"], _csv(r["seeds"]),
                             *[_csv(r[k][s]) for k in board["metrics"] for s in ("mean", "std")], r["pareto"],
                             " ".join(r["runs"]), *map(_csv, r.get("headline_ci", (None, None))),
                             *[_csv((r.get("vs_baseline") or {}).get(k)) for k in BASELINE_FIELDS]])


def _csv(value: Any) -> Any:
    if value is None:
        return ""
    return json.dumps(value) if isinstance(value, (list, dict)) else value


def row_label(row: Dict[str, Any], options: Sequence[str]) -> str:
    """The legend label: the variant and the options this row holds (options its variant does not read, and
    --max_steps caps of FLOPs-budget runs, are left out: they tell the configurations apart in the table only)."""
    parts = [_cell(row["variant"], "variant" in row["varies"])]
    parts += [f"{k.split('.')[-1]}={_cell(row[k], k in row['varies'])}" for k in options
              if k not in ("variant", "trainer.max_steps", "val_every") and row.get(k) is not None]
    return " ".join(parts)


def plot(board: Dict[str, Any], path: pathlib.Path) -> Optional[pathlib.Path]:
    """Validation loss vs training FLOPs, one point per configuration (error bars: std over seeds), the
    Pareto front drawn through its points. None when no configuration has both numbers."""
    from analysis.tables import figure

    rows = [r for r in board["rows"] if r["train_flops"]["mean"] is not None and r[HEADLINE]["mean"] is not None]
    if not rows:
        return None
    fig, axes = figure(1, 1, width=6.4, height=4.8)
    ax = axes[0, 0]
    for i, r in enumerate(rows):
        ax.errorbar(r["train_flops"]["mean"], r[HEADLINE]["mean"], xerr=r["train_flops"]["std"] or 0.0,
                    yerr=r[HEADLINE]["std"] or 0.0, fmt="osD^vP*Xh<>"[i % 11], color=f"C{i % 10}", capsize=3,
                    label=f"{row_label(r, board['options'])} (n={r['n']})")
    front = sorted((r["train_flops"]["mean"], r[HEADLINE]["mean"]) for r in rows if r["pareto"])
    ax.plot(*zip(*front), color="black", linestyle="--", linewidth=1, marker="o", markerfacecolor="none",
            markersize=12, label="Pareto front")
    costs = [r["train_flops"]["mean"] for r in rows]
    if min(costs) > 0 and max(costs) / min(costs) > 10:
        ax.set_xscale("log")
    ax.set_xlabel("training FLOPs spent (measured)")
    ax.set_ylabel("validation loss (causal where the run has one; mean ± std)")
    ax.set_title("Validation loss vs training compute")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0)  # beside the axes
    fig.savefig(path, dpi=120, bbox_inches="tight")
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def check_out(out: pathlib.Path) -> None:
    """``--out`` must be a folder this user can write, found before any run is read (nothing is left behind)."""
    from lightning_modules.storage import probe_writable  # the standard library only: no training stack

    if out.exists() and not out.is_dir():
        raise CompareError(f"--out: {out} is a file, not a folder; give a folder for leaderboard.md/.csv/.json/.png")
    try:
        probe_writable(out)
    except OSError as err:
        raise CompareError(f"--out: cannot write to {err.filename or out} ({err.strerror or err}); make it "
                           "writable or choose another folder") from None


def write_leaderboard(board: Dict[str, Any], out: pathlib.Path, name: str = "leaderboard") -> Dict[str, pathlib.Path]:
    """``<out>/<name>.md``, ``.csv``, ``.json`` and ``.png`` (the plot, when there is something to plot)."""
    try:
        return _write_files(board, out, name)
    except OSError as err:  # a disk that filled since check_out
        raise CompareError(f"--out: cannot write {err.filename or out} ({err.strerror or err}); free space or "
                           "choose another folder") from None


def _write_files(board: Dict[str, Any], out: pathlib.Path, name: str) -> Dict[str, pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = {"md": out / f"{name}.md", "csv": out / f"{name}.csv", "json": out / f"{name}.json"}
    paths["md"].write_text(to_markdown(board))
    stored = with_runs_relative_to(board, out)
    write_csv(stored, paths["csv"])
    paths["json"].write_text(json.dumps(stored, indent=2, default=str) + "\n")
    image = plot(board, out / f"{name}.png")
    if image is not None:
        paths["png"] = image
    return paths


def with_runs_relative_to(board: Dict[str, Any], folder: pathlib.Path) -> Dict[str, Any]:
    """The board with each run folder that lies below ``folder`` named relative to it (``runs/mod-tiny/version_0``),
    others by their full path: a leaderboard written beside its runs (a published report's records) then names them on
    any machine it is copied to, not by the path of the machine that wrote it."""
    root = folder.resolve()

    def portable(run_dir: str) -> str:
        resolved = pathlib.Path(run_dir).resolve()
        return resolved.relative_to(root).as_posix() if resolved.is_relative_to(root) else str(resolved)

    return {**board, "rows": [{**row, "runs": [portable(d) for d in row["runs"]]} for row in board["rows"]],
            "runs": [{**run, "run_dir": portable(run["run_dir"])} for run in board["runs"]]}


def csv_runs_renamed(text: str, rename: Callable[[str], str]) -> str:
    """A ``leaderboard.csv``'s text with each run folder of its ``runs`` column passed through ``rename``, every
    other byte as ``write_csv`` wrote it (the same writer writes it back): publish names a run by its record."""
    rows = list(csv.reader(io.StringIO(text, newline="")))
    if not rows or "runs" not in rows[0]:
        return text
    column = rows[0].index("runs")
    for row in rows[1:]:
        row[column] = " ".join(rename(name) for name in row[column].split())
    written = io.StringIO(newline="")
    csv.writer(written).writerows(rows)
    return written.getvalue()


def compare(patterns: Sequence[str], group_by: Optional[Sequence[str]] = None,
            out: Optional[pathlib.Path] = None, baseline: Optional[str] = None) -> Dict[str, Any]:
    """Read the runs, build the table and write it (``out``); the table as a dict."""
    if out is not None:
        check_out(pathlib.Path(out))
    board = leaderboard(read_runs(find_run_folders(patterns)), group_by, baseline)
    if out is not None:
        board["files"] = {k: str(v) for k, v in write_leaderboard(board, pathlib.Path(out)).items()}
    return board
