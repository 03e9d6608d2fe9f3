"""Routing, FLOPs and contribution callbacks: hand-computed statistics, DDP reduction, a real fit."""
from __future__ import annotations

import math
import os
import socket
import types
import warnings

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.loggers import TensorBoardLogger

from architectures import ModelConfig, build_model
from architectures.config import ConfigError
from architectures.contract import ModelOutput, RoutingSite
from architectures.flops import vanilla_flops
from callbacks import CallbacksConfig, default_callbacks
from callbacks.depth import DepthFigures
from callbacks.contribution import (ContributionCallback, check_probe, direct_logit_attribution,
                                    measure_contribution, ratios_from_values)
from callbacks.flops import FlopsCallback, PeakAwareThroughputMonitor, flops_scalars, peak_flops, throughput_monitor
from callbacks.probe import ProbeMetrics
from callbacks.routing import RoutingAccumulator, RoutingStatistics, RoutingStats, kept_onehot
from callbacks.tensorboard import TensorBoardExtras
from lightning_modules.lm import LanguageModelModule


def _site(name, selected, choices, group="g", step=0, kind="token_choice", **kw) -> RoutingSite:
    selected = torch.as_tensor(selected, dtype=torch.long)
    if selected.dim() == 2:
        selected = selected[..., None]
    return RoutingSite(name=name, kind=kind, choice_names=list(choices), selected=selected,
                       weights=torch.ones(selected.shape), group=group, step=step, **kw)


def _stats(trace) -> RoutingStats:
    acc = RoutingAccumulator()
    acc.add(trace)
    return acc.reduce()


# ---------------------------------------------------------------------------- routing statistics
def test_transition_matrix_follows_steps_not_names_and_rows_sum_to_one():
    choices = ["e0", "e1", "skip"]
    # named so that alphabetical order is the reverse of step order
    first = _site("b.first", [[0, 0, 1, 2, 1]], choices, step=0)
    second = _site("a.second", [[1, 0, 1, 1, 2]], choices, step=1)
    stats = _stats([second, first])
    (t,) = stats.transitions
    assert (t.source, t.target) == ("b.first", "a.second")
    assert torch.equal(t.counts, torch.tensor([[1., 1, 0], [0, 1, 1], [0, 1, 0]], dtype=torch.float64))
    expected = torch.tensor([[0.5, 0.5, 0.0], [0.0, 0.5, 0.5], [0.0, 1.0, 0.0]], dtype=torch.float64)
    assert torch.allclose(t.matrix, expected)
    assert torch.allclose(t.matrix.sum(1), torch.ones(3, dtype=torch.float64))
    assert stats.sites["b.first"].fractions.tolist() == pytest.approx([0.4, 0.4, 0.2])
    assert stats.sites["b.first"].processed_fraction == pytest.approx(0.8)  # 4 of 5 tokens not skipped


def test_k2_slots_dropped_and_padding_follow_the_contract_by_hand():
    # site A: k=2 over (x, y, skip); token 1's y-slot is dropped, token 2 is padding
    a = _site("A", [[[0, 1], [2, 1], [0, 0]]], ["x", "y", "skip"], step=0,
              dropped=torch.tensor([[[False, False], [False, True], [True, True]]]),
              valid=torch.tensor([[True, True, False]]),
              probs=torch.tensor([[[0.5, 0.5, 0.0], [1.0, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3]]]))
    b = _site("B", [[2, 0, 1]], ["p", "q", "r"], step=1, valid=torch.tensor([[True, True, False]]))
    assert torch.equal(kept_onehot(a).sum(0), a.counts().float())  # the contract's counts()
    stats = _stats([a, b])
    (t,) = stats.transitions
    assert torch.equal(t.counts, torch.tensor([[0., 0, 1], [0, 0, 1], [1, 0, 0]], dtype=torch.float64))
    assert torch.equal(t.matrix, torch.tensor([[0., 0, 1], [0, 0, 1], [1, 0, 0]], dtype=torch.float64))
    site = stats.sites["A"]
    assert site.counts.tolist() == [1, 1, 1]
    assert site.dropped_fraction == pytest.approx(1 / 4)  # 1 of the 4 valid (token, slot) pairs
    assert site.processed_fraction == pytest.approx(1 / 2)  # token 1 kept only its skip slot
    assert site.load_cv == pytest.approx(0.0)  # x and y equally loaded; skip is not a load
    assert site.entropy == pytest.approx(math.log(2) / 2)
    scalars = stats.scalars()
    assert scalars["routing/A/frac/skip"] == pytest.approx(1 / 3)
    assert "routing/B/entropy" not in scalars and "routing/B/dropped_fraction" not in scalars


