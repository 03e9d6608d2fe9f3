"""Turn a grid of options into one training job per configuration.

    python -m experiments.sweep GRID.yaml [--launcher local|slurm] [--dry_run] [-- COMMON RUN OPTIONS]
    python -m experiments.sweep --grid variant=vanilla,mod --grid model.mod.capacity=0.125,0.25 --dry_run -- --size tiny

A grid maps ``experiments.run`` options (without the leading ``--``; aliases such as ``variant``,
``size``, ``max_steps`` work) to lists of values; the configurations are the Cartesian product.
A YAML file may also give ``options`` (common run options, a list or one string), ``grid`` as a
list of such mappings (the union of their products, for grids that are not rectangular), and
``sbatch`` (extra sbatch options for every job):

    options: [--size, small, --max_steps, 5000, --data, openwebtext]
    sbatch: [--time=12:00:00, --partition=gpu]
    grid:
      variant: [vanilla, mod]
      model.mod.capacity: [0.125, 0.25]

A value that is itself a list is passed as one option value (``model.mod.routed_blocks: [[1, 3]]``).

Launchers: ``local`` runs the jobs one after another here; ``slurm`` submits each with
``sbatch ... experiments/slurm/train.sbatch <run options>``, with ``--nodes`` / ``--ntasks-per-node``
(and ``--gpus-per-node`` unless ``--trainer.accelerator cpu``) taken from the configuration's
``--trainer.num_nodes`` / ``--trainer.devices`` so that the allocation matches the Trainer.
``--dry_run`` prints one command per configuration and launches nothing, then (on stderr) a cost estimate per
configuration: parameters, tokens (max_steps x batch x accumulation x devices x nodes x T), training
FLOPs (tokens x the model's analytic ``flops_per_token().training``, the model built on the meta
device, routing at its configured capacity) and GPU-hours at ``--mfu`` of ``--peak_tflops`` (default
40% of 989.5 TFLOP/s, an H100/H200 SXM in dense bf16): a planning estimate, not a measurement; and the
memory plan per job (``model_tools.memory``: peak per GPU from measured activations, whether it fits
``--gpu_memory_gb``, else the largest micro-batch that does at the same global batch; docs/scale.md).
Paper-scale recipes live in ``experiments/configs/paper/`` (see docs/scale.md).

Every configuration is parsed and validated exactly as ``experiments.run`` does (unknown variants,
sizes, datasets, options or values) before the first job starts; an empty grid is an error. Model options
of a group the configuration's variant does not use (``model.mod.capacity`` for ``vanilla``), which
``experiments.run`` refuses, are instead dropped from that configuration and the duplicates this makes
removed, both noted on stderr, so a grid may cross variants with one variant's options.
"""
from __future__ import annotations

import argparse
import itertools
import json
import pathlib
import shlex
import subprocess
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

import yaml

from architectures.config import ConfigError

REPO = pathlib.Path(__file__).resolve().parents[1]
SBATCH_TEMPLATE = REPO / "experiments" / "slurm" / "train.sbatch"
LAUNCHERS = ("local", "slurm")


def option_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, dict)):
        return json.dumps(value)
    if value is None:
        return "null"
    return str(value)


def as_options(options: Any, where: str) -> List[str]:
    if options is None:
        return []
    if isinstance(options, str):
        return shlex.split(options)
    if isinstance(options, list):
        return [option_value(o) for o in options]
    raise ConfigError(f"{where}: expected a list of options or one string, got {type(options).__name__}")


def expand(grid: Any) -> List[List[str]]:
    """Configurations (run options) of a mapping ``option -> values`` or a list of such mappings."""
    blocks = grid if isinstance(grid, list) else [grid]
    configurations: List[List[str]] = []
    for block in blocks:
        if not isinstance(block, dict) or not block:
            raise ConfigError(f"grid: each grid must be a non-empty mapping of option -> values, got {block!r}")
        keys, choices = [], []
        for key, values in block.items():
            values = values if isinstance(values, list) else [values]
            if not values:
                raise ConfigError(f"grid: option {key!r} has no values")
            keys.append("--" + str(key).lstrip("-"))
            choices.append(values)
        for combination in itertools.product(*choices):
            configurations.append([item for key, value in zip(keys, combination) for item in (key, option_value(value))])
    if not configurations:
        raise ConfigError("grid: the grid is empty, nothing to run")
    return configurations


def parse_grid_args(items: Sequence[str]) -> Dict[str, List[Any]]:
    """``--grid key=v1,v2`` items -> mapping (values read as YAML scalars)."""
    grid: Dict[str, List[Any]] = {}
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--grid: expected KEY=V1,V2,..., got {item!r}")
        grid[key] = [yaml.safe_load(v) for v in values.split(",") if v.strip()]
    return grid


