"""Measurement without host syncs on the hot path, and the honesty of the end-of-run numbers."""
from __future__ import annotations

import collections
import sys
import time
import warnings

import lightning as L
import pytest
import torch

from callbacks.contribution import ContributionCallback, bootstrap_ratio_se, measure_contribution, ratios_from_values
from callbacks.flops import FlopsCallback, throughput_monitor
from callbacks.routing import RoutingStatistics
from callbacks.run_summary import StepRecorder
from callbacks.tensorboard import TensorBoardExtras
from lightning_modules.lm import LanguageModelModule, is_logging_step, predictor_quality

T = 16
MOD = dict(variant="mod", vocab_size=32, d_model=32, n_layer=2, n_head=2, block_size=T)
SYNCS = ("item", "cpu", "tolist", "__bool__", "__float__", "__int__")
OURS = ("/callbacks/", "/lightning_modules/")


def _fit(callbacks, max_steps=8, log_every=4, batch_size=4, **trainer_kwargs):
    L.seed_everything(0, verbose=False)
    module = LanguageModelModule(model=MOD, max_steps=max_steps)
    data = torch.randint(0, 32, (64, T + 1))
    trainer = L.Trainer(max_steps=max_steps, accelerator="cpu", callbacks=callbacks, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=log_every,
                        num_sanity_val_steps=0, **trainer_kwargs)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=batch_size))
    return trainer, module


def test_gradient_accumulation_measures_the_whole_optimisation_step(one_thread):
    """Two micro-batches of 2 sequences train like one batch of 4 (the size presets accumulate): the logged
    loss, the loss curve, routing and FLOPs describe the whole step, not its last micro-batch, and each
    step is timed once, from its first micro-batch."""
    runs = {}
    for batch_size, accumulate in ((4, 1), (2, 2)):
        recorder, routing, flops = StepRecorder(), RoutingStatistics(every=2, images_every=100), FlopsCallback(every=2)
        trainer, _ = _fit([recorder, routing, flops], max_steps=4, log_every=2, batch_size=batch_size,
                          accumulate_grad_batches=accumulate, logger=False)
        runs[accumulate] = trainer, recorder, routing, flops
    (whole, rec1, routing1, flops1), (micro, rec2, routing2, flops2) = runs[1], runs[2]
    assert micro.global_step == whole.global_step == 4
    assert float(micro.logged_metrics["train/loss"]) == pytest.approx(float(whole.logged_metrics["train/loss"]), abs=1e-5)
    assert rec2.steps == rec1.steps == [1, 2, 3, 4]
    assert rec2._global_losses == pytest.approx(rec1._global_losses, abs=1e-5)
    assert routing2.latest.scalars() == pytest.approx(routing1.latest.scalars(), abs=1e-5)
    assert flops2.latest == pytest.approx(flops1.latest, rel=1e-6)
    rec2._resolve()
    assert len(set(rec2.timed_steps)) == len(rec2.timed_steps)  # one interval per optimisation step


class SyncCounter(L.Callback):
    """Counts .item() / .cpu() / bool() ... calls made from this project's training code, per step."""

    def __init__(self):
        self.step = 0
        self.calls = collections.Counter()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.step = trainer.global_step + 1  # the step this batch completes

    def on_train_end(self, trainer, pl_module):
        self.step = -1  # summaries after training may read back freely


@pytest.fixture
def count_syncs(monkeypatch):
    counter = SyncCounter()
    for name in SYNCS:
        original = getattr(torch.Tensor, name)

        def wrapped(self, *args, _original=original, _name=name, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if any(part in caller for part in OURS):
                counter.calls[(counter.step, _name, caller.rsplit("/", 2)[-2:][-1])] += 1
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, wrapped)
    return counter


def test_a_training_step_reads_nothing_back_outside_logging_steps(count_syncs, tmp_path, one_thread):
    from lightning.pytorch.loggers import TensorBoardLogger

    callbacks = [count_syncs, StepRecorder(), RoutingStatistics(every=4, images_every=4), FlopsCallback(every=4),
                 throughput_monitor(4), ContributionCallback(every=4, batch_size=2), TensorBoardExtras()]
    _fit(callbacks, max_steps=6, log_every=4, logger=TensorBoardLogger(str(tmp_path)))
    by_step = collections.Counter()
    for (step, name, where), n in count_syncs.calls.items():
        by_step[step] += n
    logging = {4, 6}  # log_every_n_steps 4, and the last step
    quiet = {step: n for step, n in by_step.items() if step not in logging and step > 0}
    assert not quiet, {k: v for k, v in count_syncs.calls.items() if k[0] in quiet}
    assert all(by_step[s] > 0 for s in logging)  # the counter sees the reads that logging steps do make