def test_counts_equal_contract_counts_on_random_traces_and_unvisited_rows_stay_zero():
    g = torch.Generator().manual_seed(0)
    for k in (1, 2, 3):
        sel = torch.randint(0, 5, (3, 7, k), generator=g)
        site = _site("s", sel, [f"o{i}" for i in range(5)], dropped=torch.rand(3, 7, k, generator=g) < 0.3,
                     valid=torch.rand(3, 7, generator=g) < 0.8)
        assert torch.equal(kept_onehot(site).sum(0), site.counts().float())
    lonely = _stats([_site("a", [[0, 0]], ["u", "v"], step=0), _site("b", [[1, 0]], ["u", "v"], step=1)])
    assert lonely.transitions[0].matrix.tolist() == [[0.5, 0.5], [0.0, 0.0]]


def test_load_cv_is_population_std_over_mean():
    stats = _stats([_site("m", [[0, 0, 0, 1]], ["e0", "e1"])])
    assert stats.sites["m"].load_cv == pytest.approx(0.5)  # counts (3, 1): std 1, mean 2


def _random_traces(seed: int, steps: int = 3):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        B, T = 2, 6
        probs = torch.rand(B, T, 4, generator=g).softmax(-1)
        yield [
            _site("layer0.moe", probs.topk(2).indices, [f"expert{i}" for i in range(4)], group="moe", step=0,
                  probs=probs, dropped=torch.rand(B, T, 2, generator=g) < 0.2),
            _site("layer1.moe", torch.randint(0, 4, (B, T, 2), generator=g), [f"expert{i}" for i in range(4)],
                  group="moe", step=1, probs=torch.rand(B, T, 4, generator=g).softmax(-1)),
            _site("block1.mod", torch.randint(0, 2, (B, T, 1), generator=g), ["skip", "block"], group="mod",
                  kind="expert_choice"),
        ]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ddp_worker(rank: int, world: int, port: int, out: str) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        acc = RoutingAccumulator()
        for trace in _random_traces(seed=rank):  # each rank: its own data shard
            acc.add(trace)
        reduced = acc.reduce()
        if rank == 0:
            torch.save(pack_of(reduced), out)
    finally:
        dist.destroy_process_group()


def pack_of(stats: RoutingStats):
    return {"sites": {n: (s.counts, s.tokens, s.slots, s.dropped, s.processed, s.entropy) for n, s in stats.sites.items()},
            "transitions": [(t.source, t.target, t.counts) for t in stats.transitions]}


def test_two_process_gloo_reduction_equals_one_process_over_both_shards(tmp_path):
    out = str(tmp_path / "reduced.pt")
    # spawn, not fork: forking a process whose OpenMP/intra-op thread pools already run (any earlier
    # test in the session) can deadlock the children on an inherited lock
    mp.start_processes(_ddp_worker, args=(2, _free_port(), out), nprocs=2, join=True, start_method="spawn")
    distributed = torch.load(out)
    single = RoutingAccumulator()
    for shard in (0, 1):
        for trace in _random_traces(seed=shard):
            single.add(trace)
    expected = pack_of(single.reduce())
    assert distributed["sites"].keys() == expected["sites"].keys()
    for name, (counts, *scalars, entropy) in expected["sites"].items():
        got_counts, *got_scalars, got_entropy = distributed["sites"][name]
        assert torch.equal(got_counts, counts) and got_scalars == scalars
        assert (entropy is None and got_entropy is None) or got_entropy == pytest.approx(entropy, rel=1e-12)
    for (s, t, c), (gs, gt, gc) in zip(expected["transitions"], distributed["transitions"]):
        assert (s, t) == (gs, gt) and torch.equal(c, gc)
    assert single.buffer is None  # a reduce starts a new interval


