"""``python -m experiments.two_phase``: argument plumbing, bad input, and the real two-run command."""
from __future__ import annotations

import json
import pathlib

import pytest
import torch

from architectures.config import ConfigError
from experiments import two_phase
from tests.conftest import TINY_RUN


def fake_run(calls, tmp_path):
    """Stand-in for experiments.run.main: records argv, makes the run folder and a last.ckpt."""

    def main(argv):
        calls.append(list(argv))
        get = lambda flag: argv[len(argv) - 1 - argv[::-1].index(flag) + 1]  # noqa: E731  (last one wins)
        folder = pathlib.Path(get("--log_dir")) / f"{get('--variant')}-{get('--size')}" / get("--version")
        (folder / "checkpoints").mkdir(parents=True)
        (folder / "checkpoints" / "last.ckpt").write_bytes(b"")
        return folder

    return main


def test_phases_get_their_arguments_and_phase2_starts_from_phase1_last_checkpoint(tmp_path, monkeypatch, capsys):
    import experiments.run

    calls = []
    monkeypatch.setattr(experiments.run, "main", fake_run(calls, tmp_path))
    (tmp_path / "mom_i-tiny" / "version_3").mkdir(parents=True)  # an older phase-2 run: both phases skip past it
    result = two_phase.main(["--variant", "mom_i", "--phase1_steps", "30", "--phase2_steps", "40", "--log_dir",
                             str(tmp_path), "--model.d_model", "32", "--phase2.optim.lr", "3e-4",
                             "--phase1.data.batch_size=8", "--trainer.enable_progress_bar", "false"])
    phase1, phase2 = calls
    assert phase1[:2] == ["--variant", "vanilla"] and phase2[:2] == ["--variant", "mom_i"]
    for argv in calls:
        assert argv[argv.index("--version") + 1] == "version_4"
        assert argv[argv.index("--log_dir") + 1] == str(tmp_path)
        assert argv[argv.index("--trainer.enable_progress_bar") + 1] == "false"
        assert "--model.d_model" in argv and argv[argv.index("--model.d_model") + 1] == "32"
    assert phase1[phase1.index("--max_steps") + 1] == "30"
    assert "--val_every" not in phase1  # issue 12 §3.7: no gcd(phase1_steps, 100) rule (1 for prime step counts)
    assert "--data.batch_size=8" in phase1 and "--data.batch_size=8" not in phase2
    assert phase2[phase2.index("--optim.lr") + 1] == "3e-4" and "--optim.lr" not in phase1
    assert phase2[phase2.index("--max_steps") + 1] == "40" and phase2[phase2.index("--optim.warmup_steps") + 1] == "4"
    checkpoint = tmp_path / "vanilla-tiny" / "version_4" / "checkpoints" / "last.ckpt"
    assert phase2[phase2.index("--init_from") + 1] == str(checkpoint)
    assert result == tmp_path / "mom_i-tiny" / "version_4"
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(result)
    record = json.loads((result / "two_phase.json").read_text())
    assert record["phase1_checkpoint"] == str(checkpoint) and record["phase2"] == str(result)


def test_a_sigusr1_between_the_phases_is_noted_for_phase_2_never_left_to_its_default(tmp_path, monkeypatch):
    import os
    import signal

    import experiments.run
    from callbacks import preemption

    calls, handlers, noted = [], [], []
    make_run = fake_run(calls, tmp_path)

    def phase(argv):
        handlers.append(signal.getsignal(signal.SIGUSR1))
        if len(calls) == 1:  # phase 2 starts: what its PreemptionCheckpoint would act on
            noted.append(preemption._take_noted_usr1())
        folder = make_run(argv)
        if len(calls) == 1 and handlers[0] is preemption._note_usr1:  # SLURM's warning as phase 1 ends
            os.kill(os.getpid(), signal.SIGUSR1)
        return folder

    monkeypatch.setattr(experiments.run, "main", phase)
    before = signal.getsignal(signal.SIGUSR1)
    two_phase.main(["--variant", "mom_i", "--phase1_steps", "3", "--phase2_steps", "3", "--log_dir", str(tmp_path)])
    assert handlers == [preemption._note_usr1] * 2 and noted == [True]
    assert signal.getsignal(signal.SIGUSR1) == before


def test_a_sigusr1_in_phase_1s_final_validation_is_handed_to_phase_2_as_one_between_the_phases(tmp_path):
    """What a run's callback noted but did not act on (a SIGUSR1 in its final validation) goes back to the note that
    two_phase holds; outside such a note nothing is kept."""
    import signal

    from callbacks import preemption

    def final_validation_with_sigusr1():
        callback = preemption.PreemptionCheckpoint(tmp_path)
        callback._request(signal.SIGUSR1, None)  # what its handler does during the final validation
        callback.teardown(None, None, "validate")
        return callback.noted

    with preemption.time_limit_warning_noted():
        assert final_validation_with_sigusr1() == signal.SIGUSR1
        assert preemption._take_noted_usr1()  # phase 2's callback acts on it
    assert final_validation_with_sigusr1() == signal.SIGUSR1 and preemption._usr1_noted is None


@pytest.mark.parametrize("argv,match", [
    (["--variant", "vanilla"], "model.variant: 'vanilla' cannot start from a vanilla checkpoint; use one of .*mom_e"),
    (["--variant", "mom_z"], "model.variant: unknown variant 'mom_z'"),
    (["--phase1_steps", "0"], "phase1_steps: must be a positive integer"),
])
def test_bad_input_fails_before_any_training(argv, match, tmp_path, monkeypatch):
    import experiments.run

    calls = []
    monkeypatch.setattr(experiments.run, "main", fake_run(calls, tmp_path))
    with pytest.raises(ConfigError, match=match):
        two_phase.main([*argv, "--log_dir", str(tmp_path)])
    assert calls == []