def test_logging_steps_are_lightnings_and_the_last():
    class Trainer:
        log_every_n_steps, max_steps = 10, 25

    assert [s for s in range(1, 26) if is_logging_step(Trainer, s)] == [10, 20, 25]


def test_intervals_longer_than_the_run_are_warned_before_training_and_flushed_at_the_last_step(one_thread):
    routing, flops = RoutingStatistics(every=100), FlopsCallback(every=100)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit([routing, flops], max_steps=3, log_every=50)
    messages = [str(w.message) for w in caught]
    assert any("callbacks.routing_every=100 is longer than trainer.max_steps=3" in m for m in messages)
    assert any("callbacks.flops_every=100 is longer than trainer.max_steps=3" in m for m in messages)
    assert routing.latest is not None and routing.latest_step == 2  # the last step (batch index 2)
    assert flops.summary()["step"] == 3


class Slow(L.Callback):
    def on_train_batch_end(self, *args):
        time.sleep(0.05)


def test_median_step_time_includes_the_callbacks(one_thread):
    recorder = StepRecorder(skip_first=1)
    _fit([recorder, Slow()], max_steps=5, log_every=1)  # Slow runs after the recorder's own hook
    assert recorder.median_step_time >= 0.05
    assert len(recorder.step_times) == 5 and recorder.timed_steps == [1, 2, 3, 4, 5]


def test_recorder_state_survives_a_resume():
    recorder = StepRecorder()
    recorder.steps, recorder._global_losses = [1, 2], [5.0, 4.0]
    recorder.step_times, recorder.timed_steps, recorder.warm = [0.1, 0.2], [1, 2], [False, True]
    again = StepRecorder()
    again.load_state_dict(recorder.state_dict())
    assert again.losses == [5.0, 4.0] and again.loss_steps == [1, 2] and again.median_step_time == 0.2


def test_nonfinite_check_every_n_steps_names_the_first_bad_step(tmp_path, monkeypatch, one_thread):
    from lightning_modules.lm import NonFiniteLossError

    original = LanguageModelModule.lm_loss

    def poisoned(self, logits, targets, *weights):
        loss = original(self, logits, targets, *weights)
        return loss * float("nan") if self.global_step >= 2 else loss

    monkeypatch.setattr(LanguageModelModule, "lm_loss", poisoned)
    L.seed_everything(0, verbose=False)
    module = LanguageModelModule(model=MOD, optim={"nonfinite_check_every": 4}, max_steps=8)
    trainer = L.Trainer(max_steps=8, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path))
    data = torch.randint(0, 32, (64, T + 1))
    with pytest.raises(NonFiniteLossError, match=r"first at step 2 \(checked at step 3\)"):
        trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(data, batch_size=4))
    blob = torch.load(next(tmp_path.rglob("nonfinite-step2-rank0.pt")), weights_only=False)
    assert blob["step"] == 2 and blob["checked_at"] == 3


# ---------------------------------------------------------------------------- predictor, contribution
def test_predictor_quality_is_precision_recall_f1_not_accuracy():
    # 100 tokens, top-k keeps 12; the predictor says "process" for 8 of them and 2 others
    q = predictor_quality(tp=8, fp=2, fn=4, tn=86)
    assert q["precision"] == pytest.approx(0.8) and q["recall"] == pytest.approx(8 / 12)
    assert q["f1"] == pytest.approx(2 * 0.8 * (8 / 12) / (0.8 + 8 / 12)) and q["accuracy"] == pytest.approx(0.94)
    assert predictor_quality(0, 0, 12, 88) == {"precision": 0.0, "recall": 0.0, "f1": 0.0, "accuracy": 0.88}


def test_bootstrap_standard_error_shrinks_with_more_sequences():
    tags = ["embed", "mha", "ffn"]
    generator = torch.Generator().manual_seed(0)

    def correct(n):  # per sequence: embed 2/16 right, MHA adds ~3, FFN adds ~3 (noisy)
        gains = torch.randint(0, 7, (2, n), generator=generator).double()
        base = torch.full((1, n), 2.0, dtype=torch.float64)
        return torch.cat([base, base + gains[:1], base + gains[:1] + gains[1:]])

    small, large = bootstrap_ratio_se(tags, correct(4)), bootstrap_ratio_se(tags, correct(64))
    assert small["mha"] > large["mha"] > 0 and small["mha"] == pytest.approx(small["ffn"])  # ratios sum to 1
    assert bootstrap_ratio_se(tags, correct(1)) == {"mha": None, "ffn": None}