def test_layout_change_is_an_error_and_no_sites_warns_once():
    acc = RoutingAccumulator()
    acc.add([_site("a", [[0]], ["x", "y"])])
    with pytest.raises(RuntimeError, match="routing sites changed"):
        acc.add([_site("b", [[0]], ["x", "y"])])
    class Routed(torch.nn.Module):  # a model with a router that reports no sites: a bug worth a warning
        def __init__(self):
            super().__init__()
            self.router = torch.nn.Linear(2, 2)
            self.config = types.SimpleNamespace(variant="broken_mod")

    dense = torch.nn.Module()  # vanilla: nothing routes, nothing to warn about (issue 30: the default run's first screen)
    dense.config = types.SimpleNamespace(variant="vanilla")
    warned = {}
    for model in (dense, Routed()):
        callback = RoutingStatistics(every=1)
        trainer = types.SimpleNamespace(global_step=1, is_global_zero=True)
        module = types.SimpleNamespace(last_output=ModelOutput(torch.zeros(1, 2, 3), torch.zeros(())), model=model)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for step in (1, 2, 3):
                trainer.global_step = step
                callback.on_train_batch_end(trainer, module, None, torch.zeros(2, 3, dtype=torch.long), 0)
        warned[model.config.variant] = [str(w.message) for w in caught if "no routing sites" in str(w.message)]
        assert callback.latest is None and callback.accumulator.buffer is None
    assert warned == {"vanilla": [], "broken_mod": [
        "routing statistics: variant 'broken_mod' has routers but reported no routing sites; nothing is logged for routing"]}


# ---------------------------------------------------------------------------- configuration
@pytest.mark.parametrize("field", ["routing_every", "routing_images_every", "flops_every", "contribution_every",
                                   "depth_every"])
def test_non_positive_intervals_are_errors_naming_the_field(field):
    for bad in (0, -3):
        with pytest.raises(ConfigError, match=f"^callbacks.{field}: must be a positive integer"):
            CallbacksConfig(**{field: bad}).validate()


@pytest.mark.parametrize("build,field", [
    (lambda bad: RoutingStatistics(every=bad), "routing_every"),
    (lambda bad: RoutingStatistics(images_every=bad), "routing_images_every"),
    (lambda bad: FlopsCallback(every=bad), "flops_every"),
    (lambda bad: ContributionCallback(every=bad), "contribution_every"),
    (lambda bad: ContributionCallback(batch_size=bad), "contribution_batch_size"),
    (lambda bad: ProbeMetrics(blocks=bad), "probe_blocks"),
    (lambda bad: DepthFigures(every=bad), "depth_every"),
], ids=lambda x: x if isinstance(x, str) else "")
def test_callbacks_built_in_code_refuse_non_positive_sizes_naming_the_field(build, field):
    """As a researcher adds a callback to their own Trainer (no CallbacksConfig in between)."""
    for bad in (0, -3):
        with pytest.raises(ValueError, match=f"^callbacks.{field}: must be a positive integer, got {bad}$"):
            build(bad)