@pytest.mark.slow
def test_two_phase_command_trains_vanilla_then_mom_from_it(tmp_path):
    result = two_phase.main(["--variant", "mom_e", "--phase1_steps", "4", "--phase2_steps", "2", "--log_dir",
                             str(tmp_path), *TINY_RUN, "--model.n_layer", "4", "--val_every", "3"])
    phase1 = tmp_path / "vanilla-tiny" / "version_0"
    assert result == tmp_path / "mom_e-tiny" / "version_0"
    for folder, variant, steps in ((phase1, "vanilla", 4), (result, "mom_e", 2)):
        summary = json.loads((folder / "summary.json").read_text())
        assert summary["variant"] == variant and summary["steps"] == steps
        assert any(p.name.startswith("events.out.tfevents") for p in folder.iterdir())  # TensorBoard
    first = torch.load(phase1 / "checkpoints" / "last.ckpt", weights_only=False)
    second = torch.load(result / "checkpoints" / "last.ckpt", weights_only=False)
    assert first["global_step"] == 4  # val_every 3 does not divide 4: last.ckpt is still the final model
    # tiny chunked layout: vanilla layers 0-2 became the pool, layer 3 the anchor; two AdamW steps
    # (lr 1e-3) move a weight by ~2e-3 at most, while an unrelated init differs by ~0.02
    a, b = first["state_dict"], second["state_dict"]
    for j in range(3):
        drift = (b[f"model.chunks.0.attn_modules.{j}.attn.c_attn.weight"] - a[f"model.blocks.{j}.attn.c_attn.weight"])
        assert drift.abs().max() < 3e-3
        drift = (b[f"model.chunks.0.ffn_modules.{j}.mlp.c_fc.weight"] - a[f"model.blocks.{j}.mlp.c_fc.weight"])
        assert drift.abs().max() < 3e-3
    assert (b["model.chunks.0.anchor.ln_1.weight"] - a["model.blocks.3.ln_1.weight"]).abs().max() < 3e-3


def test_an_option_of_the_routed_variant_given_to_both_phases_is_dropped_from_vanilla_with_a_note(
        tmp_path, monkeypatch, capsys):
    """results.md's command passes ``--model.mom.router_hidden 64`` to both phases; ``experiments.run`` refuses
    it for vanilla (an option of a group it does not read), so phase 1 drops it and says so."""
    import experiments.run

    calls = []
    monkeypatch.setattr(experiments.run, "main", fake_run(calls, tmp_path))
    two_phase.main(["--variant", "mom", "--phase1_steps", "3", "--phase2_steps", "3", "--log_dir", str(tmp_path),
                    "--model.mom.router_hidden", "64", "--model.d_model", "32"])
    phase1, phase2 = calls
    assert "--model.mom.router_hidden" not in phase1 and phase1[phase1.index("--model.d_model") + 1] == "32"
    assert phase2[phase2.index("--model.mom.router_hidden") + 1] == "64"
    assert "phase 1 (vanilla) does not use --model.mom.router_hidden" in capsys.readouterr().err


@pytest.mark.slow
def test_the_same_command_resumes_a_two_phase_run_that_a_kill_cut_off(tmp_path, monkeypatch):
    """Killed at step 5 of phase 2 (validation every 2): the same command with the same --version keeps phase 1 (not
    trained again), resumes phase 2 from its step-4 checkpoint, and ends where the uninterrupted command ends."""
    import experiments.run as run
    from tests.conftest import crash_at_step

    for key in ("SLURM_JOB_ID", "SLURM_NTASKS", "DYNCOMP_RUN_VERSION"):
        monkeypatch.delenv(key, raising=False)
    common = ["--variant", "mom_e", "--phase1_steps", "4", "--phase2_steps", "6", *TINY_RUN, "--model.n_layer", "4",
              "--val_every", "2"]
    straight = two_phase.main([*common, "--log_dir", str(tmp_path / "straight")])
    argv = [*common, "--log_dir", str(tmp_path / "killed"), "--version", "job7"]
    monkeypatch.setattr(run, "extra_run_callbacks", lambda cfg: [crash_at_step(5)])
    with pytest.raises(RuntimeError, match="killed"):
        two_phase.main(argv)
    monkeypatch.setattr(run, "extra_run_callbacks", lambda cfg: [])
    phase1 = tmp_path / "killed" / "vanilla-tiny" / "job7"
    phase1_mtime = (phase1 / "summary.json").stat().st_mtime_ns
    resumed = two_phase.main(argv)
    assert resumed == tmp_path / "killed" / "mom_e-tiny" / "job7"
    assert (phase1 / "summary.json").stat().st_mtime_ns == phase1_mtime  # phase 1 kept, not trained again
    summary = json.loads((resumed / "summary.json").read_text())
    expected = json.loads((straight / "summary.json").read_text())
    assert summary["steps"] == 6 and summary["train_started_at_steps"] == [0, 4]
    assert summary["train_loss_curve"] == expected["train_loss_curve"]
    assert summary["val_history"] == expected["val_history"]
    again = two_phase.main(argv)  # both phases finished: nothing trains
    assert again == resumed and json.loads((resumed / "summary.json").read_text()) == summary