def read_grid_file(file: pathlib.Path) -> Any:
    """The YAML document of a grid file; a file that is not UTF-8 or not YAML is one line naming where."""
    from datamodules.corpora import read_utf8

    text = read_utf8(file)  # DataError "<file>:<line>: not UTF-8 text (byte ... at byte offset ...)"
    try:
        return yaml.safe_load(text) or {}
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{file}:{mark.line + 1}" if mark is not None else str(file)
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(f"{where}: not a valid YAML grid file ({problem}); see python -m experiments.sweep --help "
                          "for the format") from None


def load_grid(path: Optional[str], items: Sequence[str]) -> Tuple[List[List[str]], List[str], List[str]]:
    """(configurations, common options, sbatch options) from a YAML file and/or ``--grid`` items."""
    common: List[str] = []
    sbatch: List[str] = []
    grids: List[Dict[str, Any]] = []
    if path:
        file = pathlib.Path(path)
        if not file.is_file():
            raise FileNotFoundError(f"grid file {file} not found")
        spec = read_grid_file(file)
        if not isinstance(spec, dict):
            raise ConfigError(f"{file}: expected a mapping with 'grid' (and optionally 'options', 'sbatch')")
        unknown = set(spec) - {"grid", "options", "sbatch"}
        if unknown:
            raise ConfigError(f"{file}: unknown keys {sorted(unknown)}; use grid, options, sbatch")
        common = as_options(spec.get("options"), f"{file}: options")
        sbatch = as_options(spec.get("sbatch"), f"{file}: sbatch")
        grid = spec.get("grid")
        if grid is None or grid == {} or grid == []:
            raise ConfigError(f"{file}: the grid is empty, nothing to run")
        grids.extend(grid if isinstance(grid, list) else [grid])
    if items:
        grids.append(parse_grid_args(items))
    if not grids:
        raise ConfigError("grid: the grid is empty (give a GRID.yaml or --grid KEY=VALUES)")
    return expand(grids), common, sbatch


def drop_ignored_options(configurations: Sequence[Sequence[str]]) -> List[List[str]]:
    """Remove from each configuration the model options its variant does not use (a grid over
    ``model.mod.capacity`` and ``variant=vanilla,mod`` gives vanilla no capacity), then the duplicates
    this makes; both are said on stderr. ``experiments.run`` itself refuses such options."""
    from experiments.run import build_parser, without_ignored_options

    parser = build_parser()
    out: List[List[str]] = []
    dropped: Dict[str, set] = {}
    for argv in configurations:
        kept, variant, names = without_ignored_options(argv, parser)
        if names:
            dropped.setdefault(variant, set()).update(names)
        out.append(kept)
    unique = [argv for i, argv in enumerate(out) if argv not in out[:i]]
    for variant, options in sorted(dropped.items()):
        print(f"note: sweep: {variant} does not use {', '.join(sorted(options))}; dropped from its configurations",
              file=sys.stderr)
    if len(unique) < len(out):
        print(f"note: sweep: {len(out) - len(unique)} duplicate configuration(s) removed; {len(unique)} remain",
              file=sys.stderr)
    return unique


def validate(configurations: Sequence[Sequence[str]]) -> List[Any]:
    """Parse and check every configuration as ``experiments.run`` would; all before any job starts."""
    from experiments.run import build_parser, expand_aliases, parse_with_presets, validate_up_front

    parser = build_parser()
    parsed = []
    for argv in configurations:
        try:  # the variant's and the dataset's presets as defaults, restored for the next configuration
            cfg = parse_with_presets(parser, expand_aliases(list(argv)))
        except (SystemExit, argparse.ArgumentError) as exit_:  # run's parser raises, not exits (issue 14)
            raise ConfigError(f"invalid run options: {shlex.join(argv)}") from exit_
        validate_up_front(cfg)
        parsed.append(cfg)
    return parsed


def commands(configurations: Sequence[Sequence[str]], parsed: Sequence[Any], launcher: str,
             sbatch_options: Sequence[str] = (), template: pathlib.Path = SBATCH_TEMPLATE) -> List[List[str]]:
    out = []
    for i, (argv, cfg) in enumerate(zip(configurations, parsed)):
        if launcher == "local":
            out.append([sys.executable, "-m", "experiments.run", *argv])
            continue
        from model_tools.memory import geometry

        nodes, tasks, gpus = geometry(cfg)
        allocation = [f"--job-name=dyncomp-{cfg.model.variant}-{i}", f"--nodes={nodes}", f"--ntasks-per-node={tasks}"]
        if gpus:
            allocation.append(f"--gpus-per-node={tasks}")
        out.append(["sbatch", *allocation, *sbatch_options, str(template), *argv])
    return out


