"""``necessity``: does a level of a probe need depth? Dense vanilla at several depths, equal steps, several seeds.

    python -m experiments.repro necessity --out DIR --steps 16000 --layers 1,2,4 --seeds 5 --seed 1357 \
        --jobs 2 --threads 1 -- --data probe-v8/induct --model.d_model 64 --model.n_head 4 --data.loss_mask labelled \
        --val_every 1000 ...

The depth is the only difference between the rows (every other option comes after ``--``), so what a deeper
model solves and a shallow one does not is what depth buys at that width and step count. Every run is an
ordinary ``experiments.run`` run, resumable like every ``repro`` run (a rerun of the command skips the finished
runs and resumes the one a kill cut off). The tables are ``experiments.compare``'s, grouped by depth with the
shallowest as the baseline: accuracy per level with bootstrap intervals over seeds, the seeds that solve each
level (accuracy >= 0.9), Welch's test over seeds against the shallowest with Holm's correction over the deeper
rows, and the first step each run reaches 0.9 (with ``--val_every`` below ``--steps``).

``--tables_from DIR`` rebuilds the tables and the verdict from finished run folders under DIR (a published check's
``runs/``) without training. The verdict applies the rule of the pre-registered checks (docs/results/preregistered/probe_induct_necessity_16k.md)
to the judged level (``--level``; default the top level of the runs' task):

* **met**: the shallowest depth solves the level in at most ``--shallow_max`` of its seeds, and every deeper depth
  has a positive difference from it that passes Holm (alpha 0.05) and solves the level in at least
  ``--min_solving`` seeds;
* **partly met**: the shallow condition holds and some deeper depths, not all, meet both of theirs (named);
* **not met** otherwise.
"""
from __future__ import annotations

import pathlib
from typing import Any, Dict, List, Optional, Sequence

from architectures.config import ConfigError
from experiments.repro.common import Context

ALPHA = 0.05


def check_settings(layers: Sequence[int], seeds: int, shallow_max: int, min_solving: int) -> None:
    """Refuse a grid the rule cannot judge, naming the option and what it accepts."""
    if len(set(layers)) != len(layers) or len(layers) < 2 or min(layers) < 1:
        raise ConfigError(f"--layers: at least two different positive depths, got {','.join(map(str, layers))}")
    if seeds < 2:
        raise ConfigError(f"--seeds: at least 2 (Welch's test needs two runs per depth; 5 or more for a claim), got {seeds}")
    if not 0 <= shallow_max < seeds:
        raise ConfigError(f"--shallow_max: 0 to {seeds - 1} (fewer than --seeds), got {shallow_max}")
    if not 1 <= min_solving <= seeds:
        raise ConfigError(f"--min_solving: 1 to {seeds} (--seeds), got {min_solving}")


def necessity_experiment(ctx: Context, layers: Sequence[int], seeds: int, level: Optional[int] = None,
                         shallow_max: int = 1, min_solving: int = 4) -> Dict[str, Any]:
    from analysis import compare

    check_settings(layers, seeds, shallow_max, min_solving)
    layers = sorted(layers)
    points = [(n, ctx.seed + k) for n in layers for k in range(seeds)]  # (depth, seed) of each run
    grid = [["--variant", "vanilla", "--model.n_layer", str(n), "--seed", str(seed)] for n, seed in points]
    ctx.validate(grid)
    with ctx.part("training the runs"):
        summaries = ctx.run_many([(options, None, None) for options in grid])
    with ctx.part("tables"):
        board = depth_table(compare.read_runs([pathlib.Path(s["run_dir"]) for s in summaries]), layers)
        verdict = necessity_verdict(board, level, shallow_max=shallow_max, min_solving=min_solving)
    rows = [{"variant": "vanilla", "n_layer": n, "seed": seed, "run_dir": s["run_dir"], "steps": s["steps"]}
            for (n, seed), s in zip(points, summaries)]
    settings = {"layers": layers, "seeds": seeds, "first_seed": ctx.seed, "steps": ctx.steps,
                "shallow_max": shallow_max, "min_solving": min_solving, "run_options": ctx.run_options}
    results = {"settings": settings, "verdict": verdict, "runs": rows}
    ctx.write_report("Depth necessity: vanilla at several depths, equal steps", report_sections(settings, verdict),
                     results, board=board)
    return results


