"""The invariants every registered variant must satisfy, driven by the registry (issue 12 §2).

Each case is a registry entry at its tiny ``test_settings`` (d_model 32, 4 layers, T 32), plus routing
settings that change what the router does (top-1 / top-2, capacity-limited / dropless, MoD sampling
modes, hard depth gating). A new variant is covered as soon as it has a registry entry. The checks
themselves are functions in ``tests/invariants.py`` (``tests/test_invariant_mutations.py`` plants each
bug class in a toy variant and asserts they catch it); docs/testing.md lists them and the tiers.
"""
from __future__ import annotations

import contextlib
import math
import pathlib

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from architectures import KVCache, build_model, variant_names
from architectures import flops as cost
from architectures.config import ConfigError
from architectures.registry import VARIANTS
from tests import invariants

V, T = 97, 32

# (variant, extra settings): every registry entry, then the routing settings worth their own case
ROUTING_SETTINGS = [
    ("moe", {"moe": {"top_k": 2}}),
    ("moe", {"moe": {"top_k": 2, "dropless": False, "capacity_factor": 1.0}}),
    ("moe", {"moe": {"top_k": 1, "dropless": False, "capacity_factor": 1.0}}),
    ("mot", {"mot": {"top_k": 1}}),
    ("mod", {"mod": {"sampling": "aux_loss"}}),
    ("mode_staged", {"moe": {"top_k": 2}}),
    ("mode_integrated", {"moe": {"top_k": 2}}),
    ("cea_moe", {"combo": {"inner_top_k": 2}}),
    ("depth_gate", {"depth_gate": {"mode": "hard", "top_k": 1}}),
    ("depth_gate", {"depth_gate": {"mode": "hard", "top_k": 2}}),
    ("mom", {"mom": {"top_k": 2}}),
    ("mor", {"mor": {"sharing": "cycle"}}),  # a shared stack of 2 blocks, nothing distinct
    ("mor", {"mor": {"sampling": "aux_loss"}}),
    ("mor_token", {"mor": {"sharing": "cycle"}}),
    # recur_halt's default puts every token at one depth at init: these weights and threshold mix depths 2, 3 and 4
    ("recur_halt", {"init_std": 0.2, "recur_halt": {"halt_bias_init": -1.0, "threshold": 0.2}}),
    ("recur_halt_ponder", {"init_std": 0.2, "recur_halt": {"halt_bias_init": -1.0, "threshold": 0.2}}),
]
CASES = [(name, {}) for name in variant_names()] + ROUTING_SETTINGS
IDS = [name + "".join(f"-{g}.{k}={v}" if isinstance(d, dict) else f"-{g}={d}"  # a group's fields, or a model field
                     for g, d in extra.items() for k, v in (d.items() if isinstance(d, dict) else [(None, d)]))
       for name, extra in CASES]


def capacity_limited(extra) -> bool:
    return extra.get("moe", {}).get("dropless") is False


def build(name, extra, seed=0, **more):
    torch.manual_seed(seed)
    merged = {**extra, **more}
    return build_model(VARIANTS[name].test_config(name, **merged))


def tokens(B=2, length=T, seed=1):
    return torch.randint(0, V, (B, length), generator=torch.Generator().manual_seed(seed))


def causal_mode(model, force: bool):
    return model.causal_routing() if force else contextlib.nullcontext()


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    yield


