"""Issue 14: resume and initialisation check what they load; user mistakes are one line, exit 2."""
from __future__ import annotations

import json

import pytest
import torch

from architectures.config import ConfigError
from experiments.run import main
from tests.conftest import TINY_RUN


def _text_run(tmp_path, corpus, *extra):
    return ["--data", "text", "--data.path", str(corpus), "--tokenizer", "bytes", "--log_dir", str(tmp_path / "runs"),
            *TINY_RUN, *extra]


@pytest.fixture
def two_corpora(tmp_path):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("It was the best of times, it was the worst of times. " * 120)
    b.write_text("Call me Ishmael. Some years ago, never mind how long precisely. " * 120)
    return a, b


# ---------------------------------------------------------------------------- resume checks what it loads
def test_ckpt_path_last_resumes_only_the_run_trained_on_the_same_data(tmp_path, two_corpora, capsys):
    a, b = two_corpora
    first = main(_text_run(tmp_path, a, "--max_steps", "2", "--val_every", "2"))
    second = main(_text_run(tmp_path, b, "--max_steps", "2", "--val_every", "2"))
    assert (first.name, second.name) == ("version_0", "version_1")
    config_b = (second / "config.yaml").read_bytes()
    ckpt_b = (second / "checkpoints" / "last.ckpt").read_bytes()
    capsys.readouterr()
    resumed = main(_text_run(tmp_path, a, "--max_steps", "4", "--val_every", "2", "--ckpt_path", "last"))
    assert resumed == first  # the run on a.txt, not the newer run on b.txt
    assert "skipped newer" in capsys.readouterr().err
    assert json.loads((first / "summary.json").read_text())["steps"] == 4
    # version_1 is untouched
    assert (second / "config.yaml").read_bytes() == config_b
    assert (second / "checkpoints" / "last.ckpt").read_bytes() == ckpt_b


def test_ckpt_path_last_without_a_matching_run_names_the_fields_and_folder(tmp_path, two_corpora):
    a, b = two_corpora
    run = main(_text_run(tmp_path, a, "--max_steps", "2", "--val_every", "2"))
    before = sorted(p.name for p in run.parent.iterdir())
    with pytest.raises(ConfigError, match=r"no run under .* matches.*version_0.*different data \(text:"):
        main(_text_run(tmp_path, b, "--max_steps", "4", "--ckpt_path", "last"))
    with pytest.raises(ConfigError, match=r"model\.d_model \(32 in the checkpoint, 64 now\)"):
        main(_text_run(tmp_path, a, "--max_steps", "4", "--ckpt_path", "last", "--model.d_model", "64"))
    assert sorted(p.name for p in run.parent.iterdir()) == before  # nothing new written


@pytest.mark.parametrize("change,pattern", [
    (["--model.block_size", "32"], r"model\.block_size \(64 in the checkpoint, 32 now\)"),
    (["--model.n_layer", "3"], r"model\.n_layer \(2 in the checkpoint, 3 now\)"),
    (["--variant", "mod"], r"model\.variant \('vanilla' in the checkpoint, 'mod' now\)"),
])
def test_explicit_ckpt_path_of_another_model_says_which_fields_differ(tmp_path, two_corpora, change, pattern):
    a, _ = two_corpora
    run = main(_text_run(tmp_path, a, "--max_steps", "2", "--val_every", "2"))
    with pytest.raises(ConfigError, match=pattern):
        main(_text_run(tmp_path, a, "--max_steps", "4", *change, "--ckpt_path", str(run / "checkpoints" / "last.ckpt")))


def test_an_explicit_version_never_writes_into_another_runs_folder(tmp_path, two_corpora):
    a, _ = two_corpora
    run = main(_text_run(tmp_path, a, "--max_steps", "2", "--val_every", "2"))
    config = (run / "config.yaml").read_bytes()
    with pytest.raises(ConfigError, match="already holds another run's checkpoints"):
        main(_text_run(tmp_path, a, "--max_steps", "2", "--version", "version_0"))
    assert (run / "config.yaml").read_bytes() == config


def test_checkpoints_record_data_and_tokenizer_fingerprints(tmp_path, two_corpora):
    a, _ = two_corpora
    run = main(_text_run(tmp_path, a, "--max_steps", "2", "--val_every", "2"))
    blob = torch.load(run / "checkpoints" / "last.ckpt", weights_only=False)
    saved = blob["LMDataModule"]["fingerprints"]
    assert saved["data"].startswith("text:text-") and saved["tokenizer"].startswith("bytes:")


# ---------------------------------------------------------------------------- --init_from reports and refuses
def test_init_from_prints_the_table_and_refuses_a_small_share_unless_not_strict(tmp_path, two_corpora, capsys):
    a, _ = two_corpora
    vanilla = main(_text_run(tmp_path, a, "--max_steps", "2", "--val_every", "2"))
    ckpt = str(vanilla / "checkpoints" / "last.ckpt")
    capsys.readouterr()
    moe = ["--variant", "moe", "--model.moe.num_experts", "8", "--init_from", ckpt]
    with pytest.raises(ConfigError, match=r"only \d+\.\d% of the moe model's parameters .*--init_strict false"):
        main(_text_run(tmp_path, a, "--max_steps", "1", *moe))
    table = capsys.readouterr().err
    for row in ("loaded (same name)", "mapped (renamed)", "newly initialised", "unused in source"):
        assert row in table
    assert "experts" in table  # the new tensors are named
    assert not (tmp_path / "runs" / "moe-tiny").exists()
    run = main(_text_run(tmp_path, a, "--max_steps", "1", "--val_every", "1", *moe, "--init_strict", "false"))
    assert (run / "summary.json").is_file()


def test_init_from_vanilla_into_vanilla_loads_everything(tmp_path, two_corpora, capsys):
    from experiments.weights import load_initial_weights
    from lightning_modules.lm import LanguageModelModule

    a, _ = two_corpora
    vanilla = main(_text_run(tmp_path, a, "--max_steps", "2", "--val_every", "2"))
    blob = torch.load(vanilla / "checkpoints" / "last.ckpt", weights_only=False)
    module = LanguageModelModule(model=blob["hyper_parameters"]["model"])
    report = load_initial_weights(module.model, str(vanilla / "checkpoints" / "last.ckpt"), strict=True)
    assert report.initialised_share == 1.0 and not report.new and not report.unused and not report.mapped
    torch.testing.assert_close(module.model.wte.weight, blob["state_dict"]["model.wte.weight"])


def test_init_from_a_checkpoint_trained_with_another_tokenizer_is_refused(tmp_path, two_corpora):
    from experiments.weights import load_initial_weights
    from lightning_modules.lm import LanguageModelModule

    a, _ = two_corpora
    vanilla = main(_text_run(tmp_path, a, "--max_steps", "2", "--val_every", "2"))
    ckpt = vanilla / "checkpoints" / "last.ckpt"
    blob = torch.load(ckpt, weights_only=False)
    module = LanguageModelModule(model=blob["hyper_parameters"]["model"])
    with pytest.raises(ConfigError, match="was trained with tokenizer bytes:.*this run uses bpe:0123"):
        load_initial_weights(module.model, str(ckpt), strict=True, tokenizer="bpe:0123456789abcdef")
    load_initial_weights(module.model, str(ckpt), strict=False, tokenizer="bpe:0123456789abcdef")  # explicit override