def tables_from(ctx: Context, folder: str, level: Optional[int] = None, shallow_max: int = 1,
                min_solving: int = 4) -> Dict[str, Any]:
    """The tables and the verdict from finished run folders (a published check's ``runs/``, or the log folder of runs
    trained otherwise), without training: the depths and seeds are the runs' own."""
    from analysis import compare

    runs = compare.read_runs(compare.find_run_folders([folder]))
    layers = sorted({int(r.config["model.n_layer"]) for r in runs})
    seeds = min(sum(int(r.config["model.n_layer"]) == n for r in runs) for n in layers)
    check_settings(layers, seeds, shallow_max, min_solving)
    with ctx.part("tables"):
        board = depth_table(runs, layers)
        verdict = necessity_verdict(board, level, shallow_max=shallow_max, min_solving=min_solving)
    for run in runs:
        ctx.record_run(run.folder)
    rows = [{"variant": r.config.get("model.variant"), "n_layer": int(r.config["model.n_layer"]), "seed": r.seed,
             "run_dir": str(r.folder), "steps": r.summary.get("steps")} for r in runs]
    settings = {"layers": layers, "seeds": sorted({r.seed for r in runs}), "tables_from": folder,
                "shallow_max": shallow_max, "min_solving": min_solving}
    intro = (f"Rebuilt from the run folders under `{folder}` (no run retrained): dense vanilla at "
             f"{', '.join(map(str, layers))} layers, {len(runs)} runs. Accuracies are each run's last validation; "
             "intervals are percentile bootstraps over seeds.")
    results = {"settings": settings, "verdict": verdict, "runs": rows, "tables_from": True}
    ctx.write_report("Depth necessity: vanilla at several depths, equal steps", [intro, "", verdict_line(verdict), ""],
                     results, board=board)
    return results


def depth_table(runs, layers: Sequence[int]) -> Dict[str, Any]:
    """``experiments.compare``'s table of the runs grouped by depth, against the shallowest (also the report's run
    table)."""
    from analysis import compare

    return compare.leaderboard(runs, ["model.n_layer"], f"vanilla n_layer={min(layers)}")


def necessity_verdict(board: Dict[str, Any], level: Optional[int] = None, shallow_max: int = 1,
                      min_solving: int = 4) -> Dict[str, Any]:
    """The rule's verdict on ``board`` (``experiments.compare``'s table grouped by ``model.n_layer``, the shallowest
    depth its baseline) for ``level`` (default: the top level the runs report): the figures it rests on per depth.
    A board the rule cannot judge is refused: another baseline, or a depth with fewer than two runs that measured
    the level (its test would drop out of Holm's family and leave the others' p uncorrected)."""
    rows = {int(r["model.n_layer"]): r for r in board["rows"]}
    shallow, deeper = min(rows), sorted(rows)[1:]
    if board.get("baseline") != f"vanilla n_layer={shallow}":
        raise ConfigError(f"necessity: the table's baseline is {board.get('baseline')!r}, not the shallowest depth "
                          f"('vanilla n_layer={shallow}'); build it with --group_by model.n_layer and that baseline")
    levels = sorted({int(k[len("probe_acc_L"):]) for r in rows.values() for k in r.get("probe_levels", {})})
    if not levels:
        raise ConfigError("necessity: the runs report no probe levels; train them on a probe (--data probe-v8/induct) "
                          "or a corpus with a label file")
    level = levels[-1] if level is None else level
    key = f"probe_acc_L{level}"
    if level not in levels:
        raise ConfigError(f"--level: the runs report levels {', '.join(map(str, levels))}, not {level}")
    short = [n for n, r in rows.items() if r.get("probe_levels", {}).get(key, {}).get("solved_n", 0) < 2]
    if short:
        raise ConfigError(f"necessity: {', '.join(f'{n} layers' for n in short)}: fewer than two runs measured level "
                          f"{level}; the rule needs two or more per depth (train the missing seeds)")
    depths = {n: depth_figures(row, key, min_solving, is_shallow=n == shallow) for n, row in rows.items()}
    shallow_fails = depths[shallow]["solving"] <= shallow_max
    meeting = [n for n in deeper if depths[n]["meets"]]
    verdict = ("met" if shallow_fails and len(meeting) == len(deeper) else
               "partly met" if shallow_fails and meeting else "not met")
    return {"verdict": verdict, "level": level, "shallow": shallow, "shallow_fails": shallow_fails,
            "deeper_meeting": meeting, "depths": depths, "shallow_max": shallow_max, "min_solving": min_solving}