def test_contribution_default_probe_is_32_sequences_with_standard_errors():
    from architectures import ModelConfig, build_model

    assert ContributionCallback().batch_size == 32
    torch.manual_seed(0)
    model = build_model(ModelConfig.from_dict(dict(variant="vanilla", vocab_size=16, d_model=16, n_layer=2, n_head=2,
                                                   block_size=8)))
    result = measure_contribution(model, torch.randint(0, 16, (32, 9)))
    assert result.sequences == 32
    if result.ratio_mha is not None:
        assert result.ratio_mha_se is not None and result.ratio_mha_se >= 0
        assert "contribution/ratio_mha_se" in result.scalars()
    assert ratios_from_values(result.tags, result.accuracy)["mha"] == result.ratio_mha


# ---------------------------------------------------------------------------- resume
def test_after_a_resume_summary_and_hparams_cover_the_whole_run(tmp_path, one_thread):
    import json

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.plugins.hparams import plugin_data_pb2

    from experiments.run import main
    from tests.conftest import TINY_RUN

    common = ["--variant", "mod", "--val_every", "2", "--log_dir", str(tmp_path), *TINY_RUN,
              "--trainer.log_every_n_steps", "1", "--callbacks.contribution", "false"]
    first = main([*common, "--max_steps", "4"])
    run_dir = main([*common, "--max_steps", "6", "--ckpt_path", "last"])
    assert run_dir == first
    summary = json.loads((run_dir / "summary.json").read_text())
    assert [s for s, _ in summary["train_loss_curve"]] == [1, 2, 3, 4, 5, 6]
    # both parts; steps 2, 4, 6 hold a validation and a checkpoint save: not step times
    assert {s for s, _ in summary["step_times_s"]} == {1, 3, 5}
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    sessions = [value.metadata.plugin_data.content
                for path in sorted(run_dir.glob("events.out.tfevents.*"))
                for event in EventFileLoader(str(path)).Load()
                for value in event.summary.value if value.tag == "_hparams_/session_start_info"]
    assert len(sessions) == 2  # one per part, written after its final validation
    hparams = plugin_data_pb2.HParamsPluginData.FromString(sessions[-1]).session_start_info.hparams
    assert hparams["trainer/max_steps"].number_value == 6 and hparams["trainer/global_step"].number_value == 6
    assert events.Scalars("hparams/val/loss")[-1].value == pytest.approx(summary["final_val_loss"])


def test_routing_map_sample_is_the_first_validation_sequence():
    import types

    val = torch.arange(3 * (T + 1)).view(3, T + 1)
    datamodule = types.SimpleNamespace(val_dataloader=lambda: [torch.utils.data.DataLoader(val, batch_size=2)])
    trainer = types.SimpleNamespace(is_global_zero=True, datamodule=datamodule)
    routing = RoutingStatistics()
    routing.on_train_start(trainer, None)
    assert torch.equal(routing.sample, val[:1, :-1])  # the same after any resume, unlike a training batch


def test_the_module_keeps_the_trace_and_aux_parts_for_callbacks_not_the_logits(one_thread):
    trainer, module = _fit([], max_steps=2, log_every=1)
    out = module.last_output
    assert out.logits is None and module.last_batch_shape == (4, T)
    assert out.trace and all(not t.requires_grad for site in out.trace
                             for t in (site.weights, site.logits) if t is not None)
    assert set(out.aux_losses) and all(not v.requires_grad for v in out.aux_losses.values())


@pytest.mark.parametrize("variant,sees_future", [("vanilla", False), ("mod", True), ("mode_staged", True),
                                                 ("mode_integrated", False), ("moe", False)])
def test_causal_evaluation_is_added_exactly_where_routing_sees_the_future(variant, sees_future):
    module = LanguageModelModule(model=dict(MOD, variant=variant))
    assert module.causal_eval is sees_future and (module.val_loss_causal is not None) is sees_future


def test_no_causal_evaluation_without_a_trained_causal_decision():
    """MoD with mod.sampling 'none' trains no causal decision: a 'causal' loss would measure an untrained rule."""
    module = LanguageModelModule(model=dict(MOD, variant="mod", mod={"sampling": "none"}))
    assert module.model.routing_sees_future and not module.model.has_causal_routing
    assert not module.causal_eval and module.val_loss_causal is None