# ---------------------------------------------------------------------------- a. causality
@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_positions_up_to_t_ignore_later_tokens(name, extra, training):
    """In eval AND training mode (same RNG for both forwards): a look-ahead only in training leaks into
    the loss. Default routing must be causal unless the model declares ``routing_sees_future``; then
    ``causal_routing()`` must be (for the others it changes nothing)."""
    model = build(name, extra)
    invariants.check_causal(model, tokens(), T // 2, training)
    if model.routing_sees_future:
        invariants.check_causal(model, tokens(), T // 2, training, causal_routing=True)


# ---------------------------------------------------------------------------- b. every router learns
ROUTER_WORDS = ("router", "gate", "predictor")


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_every_router_parameter_gets_a_gradient_from_the_lm_loss_alone(name, extra):
    model = build(name, extra)
    idx = tokens(B=4)
    out = model(idx)
    F.cross_entropy(out.logits[:, :-1].reshape(-1, V), idx[:, 1:].reshape(-1)).backward()  # aux losses left out
    routers = {n: p for n, p in model.named_parameters()
               if any(w in n for w in ROUTER_WORDS) and ".predictor." not in n and not n.startswith("predictor")}
    # MoD's causal predictor reads a stop-gradient input by design (it must not shape the LM): its own BCE trains it.
    # A GRU router run for one step (H = 1, mom_e) multiplies weight_hh by its zero initial state: inert by design.
    if getattr(getattr(model, "layout", None), "steps", None) == 1:
        routers = {n: p for n, p in routers.items() if not n.endswith("cell.weight_hh")}
    assert routers or not out.trace or all(s.kind == "token_choice" and s.probs is None for s in out.trace)
    for n, p in routers.items():
        assert p.grad is not None and p.grad.abs().max() > 0, f"{n} gets no gradient from the LM loss"


# ---------------------------------------------------------------------------- b2. idle units: zero gradients
# cases where a two-token batch leaves nothing idle: soft depth gating runs every layer, param_share's routing is
# fixed (the dense entries, may_skip_parameters False, neither: MoD's blocks always take k >= 1 tokens)
NOTHING_IDLES = {"depth_gate", "param_share"}


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_an_idle_expert_module_or_block_gets_a_zero_gradient_not_none(name, extra):
    """One rule on every path: a unit no token chose runs on zero tokens when gradients are recorded, so
    AdamW treats it the same in eager and compiled training (a None gradient is skipped, a zero one decays).
    A two-token batch leaves most experts / modules / blocks of every routed entry idle."""
    model = build(name, extra)
    idle = invariants.check_idle_units_get_zero_gradients(model, tokens(B=1, length=2))
    expect_idle = model.may_skip_parameters and not (name in NOTHING_IDLES and not extra)
    assert idle or not expect_idle, f"{name}: the batch left no unit idle, so the check saw nothing"


# ---------------------------------------------------------------------------- c. fp32 routers
@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_router_values_are_those_of_an_fp32_computation_under_bf16_autocast(name, extra):
    invariants.check_router_fp32(build(name, extra), tokens())


# ---------------------------------------------------------------------------- c2. routing sites
def right_padded(B=3, lengths=(11, 23, T)):
    mask = torch.zeros(B, T, dtype=torch.long)
    for row, length in enumerate(lengths):
        mask[row, :length] = 1
    return mask


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_one_site_per_routing_decision_with_unique_names_and_an_honoured_valid_mask(name, extra):
    invariants.check_routing_sites(build(name, extra), tokens(B=3), right_padded())


# ---------------------------------------------------------------------------- c3. initialisation
@pytest.mark.parametrize("name", variant_names())
def test_build_model_applies_the_weight_initialisation(name):
    invariants.check_initialised(build(name, {}))


# ---------------------------------------------------------------------------- d. batch independence
@pytest.mark.parametrize("name,extra", [c for c in CASES if not capacity_limited(c[1])],
                         ids=[i for c, i in zip(CASES, IDS) if not capacity_limited(c[1])])
def test_an_example_ignores_batch_mates_and_right_padding_and_short_sequences_run(name, extra):
    model = build(name, extra).eval()
    idx = tokens(B=3)
    lengths = (11, 23, T)
    mask = right_padded(3, lengths)
    with torch.no_grad():
        padded = model(idx, attention_mask=mask)
        for row, length in enumerate(lengths):
            alone = model(idx[row:row + 1, :length])
            torch.testing.assert_close(padded.logits[row, :length], alone.logits[0], atol=1e-5, rtol=1e-5)
        for length in (1, 2, 3):  # shorter than 1/capacity: k >= 1, never an error
            assert model(idx[:, :length]).logits.shape == (3, length, V)


# ---------------------------------------------------------------------------- e. FLOPs
def counted(model, *args, **kwargs):
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        out = model(*args, **kwargs)
    return out, counter.get_total_flops()


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_analytic_flops_match_the_flop_counter_for_a_full_forward_and_cached_decode_steps(name, extra):
    model = build(name, extra).eval()
    idx = tokens(B=2)
    with causal_mode(model, model.routing_sees_future):
        out, flops = counted(model, idx)
        assert model.flops_per_token(out.trace).forward * idx.numel() == pytest.approx(flops, rel=1e-6)
        cache = KVCache()
        counted(model, idx[:, :20], cache=cache)
        for t in range(20, 23):
            out, flops = counted(model, idx[:, t:t + 1], cache=cache)
            # from the trace alone (it carries the key length); a variant without routing sites is told it
            analytic = model.flops_per_token(out.trace, seq_len=None if out.trace else t + 1, queries=1)
            assert analytic.forward * 2 == pytest.approx(flops, rel=1e-6), f"decode step at {t}"


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_the_probes_per_token_compute_is_defined_and_adds_up_to_about_the_batch_figure(name, extra, training):
    """``callbacks.probe.token_flops`` (compute per difficulty level) cuts the trace to one token: every variant
    must give a finite figure per token from its own trace, and their mean stays close to the batch's figure
    (below it by the sequence-shared attention scores a lone token does not pay, documented there). Soft gates
    report the depth their read-out draws on instead (a share of the layers), so only the lower bound holds."""
    from callbacks.probe import token_flops

    model = build(name, extra).train(training)
    idx = tokens(B=2)
    with torch.no_grad(), causal_mode(model, False):
        out = model(idx)
    per_token = token_flops(model, out.trace, T, batch_shape=idx.shape)
    cfg = model.config
    assert per_token.shape == idx.shape and torch.isfinite(per_token).all()
    assert (per_token >= cost.lm_head(cfg.d_model, cfg.vocab_size).forward).all()
    ratio = float(per_token.mean()) / model.flops_per_token(out.trace, T).forward
    soft = any(site.kind == "soft_gate" for site in out.trace)
    assert (0.25 if soft else 0.8) <= ratio <= (1.0 if soft else 1.01), ratio


@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_planned_flops_without_a_trace_are_defined(name, extra):
    """isoFLOP sizing, sweep estimates and the FLOPs callback before the first step ask for the FLOPs of a
    forward with no trace (the planned figure): every variant and option must give one."""
    model = build(name, extra)
    for seq_len in (None, 7):
        flops = model.flops_per_token(None, seq_len=seq_len)
        assert math.isfinite(flops.forward) and flops.forward > 0


# ---------------------------------------------------------------------------- f. decoding
@pytest.mark.parametrize("name,extra", [c for c in CASES if not capacity_limited(c[1])],
                         ids=[i for c, i in zip(CASES, IDS) if not capacity_limited(c[1])])
def test_kv_cache_decoding_equals_the_full_causal_forward(name, extra):
    """(Capacity-limited MoE is left out by design: capacity applies per forward call, README "Capacity".)"""
    model = build(name, extra).eval()
    if not model.supports_kv_cache:
        pytest.fail(f"{name} must decode with a KV cache")
    idx = tokens(B=2)
    with torch.no_grad(), model.causal_routing():
        full = model(idx).logits
        cache = KVCache()
        steps = [model(idx[:, :9], cache=cache).logits]
        steps += [model(idx[:, t:t + 1], cache=cache).logits for t in range(9, T)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)
    if not model.has_causal_routing:  # MoD trained without a causal decision: generate() refuses, by design
        with pytest.raises(ConfigError, match="model.mod.sampling"):
            model.prepare_generation()
        return
    prompt = tokens(B=2, length=6)
    assert torch.equal(model.generate(prompt, 8, greedy=True), model.generate(prompt, 8, greedy=True, use_cache=False))


# ---------------------------------------------------------------------------- g. contract shape
@pytest.mark.parametrize("name,extra", CASES, ids=IDS)
def test_aux_loss_is_the_sum_of_its_parts_and_residuals_are_ordered(name, extra):
    model = build(name, extra)
    out = model(tokens(), return_residuals=True)
    torch.testing.assert_close(out.aux_loss, sum(out.aux_losses.values(), torch.zeros(())))
    tags = [s.tag for s in out.residuals]
    assert tags[0] == "embed" and tags.count("embed") == 1
    assert tags[1:] == ["mha", "ffn"] * ((len(tags) - 1) // 2) and len(tags) % 2 == 1
    layers = [s.layer for s in out.residuals[1:]]
    assert layers == sorted(layers), "residual snapshots follow the depth"
    hidden = model(tokens(), compute_logits=False)
    assert hidden.logits is None
    torch.testing.assert_close(model.head(hidden.hidden), out.logits)


# ---------------------------------------------------------------------------- h. explicit beats preset
# (variant, preset field) whose dataclass default conflicts with the rest of the preset -> the error's field
CONFLICTS_WITH_THE_PRESET = {("depth_gate_skip", "depth_gate.mode"): r"^model\.depth_gate\.skip_compute: .*'hard'"}

@pytest.mark.parametrize("name", [n for n in variant_names() if VARIANTS[n].overrides])
def test_an_explicit_value_equal_to_the_default_beats_the_preset(name):
    from architectures.config import ModelConfig, config_groups

    for group, values in VARIANTS[name].overrides.items():
        cls = config_groups()[group]
        for field, preset in values.items():
            default = getattr(cls(), field)
            if default == preset:
                continue
            config = ModelConfig(variant=name, **{group: {field: default}})  # a dict: the preset fills the rest
            conflict = CONFLICTS_WITH_THE_PRESET.get((name, f"{group}.{field}"))
            if conflict:  # the explicit default won, and does not fit the rest of the preset: rejected, named
                with pytest.raises(ConfigError, match=conflict):
                    build_model(config)
                continue
            built = build_model(config).config
            assert getattr(getattr(built, group), field) == default, f"{name}: model.{group}.{field}"


# ---------------------------------------------------------------------------- i. routing health
# Whether a borderline entry collapses within 200 steps depends on float rounding (one machine's kernels
# against another's; mom_official was healthy at seed 0 on one machine and collapsed on the next), so an
# entry's verdict is the majority of three seeds, evaluated lazily: an entry healthy at the first seed passes
# at once (the common case costs one run), otherwise two more seeds decide. A known-unhealthy entry is always
# judged by the majority. Measured over seeds 0-3 (2026-12-01, this suite's tiny settings): mom_official
# collapsed in 3 of 4 (its chunk0 FFN pool onto one module: the official balance loss, a second softmax over
# the probabilities, barely pushes); mode_staged in 1 of 4, moe_dense_ffn in 0 of 3.
# Strict: the test fails once a listed entry's majority is healthy, so the list cannot go stale.
KNOWN_UNHEALTHY = {
    "mom_official": "its FFN pool collapses onto one module within 200 steps in most seeds: the official "
                    "balance loss (a second softmax over the router probabilities) is nearly flat",
}
HEALTH_SEEDS = (0, 1, 2)
# settings the health run uses instead of the tiny test settings: early exit's test threshold (0.0155, chosen so
# that an untrained head exits half the tokens) lets a trained head exit nearly every token at layer 0; the
# health verdict is about the rule as configured by default (threshold 0.9, layer dropout p_max 0.1)
HEALTH_SETTINGS = {"early_exit": {"early_exit": {"exit_threshold": 0.9, "p_max": 0.1}}}


def pinned_health_failure(name: str, seed: int):
    """``routing_health_failure`` in a fresh process with the CPU kernel paths pinned (AVX2 for MKL and ATen, one
    thread): a known-unhealthy entry's collapse is a coin flip over seeds whose outcome otherwise changes with the
    machine's kernels (mom_official: healthy at seeds 0-2 on an AMD EPYC with AVX-512 kernels, collapsed at 1-3
    with AVX2 ones; the Intel machine before collapsed at most seeds), so its strict verdict is taken where the
    arithmetic is the same on every x86 machine."""
    import json
    import os
    import subprocess
    import sys

    code = ("import json, sys, torch; torch.set_num_threads(1); from tests.test_contract import routing_health_failure; "
            "print(json.dumps(routing_health_failure(sys.argv[1], int(sys.argv[2]))))")
    env = {**os.environ, "MKL_CBWR": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "OMP_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", code, name, str(seed)], env=env, capture_output=True, text=True,
                          cwd=pathlib.Path(__file__).resolve().parents[1], timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def routing_health_failure(name: str, seed: int):
    """None if ``name`` trained 200 steps from ``seed`` routes healthily, else the failed check's message."""
    from datamodules.lm import DataConfig, LMDataModule

    dm = LMDataModule(DataConfig(batch_size=8), block_size=T, seed=seed)
    dm.prepare_data()
    dm.setup("fit")
    torch.manual_seed(seed)
    model = build_model(VARIANTS[name].test_config(name, vocab_size=dm.vocab_size, **HEALTH_SETTINGS.get(name, {})))
    batches = iter(dm.train_dataloader())
    with torch.no_grad():
        if not model(next(batches)[:, :-1]).trace:
            assert not invariants.router_modules(model), f"{name} has routers but reports no routing site"
            return None  # dense: nothing routed, nothing to collapse
    invariants.train_briefly(model, batches, 200, dm.vocab_size)
    with torch.no_grad():
        out = model(next(batches)[:, :-1])
    # MoDE integrated enforces its no-op share (1 - capacity); elsewhere at most 90% may skip
    budget = 1.0 - model.config.mod.capacity if model.config.variant == "mode_integrated" else 0.9
    try:
        invariants.check_routing_healthy(out.trace, budget)
    except AssertionError as failure:
        return str(failure)
    return None


@pytest.mark.slow
@pytest.mark.parametrize("name", [
    pytest.param(n, marks=pytest.mark.xfail(raises=AssertionError, strict=True, reason=KNOWN_UNHEALTHY[n]))
    if n in KNOWN_UNHEALTHY else n for n in variant_names()])
def test_routing_stays_healthy_after_training_on_the_embedded_corpus(name):
    """Every registry entry, 200 steps at tiny: no no-op/SKIP beyond its budget, no pool collapsed onto one
    member (a new variant that collapses onto its no-op fails here). Verdict: the majority of three seeds."""
    failures = {}
    check = pinned_health_failure if name in KNOWN_UNHEALTHY else routing_health_failure
    for i, seed in enumerate(HEALTH_SEEDS):
        failures[seed] = check(name, seed)
        if i == 0 and failures[seed] is None and name not in KNOWN_UNHEALTHY:
            return
        healthy = sum(f is None for f in failures.values())
        if healthy * 2 > len(HEALTH_SEEDS):
            return
        if (len(failures) - healthy) * 2 > len(HEALTH_SEEDS):
            raise AssertionError("; ".join(f"seed {s}: {f}" for s, f in failures.items() if f is not None))
