"""The per-token depth figures (callbacks/depth.py): a hand-made trace, the probe levels, and a short recur_halt fit."""
from __future__ import annotations

import types

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.loggers import TensorBoardLogger

from architectures import build_model
from architectures.contract import RoutingSite
from architectures.registry import VARIANTS
from callbacks.common import reported_depth
from callbacks.depth import DepthFigures, depth_counts, depth_scalars, level_depth_figure
from callbacks.probe import ProbeMetrics, probe_batches, scalars, spearman, stats_tensor, summarize


def site(name, depth=None, max_depth=4.0, valid=None):
    B, T = (2, 3) if depth is None else depth.shape
    extras = {} if depth is None else {"depth": depth, "max_depth": torch.tensor(max_depth)}
    return RoutingSite(name=name, kind="token_choice", choice_names=["a", "b"], selected=torch.zeros(B, T, 1).long(),
                       weights=torch.ones(B, T, 1), valid=valid, extras=extras)


def events(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "histograms": 0, "images": 0})
    accumulator.Reload()
    return accumulator


def test_the_counts_of_a_hand_made_trace_leave_padding_out_and_read_the_last_depth_site():
    depth = torch.tensor([[1.0, 2.0, 2.0, 4.0], [3.0, 1.5, 0.0, 4.0]])
    valid = torch.tensor([[True, True, True, True], [True, True, False, False]])
    trace = [site("first", torch.full((2, 4), 9.0)), site("depth", depth, valid=valid), site("later")]
    assert reported_depth(trace)[0] is depth  # the last site that reports a depth
    counts = depth_counts(trace)
    # real tokens: 1, 2, 2, 4, 3, 1.5 -> buckets 0..4 = [0, 2, 2, 1, 1]; sum 13.5 over 6 tokens
    assert counts.tolist() == [0, 2, 2, 1, 1, 13.5, 6]
    assert depth_scalars(counts) == pytest.approx({"depth/mean": 13.5 / 6, "depth/mean_share": 13.5 / 24})
    assert depth_counts([site("no_depth")]) is None and depth_counts([]) is None


def test_the_per_level_depth_comes_from_the_probes_level_handling_and_is_drawn(tmp_path):
    tokens = {"level": np.array([0, 0, 1, 3, 3]), "family": np.zeros(5, int), "loss": np.ones(5),
              "correct": np.ones(5), "flops": np.ones(5), "depth": np.array([1.0, 1.0, 2.0, 4.0, 3.0])}
    summary = summarize(stats_tensor(tokens, 1), spearman(tokens["level"], tokens["flops"]), ["arith"])
    assert {k: row["depth"] for k, row in summary["levels"].items()} == {"0": 1.0, "1": 2.0, "3": 3.5}
    assert scalars(summary)["probe/level3/depth"] == 3.5
    no_depth = {k: v for k, v in tokens.items() if k != "depth"}  # a variant without depth: no depth key
    assert "depth" not in summarize(stats_tensor(no_depth, 1), spearman(no_depth["level"], no_depth["flops"]),
                                    ["arith"])["levels"]["0"]
    fig = level_depth_figure(summary["levels"])
    assert [bar.get_height() for bar in fig.axes[0].patches] == [1.0, 2.0, 3.5]
    probe = ProbeMetrics()
    probe.latest = summary
    logger = TensorBoardLogger(str(tmp_path), name="run")
    trainer = types.SimpleNamespace(sanity_checking=False, is_global_zero=True, callbacks=[probe], loggers=[logger],
                                    global_step=5)
    DepthFigures().on_validation_epoch_end(trainer, None)
    logger.experiment.flush()
    assert "depth/per_level" in events(logger.log_dir).Tags()["images"]