def estimate(cfg) -> Dict[str, Any]:
    """Parameters, tokens and training FLOPs of one parsed run configuration (analytic, meta device)."""
    import torch

    from architectures import build_model
    from experiments.run import model_config

    mcfg = model_config(cfg).resolve()
    with torch.device("meta"):
        model = build_model(mcfg)
    from model_tools.memory import geometry

    nodes, tasks, _ = geometry(cfg)
    accumulate = int(cfg.trainer.accumulate_grad_batches or 1)
    tokens = int(cfg.trainer.max_steps) * int(cfg.data.batch_size) * accumulate * nodes * tasks * mcfg.block_size
    flops_per_token = model.flops_per_token(None, mcfg.block_size).training
    return {"variant": mcfg.variant, "parameters": model.num_parameters(), "tokens": tokens,
            "gpus": nodes * tasks, "flops_per_token": flops_per_token, "flops": tokens * flops_per_token}


def memory_plans(parsed: Sequence[Any], gpu_memory_gb: float = 80.0, workers: Optional[int] = None) -> List[Dict[str, Any]]:
    """The memory plan (``model_tools.memory``) of every parsed configuration: peak per GPU and what fits.
    One measurement per distinct model / precision / checkpointing (``memory.measurement_key``), reused by
    every job that shares it; ``workers`` measurements at once (default ``measurement_workers``)."""
    import concurrent.futures

    from model_tools.memory import job_plan, measure, measurement_key
    from experiments.memory import measurement_inputs

    inputs = [measurement_inputs(cfg) for cfg in parsed]
    keys = [measurement_key(item) for item in inputs]
    distinct = list(dict.fromkeys(keys))
    first = [inputs[keys.index(key)] for key in distinct]
    workers = workers or measurement_workers([item[0] for item in first])
    # one fresh process per measurement: a process that built a model does not get its memory back (measured:
    # ~1 GiB per GPT-2 small model stays with it; one worker for all of ffn_wider_contribution.yaml's models
    # peaked at 13.8 GB even with MALLOC_MMAP_THRESHOLD_=1 MiB), and a recipe builds several large ones
    with concurrent.futures.ProcessPoolExecutor(max_workers=workers, mp_context=measurement_context(),
                                                max_tasks_per_child=1) as pool:
        # the worker gets the resolved model config, not the parsed run config: it imports torch and
        # architectures only, not Lightning and the run's CLI (about half of a job's CPU time before)
        measured = dict(zip(distinct, pool.map(measure, *zip(*first))))
    return [job_plan(measured[key], cfg, gpu_memory_gb).row() for key, cfg in zip(keys, parsed)]


#: host memory one measuring process needs per parameter of its model: the fp32 weights (4 bytes, filled from a
#: tiled pattern) and their bf16 autocast copies (2), with a margin for the few saved activations of micro-batch 1
MEASUREMENT_BYTES_PER_PARAMETER = 8
MEASUREMENT_BASE_BYTES = 1 << 30  # torch and the suite imported, allocator slack