def test_cli_rejects_bad_interval_and_too_long_probe_before_training(tmp_path):
    from experiments.run import main

    with pytest.raises(ConfigError, match="^callbacks.contribution_every"):
        main(["--callbacks.contribution_every", "0", "--log_dir", str(tmp_path)])
    with pytest.raises(ConfigError, match="^callbacks.contribution_seq_len: .*model.block_size=64"):
        main(["--callbacks.contribution_seq_len", "65", "--model.block_size", "64", "--log_dir", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_default_callbacks_follow_the_switches():
    names = lambda cbs: [type(c).__name__ for c in cbs]  # noqa: E731
    assert names(default_callbacks(types.SimpleNamespace(callbacks={}))) == [
        "RoutingStatistics", "FlopsCallback", "PeakAwareThroughputMonitor", "ContributionCallback", "DepthFigures",
        "TensorBoardExtras"]
    cfg = types.SimpleNamespace(callbacks={"routing": False, "throughput": False, "contribution": False,
                                           "tensorboard": False, "depth": False, "flops_every": 7})
    (flops,) = default_callbacks(cfg)
    assert isinstance(flops, FlopsCallback) and flops.every == 7


def test_peak_flops_fill_lightnings_gap_for_a_plain_h200():
    assert peak_flops("NVIDIA H200", torch.bfloat16) == 989.5e12
    assert peak_flops("NVIDIA H200", torch.float16) == 989.5e12
    # the bench's bf16 table as well; the monitor uses ours only where Lightning's own table has no entry
    assert peak_flops("NVIDIA H100 NVL", torch.bfloat16) == 835.5e12
    assert isinstance(throughput_monitor(4), PeakAwareThroughputMonitor)


# ---------------------------------------------------------------------------- contribution
def _tiny(variant="vanilla", vocab=8, **kw):
    torch.manual_seed(0)
    return build_model(ModelConfig(variant=variant, vocab_size=vocab, d_model=32, n_layer=3, n_head=2,
                                   block_size=16, init_std=0.2, **kw))  # large enough to move the argmax


def test_ratios_from_gains_by_hand_and_sum_to_one():
    r = ratios_from_values(["embed", "mha", "ffn", "mha", "ffn"], [0.0, 0.2, 0.3, 0.25, 0.5])
    assert r["mha"] == pytest.approx(0.3) and r["ffn"] == pytest.approx(0.7)
    assert ratios_from_values(["embed", "mha", "ffn"], [0.1, 0.1, 0.1]) == {"mha": None, "ffn": None}
    model = _tiny()
    probe = torch.randint(0, 8, (16, 17), generator=torch.Generator().manual_seed(1))
    result = measure_contribution(model, probe)
    assert result.ratio_mha is not None
    assert result.ratio_mha + result.ratio_ffn == pytest.approx(1.0)
    assert result.labels[:3] == ["00.embed", "01.mha0", "02.ffn0"] and len(result.accuracy) == 7


def test_zeroed_ffns_give_ffn_ratio_zero_and_zero_attribution():
    model = _tiny()
    with torch.no_grad():
        for block in model.blocks:
            block.mlp.c_proj.weight.zero_()
            block.mlp.c_proj.bias.zero_()
    probe = torch.randint(0, 8, (16, 17), generator=torch.Generator().manual_seed(1))
    result = measure_contribution(model, probe)
    assert result.ratio_ffn == 0.0 and result.ratio_mha == 1.0
    assert [d for d, t in zip(result.dla, result.tags) if t == "ffn"] == [0.0] * 3


def test_direct_logit_attribution_adds_up_to_the_correct_logit():
    model = _tiny("mod", vocab=11).eval()
    idx = torch.randint(0, 11, (3, 16), generator=torch.Generator().manual_seed(2))
    targets = torch.roll(idx, -1, dims=1)
    with torch.no_grad():
        out = model(idx, return_residuals=True)
        parts = direct_logit_attribution(model, out.residuals, targets)
        correct = out.logits.gather(-1, targets[..., None]).mean()
    assert float(parts.sum()) == pytest.approx(float(correct), abs=1e-4)


def test_probe_longer_than_the_context_is_an_error():
    model = _tiny()
    with pytest.raises(ConfigError, match="exceeds the model context \\(model.block_size=16\\)"):
        check_probe(model, torch.zeros(2, 18, dtype=torch.long), None)
    with pytest.raises(ConfigError, match="the probe data has 8 per sequence"):
        check_probe(model, torch.zeros(2, 9, dtype=torch.long), 12)
    assert check_probe(model, torch.zeros(2, 17, dtype=torch.long), 10) == 10


# ---------------------------------------------------------------------------- in a real fit
B, T = 4, 16


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    folder = tmp_path_factory.mktemp("fit")
    L.seed_everything(0, verbose=False)
    module = LanguageModelModule(model=dict(variant="moe", vocab_size=32, d_model=32, n_layer=2, n_head=2,
                                            block_size=T, moe={"num_experts": 4, "top_k": 2}), max_steps=4)
    data = torch.randint(0, 32, (64, T + 1))
    callbacks = [RoutingStatistics(every=2, images_every=2), FlopsCallback(every=2), throughput_monitor(2),
                 ContributionCallback(every=2, batch_size=3, seq_len=12), TensorBoardExtras()]
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=TensorBoardLogger(str(folder), name="run"),
                        callbacks=callbacks, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=B))
    return trainer, module, callbacks


