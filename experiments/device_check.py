"""One-command GPU check: ``python -m experiments.device_check --out DIR`` (under 8 minutes on one GPU).

1. ``experiments.bench`` of vanilla, mod, moe (E=8, top-1) and mom_e at ``small``, T=1024, bf16-mixed,
   eager and then compiled (``--compile``: graph breaks and recompilations per variant);
2. ``medium`` vanilla at T=1024, batch 16, bf16 with ``--activation_checkpointing blocks``, alone in its
   bench process: its CUDA peak next to the memory plan's prediction (``model_tools.memory``);
3. a 50-step ``experiments.run --variant mod --size small --trainer.precision bf16-mixed`` on a local
   text file (written from the embedded corpus, byte tokenizer: no network, no tokenizer training).

Writes ``DIR/device_check.json`` (every number) and ``DIR/device_check.md`` (the table and the goals:
vanilla compiled MFU >= 45%, MoD step-time ratio / FLOPs ratio <= 1.10, MoE step time <= 1.3x vanilla).
A phase that would start after ``--budget_s`` is skipped and listed as skipped. ``--quick`` is the CPU
smoke path (tiny shapes, a few steps, the "aot_eager" compile backend) that the tests run.
"""
from __future__ import annotations

import argparse
import json
import pathlib
import sys
import time
from typing import Any, Dict, List, Optional

from architectures.registry import get_variant, tagged

VARIANTS = tagged("device_check")  # the registry entries tagged "device_check"
# Static shapes: no expert or module can idle, so no shape depends on the routing (one compiled graph).
# The others dispatch tokens by data-dependent counts (many graphs, the least known compile time): last.
STATIC = [v for v in VARIANTS if not get_variant(v).model_class().may_skip_parameters]
DYNAMIC = [v for v in VARIANTS if v not in STATIC]
# (phase name, variants, compiled)
RUN = ("run", [], False)  # the 50-step training run; before the dynamic compiles
# medium vanilla with every block checkpointed, alone in its bench process: its CUDA peak against the memory plan
CHECKPOINTED = ("checkpointed", ["vanilla"], False)
PHASES = [("eager", VARIANTS, False), ("compiled", STATIC, True), CHECKPOINTED, RUN, ("compiled", DYNAMIC, True)]
# --quick compiles only the static-shape variants: the data-dependent ones recompile for many seconds on a
# CPU core (tests/test_compile.py covers them)
QUICK_PHASES = [("eager", VARIANTS, False), ("compiled", STATIC, True), CHECKPOINTED, RUN]
GOALS = {
    "vanilla compiled MFU >= 0.45": ("compiled", "vanilla", "mfu", 0.45, "min"),
    "mod step-time ratio / FLOPs ratio <= 1.10": ("compiled", "mod", "time_over_flops_ratio", 1.10, "max"),
    "moe step time <= 1.3x vanilla": ("compiled", "moe", "step_time_ratio", 1.3, "max"),
}


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiments.device_check", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="folder for device_check.json / .md and the run")
    parser.add_argument("--quick", action="store_true", help="CPU smoke path: tiny shapes, a few steps")
    parser.add_argument("--batch_size", type=int, default=16,
                        help="sequences per step in the GPU benchmark phases (ignored with --quick: 2)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and phase")
    parser.add_argument("--run_steps", type=int, default=50,
                        help="steps of the closing MoD training run (python -m experiments.run), validated at its end")
    parser.add_argument("--budget_s", type=float, default=420.0, help="start no phase after this many seconds")
    return parser


def bench_argv(args, variants: List[str], compiled: bool, phase: str = "eager") -> List[str]:
    common = ["--variants", ",".join(variants), "--no_hf", "--no_minimal", "--steps", str(args.steps)]
    if phase == "checkpointed":
        common += ["--activation_checkpointing", "blocks"]
        if not args.quick:  # medium (355M) at T=1024, batch 16, bf16
            return common + ["--size", "medium", "--seq_len", "1024", "--batch_size", str(args.batch_size),
                             "--warmup", "2", "--device", "cuda", "--precision", "bf16-mixed"]
    if args.quick:
        shape = ["--size", "tiny", "--seq_len", "32", "--batch_size", "2", "--vocab_size", "256",
                 "--set", "d_model=32", "--set", "n_layer=4", "--set", "n_head=2", "--warmup", "1",
                 "--device", "cpu", "--recompile_steps", "2"]
    else:
        shape = ["--size", "small", "--seq_len", "1024", "--batch_size", str(args.batch_size), "--warmup", "3",
                 "--device", "cuda", "--precision", "bf16-mixed", "--recompile_steps", "20"]
    return common + shape + (["--compile"] if compiled else [])