def test_probe_batches_collect_the_depth_each_labelled_token_ran():
    torch.manual_seed(0)
    name = "recur_halt"
    model = build_model(VARIANTS[name].test_config(name, init_std=0.2, recur_halt={"halt_bias_init": -1.0,
                                                                                   "threshold": 0.2}))
    blocks = torch.randint(0, 97, (3, 17), generator=torch.Generator().manual_seed(2)).numpy()
    levels = np.tile(np.arange(16) % 5 - 1, (3, 1))  # level -1: unlabelled
    per_token = probe_batches(model, blocks, levels, np.zeros((3, 16), int), batch_size=2)
    with torch.no_grad(), model.causal_routing():
        expected = torch.cat([model(torch.as_tensor(blocks[i:i + 2, :-1])).trace[-1].extras["depth"]
                              for i in (0, 2)]).numpy()
    assert np.array_equal(per_token["depth"], expected[levels >= 0])
    assert len(set(per_token["depth"].tolist())) >= 2


def test_a_short_recur_halt_fit_logs_the_depth_histogram_and_mean_of_the_batch_it_ran(tmp_path, one_thread):
    from lightning_modules.lm import LanguageModelModule

    B, T = 4, 16
    L.seed_everything(0, verbose=False)
    module = LanguageModelModule(model=dict(variant="recur_halt", vocab_size=32, d_model=32, n_layer=4, n_head=2,
                                            block_size=T, init_std=0.2,
                                            recur_halt={"halt_bias_init": -1.0, "threshold": 0.2}), max_steps=4)
    callback = DepthFigures(every=2)
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=TensorBoardLogger(str(tmp_path), name="run"),
                        callbacks=[callback], enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, log_every_n_steps=1, num_sanity_val_steps=0)
    data = torch.randint(0, 32, (32, T + 1), generator=torch.Generator().manual_seed(3))
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=B))
    depth = module.last_output.trace[-1].extras["depth"]  # the step-4 batch, the last one logged
    assert torch.equal(callback.latest_counts, depth_counts(module.last_output.trace))
    trainer.logger.experiment.flush()
    logged = events(trainer.logger.log_dir)
    means = logged.Scalars("depth/mean")
    assert [e.step for e in means] == [1, 3] and means[-1].value == pytest.approx(float(depth.mean()))
    (*_, last) = logged.Histograms("depth/per_token")
    assert last.histogram_value.num == B * T and last.histogram_value.sum == pytest.approx(float(depth.sum()))
    assert list(last.histogram_value.bucket)[:5] == torch.bincount(depth.long().flatten(), minlength=5).tolist()


@pytest.mark.slow
def test_lightning_ddp_run_logs_the_depth_of_both_shards(tmp_path):
    """2 CPU ranks x 2 sequences log the depth mean and histogram of 1 process x the same 4 sequences (one step:
    each token's depth depends on the identical initial weights and its own sequence only)."""
    from experiments.run import main
    from tests.conftest import TINY_RUN, run_in_two_ddp_processes

    def options(folder, batch):
        return ["--variant", "recur_halt", "--model.n_layer", "4", "--model.init_std", "0.2",
                "--model.recur_halt.halt_bias_init", "-1.0", "--model.recur_halt.threshold", "0.2", "--max_steps", "1",
                "--val_every", "1", "--log_dir", str(folder), *TINY_RUN, "--data.batch_size", str(batch),
                "--callbacks.depth_every", "1", "--callbacks.contribution", "false", "--trainer.accelerator", "cpu"]

    def depth_logged(run_dir):
        logged = events(run_dir)
        (histogram,) = logged.Histograms("depth/per_token")
        return logged.Scalars("depth/mean")[-1].value, list(histogram.histogram_value.bucket)

    ddp = depth_logged(run_in_two_ddp_processes(options(tmp_path / "ddp", 2)))
    single = depth_logged(main(options(tmp_path / "single", 4)))
    assert ddp[0] == pytest.approx(single[0], rel=1e-6) and ddp[1] == single[1]
    assert sum(single[1]) == 4 * 64 and sum(1 for count in single[1] if count) >= 2  # every token, mixed depths
