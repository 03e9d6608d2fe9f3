"""The training CLI end to end: smoke run, resume equivalence, bad input, NaN guard, DDP."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import yaml

from architectures.config import ConfigError
from datamodules.corpora import DataError
from experiments.run import expand_aliases, main
from tests.conftest import REPO, TINY_RUN, recorder_state


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def test_aliases_expand_to_canonical_options():
    assert expand_aliases(["--variant", "mod", "--size=tiny", "--data", "x", "--max_steps", "3"]) == [
        "--model.variant", "mod", "--model.size=tiny", "--data.name", "x", "--trainer.max_steps", "3"]


def test_cli_smoke_run_writes_summary_config_checkpoints_and_events(tmp_path, capsys):
    run_dir = main(["--max_steps", "6", "--val_every", "3", "--log_dir", str(tmp_path), *TINY_RUN])
    assert run_dir == tmp_path / "vanilla-tiny" / "version_0"
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(run_dir)
    summary = _summary(run_dir)
    assert summary["variant"] == "vanilla" and summary["size"] == "tiny" and summary["steps"] == 6
    assert summary["tokens_seen"] == 6 * 4 * 64
    assert 0 < summary["final_val_loss"] < 9 and 0 < summary["final_train_loss"] < 9
    assert summary["flops_per_token"]["ratio_to_vanilla"] == 1.0
    assert summary["flops_per_token"]["training"] == 3 * summary["flops_per_token"]["forward"]
    assert summary["median_step_time_s"] > 0 and len(summary["train_loss_curve"]) == 6
    assert summary["seconds_to_first_step"] > 0  # of this (pytest's) process: since it started
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["model"]["d_model"] == 32 and config["model"]["vocab_size"] == 4096  # resolved values
    assert (run_dir / "checkpoints" / "last.ckpt").is_file()
    assert any(p.name.startswith("best-") for p in (run_dir / "checkpoints").iterdir())
    assert any(p.name.startswith("events.out.tfevents") for p in run_dir.iterdir())
    check_provenance(summary, run_dir)
    # a second run goes to the next version, never overwriting the first; last.ckpt holds the final
    # step even when it is not a multiple of val_every
    second = main(["--max_steps", "2", "--val_every", "3", "--log_dir", str(tmp_path), *TINY_RUN])
    assert second.name == "version_1"
    assert torch.load(second / "checkpoints" / "last.ckpt", weights_only=False)["global_step"] == 2



def _fail_at_step(step):
    """A training_step that raises at global step ``step`` (0: before the first optimiser step)."""
    from lightning_modules.lm import LanguageModelModule

    real = LanguageModelModule.__dict__["training_step"]
    real = getattr(real, "unpatched", real)

    def training_step(self, *args, **kwargs):
        if self.global_step == step:
            raise RuntimeError(f"failed at step {step}")
        return real(self, *args, **kwargs)
    training_step.unpatched = real
    return training_step


def test_a_run_that_fails_before_its_first_step_leaves_no_run_folder(tmp_path, monkeypatch):
    from lightning_modules.lm import LanguageModelModule

    args = ["--max_steps", "3", "--val_every", "3", "--log_dir", str(tmp_path), *TINY_RUN]
    monkeypatch.setattr(LanguageModelModule, "training_step", _fail_at_step(0))
    with pytest.raises(RuntimeError, match="failed at step 0"):
        main(args)
    assert list((tmp_path / "vanilla-tiny").iterdir()) == []  # config, provenance, hparams, events: all gone
    # a run that fails after a step keeps its folder (its events hold the steps it logged)
    monkeypatch.setattr(LanguageModelModule, "training_step", _fail_at_step(1))
    with pytest.raises(RuntimeError, match="failed at step 1"):
        main(args)
    kept = tmp_path / "vanilla-tiny" / "version_0"
    assert (kept / "config.yaml").is_file() and any(p.name.startswith("events.out") for p in kept.iterdir())
    # a file the user put into a folder is never removed with it
    monkeypatch.setattr(LanguageModelModule, "training_step", _fail_at_step(0))
    (tmp_path / "vanilla-tiny" / "version_1").mkdir()
    (tmp_path / "vanilla-tiny" / "version_1" / "notes.txt").write_text("mine")
    with pytest.raises(RuntimeError):
        main(args)  # claims version_2 (version_1 exists)
    assert sorted(p.name for p in (tmp_path / "vanilla-tiny").iterdir()) == ["version_0", "version_1"]
    assert (tmp_path / "vanilla-tiny" / "version_1" / "notes.txt").read_text() == "mine"


def test_release_unstarted_keeps_a_folder_that_holds_anything_else(tmp_path):
    from lightning_modules.storage import release_unstarted

    folder = tmp_path / "version_0"
    (folder / "checkpoints").mkdir(parents=True)
    for name in ("config.yaml", "provenance.json", "hparams.yaml", "events.out.tfevents.1.host.1.0"):
        (folder / name).write_text("x")
    (folder / "checkpoints" / "last.ckpt").write_text("x")
    release_unstarted(folder)
    assert sorted(p.name for p in folder.rglob("*")) == ["checkpoints", "last.ckpt"]
    (folder / "checkpoints" / "last.ckpt").unlink()
    release_unstarted(folder)
    assert not folder.exists()
    release_unstarted(folder)  # already gone: nothing to do

def check_provenance(summary, run_dir):
    """The run folder names the code it ran (commit, dirty tree) and the library versions."""
    import lightning
    import numpy
    import platform

    git = lambda *a: subprocess.run(["git", "-C", str(REPO), *a], capture_output=True, check=True).stdout  # noqa: E731
    record = summary["provenance"]
    assert record["commit"] == git("rev-parse", "HEAD").decode().strip() and record["commits"] == [record["commit"]]
    assert record["dirty"] == bool(git("diff", "HEAD").strip())
    assert record["libraries"]["torch"] == torch.__version__
    assert record["libraries"]["lightning"] == lightning.__version__ and record["libraries"]["numpy"] == numpy.__version__
    assert record["python"] == platform.python_version() and record["torch_threads"] == torch.get_num_threads()
    (started,) = json.loads((run_dir / "provenance.json").read_text())  # one process trained it
    assert started["commit"] == record["commit"] and started["libraries"] == record["libraries"]


def test_resume_continues_the_exact_loss_trajectory(tmp_path):
    common = ["--val_every", "4", *TINY_RUN, "--optim.warmup_steps", "2"]
    straight = _summary(main(["--max_steps", "8", "--log_dir", str(tmp_path / "a"), *common]))
    # an interrupted run: 4 of the 8 steps of the same schedule
    first = main(["--max_steps", "4", "--optim.schedule_steps", "8", "--log_dir", str(tmp_path / "b"), *common])
    first_summary = _summary(first)
    assert first_summary["steps"] == 4
    resumed = _summary(main(["--max_steps", "8", "--log_dir", str(tmp_path / "b"), *common,
                             "--ckpt_path", str(first / "checkpoints" / "last.ckpt")]))
    curve_a = dict((s, l) for s, l in straight["train_loss_curve"])
    curve_b = dict((s, l) for s, l in first_summary["train_loss_curve"])
    curve_b.update((s, l) for s, l in resumed["train_loss_curve"])
    assert sorted(curve_b) == sorted(curve_a) == list(range(1, 9))
    for step in range(1, 9):
        assert curve_b[step] == pytest.approx(curve_a[step], abs=1e-6), step
    assert resumed["tokens_seen"] == straight["tokens_seen"]
    assert resumed["run_dir"] == str(first)  # resuming continues in the same folder
    again = _summary(main(["--max_steps", "10", "--log_dir", str(tmp_path / "b"), *common, "--ckpt_path", "last"]))
    assert again["run_dir"] == str(first) and again["steps"] == 10  # 'last' resolves to that same run
    assert len(json.loads((first / "provenance.json").read_text())) == 3  # the first run and each resume


def test_the_recorders_clock_adds_each_earlier_process_once(monkeypatch):
    """Every checkpoint carries the run's clock at its save (earlier processes + this one's age), never a sum of
    saves; each resume adds its own process to the loaded clock; a checkpoint without the clock keeps it unknown."""
    import callbacks.run_summary as run_summary

    age = {"now": 5.0}
    monkeypatch.setattr(run_summary, "run_age_s", lambda: age["now"])
    first = run_summary.StepRecorder()
    assert first.state_dict()["run_seconds"] == first.state_dict()["run_seconds"] == 5.0  # saved twice, once counted
    second = run_summary.StepRecorder()
    second.load_state_dict(first.state_dict())
    age["now"] = 2.0
    assert second.run_seconds() == (7.0, True) and second.state_dict()["run_seconds"] == 7.0
    third = run_summary.StepRecorder()
    third.load_state_dict(second.state_dict())
    age["now"] = 1.0
    assert third.run_seconds() == (8.0, True)  # 5 + 2 + 1: each process once
    older = run_summary.StepRecorder()
    older.load_state_dict({"run_seconds": None})
    assert older.run_seconds() == (1.0, False) and older.state_dict()["run_seconds"] is None


def test_a_resumed_runs_wall_time_adds_its_earlier_process_to_the_checkpoint(tmp_path):
    """``run_seconds`` of a resumed run: the earlier process's clock at the checkpoint it resumed from, plus its own
    process's; from a checkpoint without that clock, its own only, marked incomplete (a lower bound)."""
    import time

    common = ["--val_every", "4", *TINY_RUN, "--optim.schedule_steps", "8"]
    first = main(["--max_steps", "4", "--log_dir", str(tmp_path / "a"), *common])
    ckpt_path = first / "checkpoints" / "last.ckpt"
    checkpoint = torch.load(ckpt_path, weights_only=False)
    before = recorder_state(checkpoint)["run_seconds"]
    assert 0 < before <= _summary(first)["run_seconds"]
    started = time.perf_counter()
    resumed = _summary(main(["--max_steps", "8", "--log_dir", str(tmp_path / "a"), *common, "--ckpt_path", "last"]))
    lived = time.perf_counter() - started  # this second run of the process starts its clock at its main()
    assert resumed["train_started_at_steps"] == [0, 4] and resumed["run_seconds_complete"] is True
    # seconds_to_first_step is the resumed process's own (not carried): the sum holds both processes
    assert before + resumed["seconds_to_first_step"] <= resumed["run_seconds"] <= before + lived
    recorder_state(checkpoint).pop("run_seconds")  # a checkpoint written before the clock was carried
    old = tmp_path / "old.ckpt"
    torch.save(checkpoint, old)
    started = time.perf_counter()
    lower = _summary(main(["--max_steps", "8", "--log_dir", str(tmp_path / "b"), *common, "--ckpt_path", str(old)]))
    assert lower["run_seconds_complete"] is False and 0 < lower["run_seconds"] <= time.perf_counter() - started