def run_phase(args, variants: List[str], compiled: bool, phase: str = "eager") -> Dict[str, Dict[str, Any]]:
    from experiments import bench
    from model_tools import compiling

    bench_args = bench.parse_args(bench_argv(args, variants, compiled, phase))
    default_backend = compiling.DEFAULT_BACKEND
    if args.quick:
        compiling.DEFAULT_BACKEND = "aot_eager"  # inductor's C++ build costs ~30 s per model on a CPU core
    try:
        results = bench.run(bench_args)
    finally:
        compiling.DEFAULT_BACKEND = default_backend
    seq_len = bench_args.seq_len or 1024
    bench.print_table(results, bench_args, seq_len)
    if phase == "checkpointed":
        add_planned_peak(results, bench_args, seq_len)
    return results


def add_planned_peak(results: Dict[str, Dict[str, Any]], bench_args, seq_len: int) -> None:
    """The memory plan's peak (``model_tools.memory``, measured on the CPU) next to the measured one
    (``memory_mb``: CUDA peak allocated of the step; on the CPU smoke path the bench's CPU figure)."""
    from experiments import bench
    from model_tools.memory import build_for_measurement, plan_model

    for name, r in results.items():
        if name in bench.REFERENCES:
            continue
        model = build_for_measurement(bench.base_config(bench_args, name))
        plan = plan_model(model, bench_args.batch_size, seq_len, precision=bench_args.precision,
                          checkpointing=bench_args.activation_checkpointing)
        r["planned_peak_mb"] = plan.peak() / 2**20
        r["planned_peak_no_checkpointing_mb"] = plan.peak(plain=True) / 2**20
        r["planned_over_measured"] = r["planned_peak_mb"] / r["memory_mb"] if r["memory_mb"] else None
        del model


def write_text_corpus(path: pathlib.Path, max_chars: int) -> pathlib.Path:
    from datamodules.corpora import EmbeddedCorpus

    text, size = [], 0
    for doc in EmbeddedCorpus().documents():
        text.append(doc)
        size += len(doc)
        if size >= max_chars:
            break
    path.write_text("\n\n".join(text), encoding="utf-8")
    return path


def training_run(args, out: pathlib.Path) -> Dict[str, Any]:
    """The 50-step MoD run, exactly the command a user types (run in this process); its summary."""
    from experiments import run as run_cli

    corpus = write_text_corpus(out / "corpus.txt", 200_000 if args.quick else 4_000_000)
    argv = ["--variant", "mod", "--data", "text", "--data.path", str(corpus), "--tokenizer", "bytes",
            "--max_steps", str(args.run_steps), "--val_every", str(args.run_steps), "--val_blocks",
            "4" if args.quick else "16", "--log_dir", str(out / "runs"), "--trainer.enable_progress_bar", "false"]
    if args.quick:
        argv += ["--size", "tiny", "--model.d_model", "32", "--model.n_layer", "2", "--model.n_head", "2",
                 "--model.block_size", "64", "--data.batch_size", "2", "--trainer.accelerator", "cpu"]
    else:
        argv += ["--size", "small", "--trainer.precision", "bf16-mixed", "--data.batch_size", "8"]
    start = time.time()
    result: Dict[str, Any] = {"command": "python -m experiments.run " + " ".join(argv)}
    try:
        run_dir = run_cli.main(argv)
    except Exception as err:  # reported, not raised: the benchmark numbers above are still worth writing
        result["error"] = f"{type(err).__name__}: {str(err)[:1000]}"
        return result
    summary = json.loads((pathlib.Path(run_dir) / "summary.json").read_text())
    result.update({k: summary.get(k) for k in ("steps", "final_train_loss", "final_val_loss", "median_step_time_s")})
    result["seconds"] = round(time.time() - start, 1)
    return result


def check_goals(phases: Dict[str, Dict[str, Dict[str, Any]]]) -> Dict[str, Any]:
    verdicts = {}
    for goal, (phase, variant, key, bound, kind) in GOALS.items():
        value = phases.get(phase, {}).get(variant, {}).get(key)
        met = None if value is None else (value >= bound if kind == "min" else value <= bound)
        verdicts[goal] = {"value": value, "met": met}
    return verdicts