def test_fit_routing_counts_cover_every_token_of_the_logged_step(fitted):
    trainer, module, (routing, *_) = fitted
    stats = routing.latest  # the step-4 batch: routing work happens on logging steps only
    assert set(stats.sites) == {"layer0.moe", "layer1.moe"}
    for site in stats.sites.values():
        assert site.tokens == B * T and site.slots == B * T * 2
        assert float(site.counts.sum()) == site.slots - site.dropped
        assert 0 < site.entropy <= math.log(4) + 1e-9
        assert site.dropped == 0  # dropless by default
    (t,) = stats.transitions  # every pair of the 2 x 2 kept slots of each token
    assert (t.source, t.target) == ("layer0.moe", "layer1.moe") and float(t.counts.sum()) == 4 * B * T
    assert torch.allclose(t.matrix.sum(1), torch.ones(4, dtype=torch.float64))


def test_fit_flops_equal_the_models_flops_per_token(fitted):
    trainer, module, (_, flops, monitor, *_) = fitted
    out = module.last_output  # the step-4 batch, from which the callback computed its last figures
    expected = module.model.flops_per_token(out.trace, T)
    assert flops.latest == flops_scalars(expected, vanilla_flops(module.model.config, T))
    assert flops.latest["flops/training"] == 3 * flops.latest["flops/forward"]
    assert module.flops_per_batch == int(expected.training * B * T)
    assert flops.latest["flops/ratio_to_vanilla"] == expected.forward / vanilla_flops(module.model.config, T).forward


def test_fit_contribution_is_measured_on_the_fixed_probe(fitted):
    trainer, module, (*_, contribution, _) = fitted
    assert contribution.probe.shape == (3, T + 1)
    result = contribution.latest
    assert len(result.accuracy) == 1 + 2 * 2
    if result.ratio_mha is not None:
        assert result.ratio_mha + result.ratio_ffn == pytest.approx(1.0)
    again = measure_contribution(module.model, contribution.probe, 12)
    assert again.accuracy == result.accuracy  # measured without touching the weights or the RNG


@pytest.mark.slow
def test_lightning_ddp_run_logs_the_routing_of_both_shards(tmp_path):
    """2 CPU ranks x 2 sequences log the same routing fractions as 1 process x the same 4 sequences.

    One step, dropless top-2 MoE: each token's routing depends only on the (identical) initial
    weights, so the step-1 statistics must agree once both shards are summed.
    """
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from experiments.run import main
    from tests.conftest import TINY_RUN, run_in_two_ddp_processes

    def options(folder, batch):
        return ["--variant", "moe", "--model.moe.num_experts", "4", "--model.moe.top_k", "2", "--max_steps", "1",
                "--val_every", "1", "--log_dir", str(folder), *TINY_RUN, "--data.batch_size", str(batch),
                "--callbacks.routing_every", "1", "--callbacks.contribution", "false", "--trainer.accelerator", "cpu"]

    def routing_scalars(run_dir):
        events = EventAccumulator(str(run_dir))
        events.Reload()
        return {t: events.Scalars(t)[-1].value for t in events.Tags()["scalars"] if t.startswith("routing/")}

    ddp = routing_scalars(run_in_two_ddp_processes(options(tmp_path / "ddp", 2)))
    single = routing_scalars(main(options(tmp_path / "single", 4)))  # the reference: one process, in this one
    assert "routing/layer0.moe/frac/expert0" in single and ddp.keys() == single.keys()
    for tag, value in single.items():
        assert ddp[tag] == pytest.approx(value, rel=1e-5, abs=1e-6), tag


def test_the_contribution_figure_labels_its_axes_with_units_and_readable_ticks():
    from callbacks.contribution import TICK_FONT, contribution_figure

    torch.manual_seed(0)
    model = build_model(ModelConfig(variant="vanilla", size="tiny", vocab_size=64, d_model=32, n_layer=2, n_head=2,
                                    block_size=16))
    fig = contribution_figure(measure_contribution(model, torch.randint(0, 64, (2, 17))))
    accuracy, dla = fig.axes
    assert "fraction" in accuracy.get_ylabel() and "logits" in dla.get_ylabel()
    for ax in fig.axes:
        labels = ax.get_xticklabels() + ax.get_yticklabels()
        assert labels and min(t.get_fontsize() for t in labels) >= TICK_FONT >= 7
        assert ax.get_xlabel()
