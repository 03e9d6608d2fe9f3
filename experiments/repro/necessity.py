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

The verdict applies the rule of the pre-registered checks (docs/results/preregistered/probe_induct_necessity_16k.md)
to the judged level (``--level``; default the top level of the runs' task):

* **met**: the shallowest depth solves the level in at most ``--shallow_max`` of its seeds, and every deeper depth
  has a positive difference from it that passes Holm (alpha 0.05) and solves the level in at least
  ``--min_solving`` seeds;
* **partly met**: the shallow condition holds and some deeper depths, not all, meet both of theirs (named);
* **not met** otherwise.
"""
from __future__ import annotations

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
    check_settings(layers, seeds, shallow_max, min_solving)
    layers = sorted(layers)
    grid = [["--variant", "vanilla", "--model.n_layer", str(n), "--seed", str(ctx.seed + k)]
            for n in layers for k in range(seeds)]
    ctx.validate(grid)
    with ctx.part("training the runs"):
        summaries = ctx.run_many([(options, None, None) for options in grid])
    with ctx.part("tables"):
        board = depth_table(ctx, [s["run_dir"] for s in summaries], layers)
        verdict = necessity_verdict(board, level, shallow_max=shallow_max, min_solving=min_solving)
    rows = [{"variant": "vanilla", "n_layer": n, "seed": ctx.seed + k, "run_dir": s["run_dir"], "steps": s["steps"]}
            for (n, k), s in zip([(n, k) for n in layers for k in range(seeds)], summaries)]
    settings = {"layers": layers, "seeds": seeds, "first_seed": ctx.seed, "steps": ctx.steps,
                "shallow_max": shallow_max, "min_solving": min_solving, "run_options": ctx.run_options}
    results = {"settings": settings, "verdict": verdict, "runs": rows}
    ctx.write_report("Depth necessity: vanilla at several depths, equal steps", report_sections(settings, verdict),
                     results)
    return results


def depth_table(ctx: Context, run_dirs: Sequence[str], layers: Sequence[int]) -> Dict[str, Any]:
    """``experiments.compare``'s table of the runs grouped by depth, against the shallowest; also the report's run
    table (``Context.run_table`` builds the same one)."""
    import pathlib

    from analysis import compare

    ctx.table_group_by, ctx.table_baseline = ["model.n_layer"], f"vanilla n_layer={min(layers)}"
    return compare.leaderboard(compare.read_runs([pathlib.Path(d) for d in run_dirs]), ctx.table_group_by,
                               ctx.table_baseline)


def necessity_verdict(board: Dict[str, Any], level: Optional[int] = None, shallow_max: int = 1,
                      min_solving: int = 4) -> Dict[str, Any]:
    """The rule's verdict on ``board`` (``experiments.compare``'s table grouped by ``model.n_layer``, the shallowest
    depth its baseline) for ``level`` (default: the top level the runs report): the figures it rests on per depth."""
    rows = {int(r["model.n_layer"]): r for r in board["rows"]}
    shallow, deeper = min(rows), sorted(rows)[1:]
    levels = sorted(int(k[len("probe_acc_L"):]) for k in rows[shallow].get("probe_levels", {}))
    if not levels:
        raise ConfigError("necessity: the runs report no probe levels; train them on a probe (--data probe-v8/induct) "
                          "or a corpus with a label file")
    level = levels[-1] if level is None else level
    key = f"probe_acc_L{level}"
    if key not in rows[shallow]["probe_levels"]:
        raise ConfigError(f"--level: the runs report levels {', '.join(map(str, levels))}, not {level}")
    depths = {}
    for n, row in rows.items():
        figures = row["probe_levels"][key]
        test = figures.get("vs_baseline") or {}
        solving = round(figures["solved"] * figures["solved_n"]) if figures["solved"] is not None else 0
        passes = test.get("difference") is not None and test["difference"] > 0 and test.get("p_holm") is not None \
            and test["p_holm"] < ALPHA
        depths[n] = {"accuracy": row[key]["mean"], "ci": figures["ci"], "solving": solving, "n": figures["solved_n"],
                     "difference": test.get("difference"), "p_holm": test.get("p_holm"),
                     "meets": None if n == shallow else bool(passes and solving >= min_solving)}
    shallow_fails = depths[shallow]["solving"] <= shallow_max
    meeting = [n for n in deeper if depths[n]["meets"]]
    verdict = ("met" if shallow_fails and len(meeting) == len(deeper) else
               "partly met" if shallow_fails and meeting else "not met")
    return {"verdict": verdict, "level": level, "shallow": shallow, "shallow_fails": shallow_fails,
            "deeper_meeting": meeting, "depths": depths, "shallow_max": shallow_max, "min_solving": min_solving}


def verdict_line(verdict: Dict[str, Any]) -> str:
    """One sentence: the verdict and the figures it rests on."""
    level, shallow, depths = verdict["level"], verdict["shallow"], verdict["depths"]

    def depth(n: int) -> str:
        d = depths[n]
        text = f"{n} layer{'s' if n > 1 else ''} {d['accuracy']:.3f} ({d['solving']}/{d['n']} seeds solve it"
        if n != shallow:
            p = "-" if d["p_holm"] is None else f"{d['p_holm']:.3g}"
            text += f"; {d['difference']:+.3f} vs {shallow} layer{'s' if shallow > 1 else ''}, Holm p {p}"
        return text + ")"

    meeting = ", ".join(str(n) for n in verdict["deeper_meeting"]) or "none"
    return (f"**Verdict: {verdict['verdict']}.** Level {level}: " + "; ".join(depth(n) for n in sorted(depths)) +
            f". The shallowest depth may solve it in at most {seeds(verdict['shallow_max'])} "
            f"({'holds' if verdict['shallow_fails'] else 'fails'}); each deeper depth must beat it after Holm "
            f"(alpha {ALPHA}) and solve it in at least {seeds(verdict['min_solving'])} (deeper depths meeting both: "
            f"{meeting}).")


def seeds(k: int) -> str:
    return f"{k} seed{'' if k == 1 else 's'}"


def report_sections(settings: Dict[str, Any], verdict: Dict[str, Any]) -> List[str]:
    seeds = f"{settings['first_seed']}-{settings['first_seed'] + settings['seeds'] - 1}"
    intro = (f"Dense vanilla at {', '.join(map(str, settings['layers']))} layers, {settings['steps']} steps each, "
             f"seeds {seeds}; every other option as given after `--` (the depth is the only difference). "
             "Accuracies are each run's last validation; intervals are percentile bootstraps over seeds.")
    return [intro, "", verdict_line(verdict), ""]
