"""A resumed run continues the run it resumes, for every variant: after a crash and a resume from the last
validation's checkpoint, every training loss is the uninterrupted run's, bit for bit. Most variants draw no
random numbers while training; the ones that do (found here, from their training step's use of the global torch
generator, so a new one is covered without being listed) failed this before the checkpoint held each rank's
generators: ``experiments.run`` seeds every start afresh, and the resumed run replayed the stream from step 0."""
from __future__ import annotations

import json

import pytest
import torch

from architectures import build_model
from architectures.registry import VARIANTS, variant_names
from tests.conftest import TINY_RUN, crash_at_step, tiny_layers

# settings under which a variant that draws nothing by default does draw
RANDOM_SETTINGS = {"vanilla": ["--model.dropout", "0.1"], "mot": ["--model.mot.random_activation", "0.5"]}


def draws_random_numbers(name: str, **options) -> bool:
    """Whether one training step of ``name`` (forward and backward) moves the global torch generator."""
    torch.manual_seed(0)
    model = build_model(VARIANTS[name].test_config(name, n_layer=tiny_layers(name, 2), **options))
    idx = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    model.train()
    before = torch.get_rng_state()
    out = model(idx)
    (out.logits.float().mean() + out.aux_loss).backward()
    return not torch.equal(before, torch.get_rng_state())


def random_cases():
    cases = [(name, []) for name in variant_names() if draws_random_numbers(name)]
    cases += [(name, extra) for name, extra in RANDOM_SETTINGS.items()]
    return cases


CASES = random_cases()


def test_the_cases_hold_every_variant_that_draws_and_the_settings_that_make_others_draw():
    names = {name for name, extra in CASES if not extra}
    assert "early_exit" in names  # its layer dropout: the detection finds it (the list cannot go empty unnoticed)
    assert draws_random_numbers("vanilla", dropout=0.1) and draws_random_numbers("mot", mot={"random_activation": 0.5})
    assert not draws_random_numbers("vanilla")


@pytest.mark.parametrize("name,extra", CASES, ids=[n + ("+" + e[0].split(".")[-1] if e else "") for n, e in CASES])
def test_a_run_resumed_after_a_crash_trains_what_the_uninterrupted_run_trained(name, extra, tmp_path, monkeypatch,
                                                                               one_thread):
    import experiments.run as run

    monkeypatch.delenv("DYNCOMP_RUN_VERSION", raising=False)
    argv = ["--variant", name, "--model.n_layer", str(tiny_layers(name, 2)), "--max_steps", "8", "--val_every", "4",
            *TINY_RUN, *extra]
    straight = json.loads((run.main([*argv, "--log_dir", str(tmp_path / "a")]) / "summary.json").read_text())
    monkeypatch.setattr(run, "extra_run_callbacks", lambda cfg: [crash_at_step(6)])
    with pytest.raises(RuntimeError, match="killed"):
        run.main([*argv, "--log_dir", str(tmp_path / "b")])
    monkeypatch.setattr(run, "extra_run_callbacks", lambda cfg: [])
    resumed = json.loads((run.main([*argv, "--log_dir", str(tmp_path / "b"), "--ckpt_path", "last"])
                          / "summary.json").read_text())
    assert resumed["train_started_at_steps"] == [0, 4]
    assert resumed["train_loss_curve"] == straight["train_loss_curve"]
    assert resumed["val_history"] == straight["val_history"]
