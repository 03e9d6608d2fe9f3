"""Side-by-side training-step benchmark: ``python -m experiments.bench --variants vanilla,mod --size tiny``.

Times full training steps (forward, backward, AdamW step) of each variant in ONE process,
interleaving the repetitions (A B C A B C ...) so that machine noise hits every variant alike,
and reports per variant: median step time, tokens/s, memory, analytic FLOPs per token, and the
ratios to vanilla. The Hugging Face ``GPT2LMHeadModel`` (attn_implementation="sdpa") built with the
identical config is timed as the external reference ``hf_gpt2``, and a minimal one-file plain-PyTorch
GPT-2 (``model_tools/minimal_gpt2.py``) as ``min_gpt2``: the speed floor for our vanilla.

GPU / scale options: ``--device cuda``, ``--precision bf16-mixed`` (autocast, as Lightning's), and
``--compile`` (``torch.compile`` of every model; the report then adds per variant the graph breaks
of one forward+loss, from ``torch._dynamo.explain``, and the recompilations over
``--recompile_steps`` extra steps on fresh batches, i.e. with varying routing). On CUDA with bf16 the
report adds MFU: training FLOPs/s (analytic, 3x forward) over the GPU's dense bf16 peak
(``callbacks.flops.PEAK_BF16_TFLOPS``, keyed by device name, shared with training's MFU; ``--peak_tflops`` overrides).

Memory: on CUDA the peak allocated bytes of the step, less what the other contenders keep on the GPU; on CPU the bytes of parameters, gradients,
AdamW state and the activations saved for backward (measured with saved-tensor hooks; not with
``--compile``, where the hooks would change the graph: then weights, gradients and AdamW state only).
``--activation_checkpointing`` applies to the variants; the report gives each variant's saved
activations without and with checkpointing (the given policy, else ``blocks``). ``--plan`` prints the
memory plan (``model_tools.memory``) per variant instead of timing.
Optionally (``--generate N``) it also times ``generate()`` with a KV cache, in new tokens/s.
"""
from __future__ import annotations

import argparse
import json
from typing import Dict, List, Optional

import torch

from architectures import variant_names
from architectures.checkpointing import parse_policy
from architectures.config import SIZES, ConfigError
from model_tools.benchmark import (HF_REFERENCE, MINIMAL_REFERENCE, MIXTRAL_REFERENCE, MIXTRAL_ONE_EXPERT, REFERENCES,
                                   base_config, check_overrides, run, uses_moe_layer, variant_of)
from model_tools.memory import check_plan_settings

PRECISIONS = ("32-true", "bf16-mixed")