def depth_figures(row: Dict[str, Any], key: str, min_solving: int, is_shallow: bool) -> Dict[str, Any]:
    """One depth's figures for the rule: mean accuracy, interval, seeds solving (a run without a number solves
    nothing), runs, the test against the shallowest and whether it meets the deeper depths' two conditions."""
    figures = row["probe_levels"][key]
    test = figures.get("vs_baseline") or {}
    solving = round(figures["solved"] * figures["solved_n"]) if figures["solved"] is not None else 0
    difference, p_holm = test.get("difference"), test.get("p_holm")
    passes = difference is not None and difference > 0 and p_holm is not None and p_holm < ALPHA
    return {"accuracy": row[key]["mean"], "ci": figures["ci"], "solving": solving, "n": row["n"],
            "difference": difference, "p_holm": p_holm,
            "meets": None if is_shallow else bool(passes and solving >= min_solving)}


def verdict_line(verdict: Dict[str, Any]) -> str:
    """One sentence: the verdict and the figures it rests on."""
    level, shallow, depths = verdict["level"], verdict["shallow"], verdict["depths"]

    def number(value: Optional[float], form: str) -> str:
        return "-" if value is None else format(value, form)

    def depth(n: int) -> str:
        d = depths[n]
        text = f"{n} layer{'s' if n > 1 else ''} {number(d['accuracy'], '.3f')} ({d['solving']}/{d['n']} seeds solve it"
        if n != shallow:
            text += (f"; {number(d['difference'], '+.3f')} vs {shallow} layer{'s' if shallow > 1 else ''}, Holm p "
                     f"{number(d['p_holm'], '.3g')}")
        return text + ")"

    meeting = ", ".join(str(n) for n in verdict["deeper_meeting"]) or "none"
    return (f"**Verdict: {verdict['verdict']}.** Level {level}: " + "; ".join(depth(n) for n in sorted(depths)) +
            f". The shallowest depth may solve it in at most {seed_count(verdict['shallow_max'])} "
            f"({'holds' if verdict['shallow_fails'] else 'fails'}); each deeper depth must beat it after Holm "
            f"(alpha {ALPHA}) and solve it in at least {seed_count(verdict['min_solving'])} (deeper depths meeting both: "
            f"{meeting}).")


def seed_count(k: int) -> str:
    return f"{k} seed{'' if k == 1 else 's'}"


def report_sections(settings: Dict[str, Any], verdict: Dict[str, Any]) -> List[str]:
    seeds = f"{settings['first_seed']}-{settings['first_seed'] + settings['seeds'] - 1}"
    intro = (f"Dense vanilla at {', '.join(map(str, settings['layers']))} layers, {settings['steps']} steps each, "
             f"seeds {seeds}; every other option as given after `--` (the depth is the only difference). "
             "Accuracies are each run's last validation; intervals are percentile bootstraps over seeds.")
    return [intro, "", verdict_line(verdict), ""]