@pytest.mark.parametrize(
    "argv,error,pattern",
    [
        (["--variant", "nope"], ConfigError, "valid variants: .*vanilla"),
        (["--size", "huge"], ConfigError, "valid sizes: tiny, small, medium, large"),
        (["--data", "nope"], DataError, "valid datasets: .*embedded"),
        (["--model.d_model", "33"], ConfigError, "model.d_model"),
        (["--model.n_layer", "-2"], ConfigError, "model.n_layer"),
        (["--max_steps", "0"], ConfigError, "trainer.max_steps"),
        (["--optim.lr", "-1"], ConfigError, "optim.lr"),
        (["--data.batch_size", "0"], DataError, "data.batch_size"),
    ],
)
def test_bad_input_fails_before_any_work(tmp_path, argv, error, pattern):
    with pytest.raises(error, match=pattern):
        main([*argv, "--log_dir", str(tmp_path)])
    assert not any(tmp_path.iterdir())


def test_command_line_error_exits_2_with_message():
    proc = subprocess.run([sys.executable, "-m", "experiments.run", "--variant", "nope"], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "valid variants" in proc.stderr


def test_the_first_screen_of_a_default_run_holds_no_noise(tmp_path):
    """Issue 30: the default run warned that vanilla has no routing sites, showed ``Epoch 0/-2`` and ``v_num: on_0``
    in its progress bar, and Lightning's litlogger tip (and its pytree deprecation notice). The default command with
    a smaller model; the measurement intervals at max_steps (the default run's 300 steps exceed the defaults)."""
    bar = [a for a in TINY_RUN if a not in ("--trainer.enable_progress_bar", "false")]
    intervals = [arg for name in ("routing_every", "routing_images_every", "flops_every", "contribution_every",
                                  "depth_every")
                 for arg in (f"--callbacks.{name}", "2")]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("DYNCOMP_RUN_VERSION", None)
    proc = subprocess.run([sys.executable, "-m", "experiments.run", "--max_steps", "2", "--val_every", "2",
                           "--log_dir", str(tmp_path), *bar, *intervals], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    screen = proc.stdout + proc.stderr
    assert "Epoch 0" in screen and "train/loss" in screen  # the bar is there
    for noise in ("Warning", "warning", "v_num", "/-2", "litlogger", "Tip:", "LeafSpec", "no routing sites"):
        assert noise not in screen, (noise, screen[-3000:])


def test_print_config_shows_every_group_resolved():
    """Issue 30: tiny + bpe printed ``d_model: null``, ``n_layer: null`` and ``vocab_size: 50257`` as if final."""
    proc = subprocess.run([sys.executable, "-m", "experiments.run", "--variant", "vanilla", "--tokenizer", "bpe",
                           "--print_config"], cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    config = yaml.safe_load(proc.stdout)
    assert config["model"]["variant"] == "vanilla"
    assert {"model", "data", "optim", "trainer"} <= set(config)
    assert {k: config["model"][k] for k in ("d_model", "n_layer", "n_head", "block_size")} == \
        {"d_model": 128, "n_layer": 4, "n_head": 4, "block_size": 128}  # the tiny size, resolved
    assert config["val_blocks"] == 320 and config["version"] is None
    (vocab,) = [line for line in proc.stdout.splitlines() if line.startswith("  vocab_size:")]
    assert "placeholder: the run replaces it by the vocabulary size of the tokenizer (bpe)" in vocab


def test_nonfinite_loss_stops_with_step_and_dump(tmp_path, monkeypatch):
    from lightning_modules.lm import LanguageModelModule, NonFiniteLossError

    original = LanguageModelModule.lm_loss

    def poisoned(self, logits, targets, *weights):
        loss = original(self, logits, targets, *weights)
        return loss * float("nan") if self.global_step >= 2 else loss

    monkeypatch.setattr(LanguageModelModule, "lm_loss", poisoned)
    with pytest.raises(NonFiniteLossError, match="step 2"):
        main(["--max_steps", "5", "--val_every", "5", "--log_dir", str(tmp_path), *TINY_RUN])
    dumps = list(tmp_path.rglob("nonfinite-step2-rank0.pt"))
    assert len(dumps) == 1
    blob = torch.load(dumps[0], weights_only=False)
    assert blob["step"] == 2 and blob["batch"].shape == (4, 65) and "wte.weight" in blob["model"]


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["mom_e"])  # modules can go unused in a step; vanilla under DDP: test_cluster
def test_two_process_ddp_run_on_cpu(tmp_path, variant):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("DYNCOMP_RUN_VERSION", None)
    proc = subprocess.run(
        [sys.executable, "-m", "experiments.run", "--variant", variant, "--max_steps", "4", "--val_every", "2",
         "--log_dir", str(tmp_path),
         "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp", *TINY_RUN,
         "--model.n_layer", "4"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / f"{variant}-tiny" / "version_0"
    assert proc.stdout.strip().splitlines()[-1] == str(run_dir)
    summary = _summary(run_dir)
    assert summary["world_size"] == 2 and summary["steps"] == 4
    assert summary["tokens_seen"] == 4 * 2 * 4 * 64  # both ranks' tokens
    assert [p.name for p in tmp_path.joinpath(f"{variant}-tiny").iterdir()] == ["version_0"]  # one folder for both ranks


@pytest.mark.slow
def test_default_command_learns_well_below_unigram_entropy(tmp_path):
    """The README's main job, exactly as shipped (tiny vanilla, embedded corpus, 300 steps)."""
    proc = subprocess.run([sys.executable, "-m", "experiments.run", "--log_dir", str(tmp_path),
                           "--trainer.enable_progress_bar", "false"], cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = _summary(tmp_path / "vanilla-tiny" / "version_0")
    assert summary["steps"] == 300 and summary["size"] == "tiny"
    assert summary["final_val_loss"] < summary["unigram_entropy_nats"] - 0.5, summary


def test_local_text_file_as_data_with_a_plain_path(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("It was the best of times, it was the worst of times. " * 300)
    run_dir = main(["--data", "text", "--data.path", str(corpus), "--tokenizer", "bytes", "--max_steps", "2",
                    "--val_every", "2", "--log_dir", str(tmp_path / "runs"), *TINY_RUN])
    summary = _summary(run_dir)
    assert summary["steps"] == 2 and summary["final_val_loss"] < 6.0  # bytes: ln(257) = 5.55 at most-ish
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["model"]["vocab_size"] == 257 and config["data"]["path"] == str(corpus)


def test_process_age_counts_from_the_process_start():
    """``seconds_to_first_step``'s clock: a child that sleeps 0.5 s before asking is at least that old and no
    older than the parent saw it live."""
    import subprocess
    import sys
    import time

    probe = "import time; time.sleep(0.5); from lightning_modules.run_clock import process_age_s; print(process_age_s())"
    start = time.monotonic()
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    lived = time.monotonic() - start
    age = float(out.stdout.strip().splitlines()[-1])
    assert 0.5 <= age <= lived + 0.02  # /proc's clock ticks: 10 ms


def test_a_runs_clock_starts_with_its_process_only_for_the_processs_first_run(monkeypatch):
    """Programmes train several runs in one process (``--jobs 1``) or in reused workers: the second run's
    ``seconds_to_first_step`` / ``run_seconds`` must not include the first run's time."""
    from lightning_modules import run_clock

    monkeypatch.setattr(run_clock, "_runs_in_process", 0)
    monkeypatch.setattr(run_clock, "process_age_s", lambda: 100.0)
    run_clock.mark_run_start()
    assert 100.0 <= run_clock.run_age_s() < 101.0  # the first run pays the process's start-up
    run_clock.mark_run_start()
    assert 0.0 <= run_clock.run_age_s() < 1.0  # a later run starts at its own main()


def test_a_second_in_process_run_records_its_own_run_seconds(tmp_path):
    from lightning_modules.run_clock import process_age_s

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("It was the best of times, it was the worst of times. " * 300)
    argv = ["--data", "text", "--data.path", str(corpus), "--tokenizer", "bytes", "--max_steps", "2",
            "--val_every", "2", *TINY_RUN]
    main([*argv, "--log_dir", str(tmp_path / "a")])
    before = process_age_s()
    summary = _summary(main([*argv, "--log_dir", str(tmp_path / "b")]))
    lived = process_age_s() - before  # the second run's whole life; a process-age clock would say ~process_age_s()
    assert 0 < summary["seconds_to_first_step"] <= summary["run_seconds"] <= lived + 0.05