def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m experiments.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="vanilla",
                        help=f"comma-separated; valid: {', '.join(variant_names())}, {', '.join(REFERENCES)}; a "
                             "variant may carry its own overrides after --set: moe@moe.num_experts=64@moe.top_k=2")
    parser.add_argument("--size", default="tiny", choices=list(SIZES))
    parser.add_argument("--steps", type=int, default=10, help="timed repetitions per variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=None, help="sequence length (default: the size's T)")
    parser.add_argument("--vocab_size", type=int, default=50257)
    parser.add_argument("--set", action="append", default=[], metavar="GROUP.FIELD=VALUE",
                        help="model config override, e.g. --set mod.capacity=0.25 --set d_model=512")
    parser.add_argument("--no_hf", action="store_true", help=f"do not add the {HF_REFERENCE} reference")
    parser.add_argument("--no_minimal", action="store_true", help=f"do not add the {MINIMAL_REFERENCE} reference")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="auto: cuda when available")
    parser.add_argument("--precision", default="32-true", choices=PRECISIONS)
    parser.add_argument("--compile", action="store_true", help="torch.compile every model; report graph breaks")
    parser.add_argument("--recompile_steps", type=int, default=20,
                        help="with --compile: extra steps on fresh batches, counting recompilations")
    parser.add_argument("--peak_tflops", type=float, default=None, help="peak for MFU (default: by GPU name)")
    parser.add_argument("--clock", default="wall", choices=["wall", "process"],
                        help="process: CPU seconds of this process (all threads) per step instead of wall time; "
                             "on a CPU shared with other jobs it does not count the time they take")
    parser.add_argument("--generate", type=int, default=0, help="also time generate() of N new tokens")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--activation_checkpointing", default="none",
                        help="none | blocks | every_k:N for the variants (not the references); docs/scale.md")
    parser.add_argument("--plan", action="store_true",
                        help="print the memory plan per variant at these settings (--gpu_memory_gb) and exit")
    parser.add_argument("--gpu_memory_gb", type=float, default=80.0, help="GPU memory the plan checks against")
    parser.add_argument("--dispatch", action="store_true",
                        help="also time each MoE layer's expert dispatch (forward + backward) on its routed tokens, "
                             "and on the first MoE variant's routing (the other experts idle)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the results here")
    return parser


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    """The parsed options, checked before any model is built, with the variant list completed (vanilla
    first for the ratios, the references after it unless left out)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in args.variant_list if variant_of(v) not in variant_names() and v not in REFERENCES]
    if unknown or not args.variant_list:
        parser.error(f"--variants: unknown {unknown or 'empty list'}; valid: {', '.join(variant_names())}, "
                     f"{', '.join(REFERENCES)}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    elif args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is available here; use --device cpu")
    if args.steps <= 0 or args.batch_size <= 0:
        parser.error("--steps and --batch_size must be positive")
    check_plan_settings(args.gpu_memory_gb, args.batch_size, args.seq_len)  # the timed runs use seq_len too
    try:
        parse_policy(args.activation_checkpointing, "--activation_checkpointing")
    except ConfigError as err:
        parser.error(str(err))
    if "vanilla" not in args.variant_list:
        args.variant_list.insert(0, "vanilla")  # every ratio is relative to vanilla
    check_overrides(args.set, [v for v in args.variant_list if v not in REFERENCES], args.size)
    if args.dispatch and not any(uses_moe_layer(v) for v in args.variant_list):
        parser.error("--dispatch: none of --variants has MoE experts (moe, moe_dense_ffn, mode_*, cea_moe)")
    if not args.no_hf and HF_REFERENCE not in args.variant_list:
        args.variant_list.append(HF_REFERENCE)
    if not args.no_minimal and MINIMAL_REFERENCE not in args.variant_list:
        args.variant_list.append(MINIMAL_REFERENCE)
    return args


def print_dispatch(results: Dict[str, Dict[str, float]]) -> None:
    rows = {n: r for n, r in results.items() if "dispatch_forward_ms" in r}
    if not rows:
        return
    print("expert dispatch, ms per MoE layer, forward / backward (median over the timed repetitions):")
    for name, r in rows.items():
        line = (f"  {name:<28} {r['dispatch_layers']} layers x {r['dispatch_experts']} experts: own routing "
                f"{r['dispatch_forward_ms']:.2f} / {r['dispatch_backward_ms']:.2f} "
                f"({r['dispatch_active_experts']:.1f} experts with tokens)")
        if "dispatch_forward_ms_first_routing" in r:
            line += (f"; routing of {r['dispatch_routing_of']} {r['dispatch_forward_ms_first_routing']:.2f} / "
                     f"{r['dispatch_backward_ms_first_routing']:.2f}")
        print(line)


def print_table(results: Dict[str, Dict[str, float]], args, seq_len: int) -> None:
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu threads={torch.get_num_threads()}"
    print(f"size={args.size} batch={args.batch_size} seq={seq_len} steps={args.steps} precision={args.precision} "
          f"compile={args.compile} clock={args.clock} device={device}")
    header = f"{'variant':<16}{'step ms':>10}{'tok/s':>10}{'mem MB':>9}{'GFLOP/tok':>11}{'time x':>8}{'FLOPs x':>9}{'t/F':>7}"
    print(header)
    for name, r in results.items():
        print(f"{name:<16}{1000 * r['median_step_s']:>10.1f}{r['tokens_per_s']:>10.0f}{r['memory_mb']:>9.1f}"
              f"{r['flops_per_token'] / 1e9:>11.4f}{r['step_time_ratio']:>8.3f}{r['flops_ratio']:>9.3f}"
              f"{r['time_over_flops_ratio']:>7.3f}")
    print("forward + backward / AdamW step, median ms: " + ", ".join(
        f"{n} {1000 * r['forward_backward_s']:.1f} / {1000 * r['optimizer_s']:.1f}" for n, r in results.items()))
    if any(r["mfu"] is not None for r in results.values()):
        print("MFU: " + ", ".join(f"{n} {r['mfu']:.1%}" for n, r in results.items() if r["mfu"] is not None))
    print(f"saved activations MB per step, without / with checkpointing "
          f"({next((r['checkpointing'] for r in results.values() if 'checkpointing' in r), '-')}): "
          + ", ".join(f"{n} {r['saved_activation_mb']:.1f} / {r['saved_activation_mb_checkpointed']:.1f}"
                      for n, r in results.items() if "saved_activation_mb" in r))
    if args.compile:
        for name, r in results.items():
            print(f"{name:<16}graphs {r['graphs']}  graph breaks {r['graph_breaks']}  recompiles over "
                  f"{args.recompile_steps} steps {r['recompiles']}")
            for reason in r["break_reasons"][:4]:
                print(f"{'':<18}{reason}")
    for key, ref in (("speed_vs_hf", HF_REFERENCE), ("speed_vs_minimal", MINIMAL_REFERENCE)):
        if key in results["vanilla"]:
            print(f"vanilla speed vs {ref}: {results['vanilla'][key]:.3f}x (>= 1 means ours is faster)")
    if "time_x_one_expert" in results.get(MIXTRAL_REFERENCE, {}):
        print(f"{MIXTRAL_REFERENCE} time x {MIXTRAL_ONE_EXPERT}: {results[MIXTRAL_REFERENCE]['time_x_one_expert']:.3f} "
              "(compare: an MoE variant's time x vanilla)")


def plan(args) -> Dict[str, Dict[str, object]]:
    """``--plan``: the memory plan of every variant at the bench's batch, length, precision and checkpointing."""
    from model_tools.memory import build_for_measurement, plan_model, print_plans

    seq_len = args.seq_len or SIZES[args.size]["block_size"]
    rows = {}
    for name in args.variant_list:
        if name in REFERENCES:
            continue
        # cheap weights (meta build, tiled pattern, stacked experts sharing one expert's storage): only the
        # activations' sizes are measured, so a 3.7B-parameter 64-expert model plans on a laptop
        model = build_for_measurement(base_config(args, name), args.seed)
        rows[name] = plan_model(model, args.batch_size, seq_len, precision=args.precision,
                                checkpointing=args.activation_checkpointing, gpu_memory_gb=args.gpu_memory_gb).row()
    print_plans(list(rows.values()), list(rows), print)
    return rows


def main(argv: Optional[List[str]] = None) -> Dict[str, Dict[str, float]]:
    args = parse_args(argv)
    if args.plan:
        return plan(args)
    results = run(args)
    seq_len = args.seq_len or SIZES[args.size]["block_size"]
    print_table(results, args, seq_len)
    print_dispatch(results)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": {k: v for k, v in vars(args).items() if k != "variant_list"},
                       "variants": args.variant_list, "results": results}, handle, indent=2)
    return results


if __name__ == "__main__":
    from experiments.run import cli

    cli(main)  # a user mistake: one "error:" line, exit status 2