def measurement_workers(configs: Sequence[Any]) -> int:
    """How many models to measure at once: one per CPU this process may use (a SLURM or container CPU set), no
    more than there are models, and only as many of the largest as fit in the host's available memory (each
    worker builds its model with real weights). The figures do not depend on it: each worker measures alone in
    its own process."""
    import torch

    from architectures import build_model
    from datamodules.cache_build import available_cpus

    if len(configs) <= 1:
        return 1
    largest = 0
    for config in configs:
        with torch.device("meta"):
            largest = max(largest, build_model(config).num_parameters())
    per_worker = MEASUREMENT_BYTES_PER_PARAMETER * largest + MEASUREMENT_BASE_BYTES
    return max(1, min(available_cpus(), len(configs), available_memory_bytes() // per_worker))


def available_memory_bytes() -> int:
    """The host's available memory (``MemAvailable``: free plus what the kernel can reclaim); the total where
    /proc/meminfo is missing (not Linux)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def measurement_context():
    """Where the measuring processes come from: forked from a server that imported torch, ``model_tools.memory``
    and ``torch._dynamo`` once (each spawned process spent ~3 s importing torch and ~2.6 s importing
    ``torch._dynamo``, which building a model on the meta device pulls in: more than most measurements take),
    still a fresh process per model; ``spawn`` where there is no forkserver (Windows)."""
    import multiprocessing

    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    # the server only imports (no tensor work, no thread pools started): safe to fork from
    context.set_forkserver_preload(["model_tools.memory", "torch._dynamo"])
    return context


def gpu_hours(flops: float, peak_tflops: float, mfu: float) -> float:
    return flops / (peak_tflops * 1e12 * mfu) / 3600.0


def print_estimates(rows: Sequence[Dict[str, Any]], peak_tflops: float, mfu: float) -> None:
    """To stderr: stdout stays one command per line (pipeable to a shell)."""
    say = lambda line: print(line, file=sys.stderr)
    say(f"# estimate (analytic FLOPs; GPU-hours at {mfu:.0%} MFU of {peak_tflops} TFLOP/s, not measured)")
    say(f"# {'#':>3} {'variant':<16}{'params':>9}{'tokens':>11}{'FLOPs':>11}{'GPU-h':>9}{'GPUs':>6}")
    for i, row in enumerate(rows):
        say(f"# {i:>3} {row['variant']:<16}{row['parameters'] / 1e6:>8.1f}M{row['tokens'] / 1e9:>10.2f}B"
              f"{row['flops']:>11.3e}{row['gpu_hours']:>9.1f}{row['gpus']:>6}")
    total = sum(r["gpu_hours"] for r in rows)
    say(f"# total: {sum(r['flops'] for r in rows):.3e} FLOPs, {total:.1f} GPU-hours")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiments.sweep", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("grid_file", nargs="?", default=None, help="YAML grid (see below)")
    parser.add_argument("--grid", action="append", default=[], metavar="KEY=V1,V2", help="a grid axis, repeatable")
    parser.add_argument("--launcher", choices=LAUNCHERS, default="slurm")
    parser.add_argument("--dry_run", action="store_true", help="print one command per configuration, launch nothing")
    parser.add_argument("--sbatch", default=str(SBATCH_TEMPLATE), help="SLURM batch template")
    parser.add_argument("--sbatch_args", default="", help="extra sbatch options for every job, one string")
    parser.add_argument("--peak_tflops", type=float, default=989.5, help="--dry_run estimate: GPU peak (bf16 dense)")
    parser.add_argument("--mfu", type=float, default=0.4, help="--dry_run estimate: assumed model FLOPs utilisation")
    parser.add_argument("--no_plan", action="store_true",
                        help="--dry_run without the memory plan (which builds each distinct model on the CPU: ~5-10 s each "
                        "on a loaded 2-core machine, docs/benchmarks.md)")
    parser.add_argument("--gpu_memory_gb", type=float, default=80.0,
                        help="--dry_run memory plan: GPU memory per device in GiB (docs/scale.md)")
    parser.add_argument("--plan_workers", type=int, default=None,
                        help="--dry_run memory plan: models measured at once, each in its own process (default: one "
                             "per available CPU, as many as the host's available memory holds)")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> List[List[str]]:
    argv = list(sys.argv[1:] if argv is None else argv)
    common: List[str] = []
    if "--" in argv:
        split = argv.index("--")
        argv, common = argv[:split], argv[split + 1:]
    args = build_parser().parse_args(argv)
    from model_tools.memory import check_plan_settings

    check_plan_settings(args.gpu_memory_gb)
    if args.plan_workers is not None and args.plan_workers < 1:
        raise ConfigError(f"--plan_workers: must be a positive integer, got {args.plan_workers}")
    grid, file_common, sbatch = load_grid(args.grid_file, args.grid)
    configurations = drop_ignored_options([[*file_common, *common, *config] for config in grid])
    parsed = validate(configurations)
    jobs = commands(configurations, parsed, args.launcher, [*sbatch, *shlex.split(args.sbatch_args)],
                    pathlib.Path(args.sbatch))
    if args.dry_run:
        dry_run(jobs, parsed, args)
    else:
        launch(jobs)
    return jobs


def dry_run(jobs: Sequence[List[str]], parsed: Sequence[Any], args: argparse.Namespace) -> None:
    """One command per line on stdout; the estimates and (unless ``--no_plan``) the memory plans on stderr."""
    for job in jobs:
        print(shlex.join(job))
    rows = [estimate(cfg) for cfg in parsed]
    for row in rows:
        row["gpu_hours"] = gpu_hours(row["flops"], args.peak_tflops, args.mfu)
    print_estimates(rows, args.peak_tflops, args.mfu)
    if not args.no_plan:
        from model_tools.memory import print_plans

        plans = memory_plans(parsed, args.gpu_memory_gb, args.plan_workers)
        print_plans(plans, [f"{cfg.model.variant}" for cfg in parsed], lambda line: print(line, file=sys.stderr))


def launch(jobs: Sequence[List[str]]) -> None:
    """Run the jobs one after another; exit status 1 naming the failed ones."""
    failed = []
    for job in jobs:
        print(shlex.join(job), file=sys.stderr, flush=True)
        if subprocess.run(job, cwd=REPO).returncode != 0:
            failed.append(shlex.join(job))
    if failed:
        print(f"{len(failed)} of {len(jobs)} jobs failed:\n" + "\n".join(failed), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    from experiments.run import cli

    cli(main)