def markdown(report: Dict[str, Any]) -> str:
    lines = [f"# Device check: {report['device']}", "", f"command: `{report['command']}`", "",
             "| phase | variant | step ms | tok/s | MFU | time x | FLOPs x | t/F | graphs | breaks | recompiles |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    fmt = lambda v, f: "-" if v is None else format(v, f)
    for phase, results in report["phases"].items():
        for name, r in results.items():
            lines.append(f"| {phase} | {name} | {fmt(1000 * r['median_step_s'], '.1f')} | {fmt(r['tokens_per_s'], '.0f')} | "
                         f"{fmt(r.get('mfu'), '.1%')} | {fmt(r['step_time_ratio'], '.3f')} | {fmt(r['flops_ratio'], '.3f')} | "
                         f"{fmt(r['time_over_flops_ratio'], '.3f')} | {r.get('graphs', '-')} | "
                         f"{r.get('graph_breaks', '-')} | {r.get('recompiles', '-')} |")
    checkpointed = report["phases"].get("checkpointed", {})
    if checkpointed:
        lines += ["", "Memory plan vs measured (activation checkpointing `blocks`; measured: CUDA peak allocated "
                  "of one step, on the CPU path the bench's CPU figure):", "",
                  "| variant | measured MB | planned MB | planned / measured | planned without checkpointing MB |",
                  "|---|---|---|---|---|"]
        for name, r in checkpointed.items():
            lines.append(f"| {name} | {fmt(r.get('memory_mb'), '.0f')} | {fmt(r.get('planned_peak_mb'), '.0f')} | "
                         f"{fmt(r.get('planned_over_measured'), '.3f')} | "
                         f"{fmt(r.get('planned_peak_no_checkpointing_mb'), '.0f')} |")
    lines += ["", "| goal | value | met |", "|---|---|---|"]
    for goal, v in report["goals"].items():
        lines.append(f"| {goal} | {fmt(v['value'], '.3f')} | {v['met']} |")
    run = report.get("run", {})
    lines += ["", f"50-step run: {json.dumps(run)}", "", f"skipped: {report['skipped'] or 'nothing'}",
              f"total seconds: {report['seconds']}"]
    return "\n".join(lines) + "\n"


def main(argv: Optional[List[str]] = None) -> Dict[str, Any]:
    import torch

    args = parse_args(argv)
    if not args.quick and not torch.cuda.is_available():
        print("error: no CUDA device here; the device check needs a GPU (use --quick for the CPU smoke path)",
              file=sys.stderr)
        sys.exit(2)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.time()
    phases: Dict[str, Dict[str, Dict[str, Any]]] = {}
    skipped: List[str] = []
    run: Dict[str, Any] = {}
    for name, variants, compiled in (QUICK_PHASES if args.quick else PHASES):
        label = "50-step run" if name == "run" else f"{name} {','.join(variants)}"
        if time.time() - start > args.budget_s:
            skipped.append(label)
            continue
        print(f"== {label} (at {time.time() - start:.0f} s)", flush=True)
        if name == "run":
            run = training_run(args, out)
        else:
            try:
                results = run_phase(args, variants, compiled, name)
                phase = phases.setdefault(name, {})
                phase.update({k: v for k, v in results.items() if k in variants or k not in phase})
            except Exception as err:  # a failing phase must not hide the others' numbers
                skipped.append(f"{label}: {type(err).__name__}: {str(err)[:300]}")
        write_report(argv, args, out, phases, run, skipped, start)
    report = write_report(argv, args, out, phases, run, skipped, start)
    print(markdown(report))
    return report


def write_report(argv, args, out: pathlib.Path, phases, run, skipped, start: float) -> Dict[str, Any]:
    """JSON + markdown; written after every phase, so a killed check still leaves what it measured."""
    import torch

    report = {
        "command": "python -m experiments.device_check " + " ".join(argv if argv is not None else sys.argv[1:]),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not args.quick else "cpu",
        "torch": torch.__version__, "phases": phases, "goals": check_goals(phases), "run": run,
        "skipped": skipped, "seconds": round(time.time() - start, 1),
    }
    (out / "device_check.json").write_text(json.dumps(report, indent=2, default=str) + "\n")
    (out / "device_check.md").write_text(markdown(report))
    return report


if __name__ == "__main__":
    main()
