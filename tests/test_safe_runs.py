"""Issue 14: resume and initialisation check what they load; user mistakes are one line, exit 2."""
from __future__ import annotations

import json

import pytest
import torch

from architectures import ModelConfig, build_model
from architectures.config import ConfigError
from architectures.registry import apply_preset
from experiments.run import main
from model_tools.weights import init_report
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
    with pytest.raises(ConfigError, match=r"no run under .* matches.*version_0.*different data \(text:text-\w+ = "
                                          r"text \S+/a\.txt in the checkpoint, text:text-\w+ = text \S+/b\.txt now\)"):
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


def test_a_resume_that_would_validate_on_other_blocks_is_refused(tmp_path, two_corpora):
    """val_history and the final figures would mix two validation sets; a checkpoint from before val_blocks was
    saved is resumed unchecked."""
    a, _ = two_corpora
    run = main(_text_run(tmp_path, a, "--max_steps", "2", "--val_every", "2"))
    ckpt = run / "checkpoints" / "last.ckpt"
    config = (run / "config.yaml").read_bytes()
    with pytest.raises(ConfigError, match=r"different --val_blocks \(8 in the checkpoint, 4 now\); resume with the "):
        main(_text_run(tmp_path, a, "--max_steps", "4", "--val_blocks", "4", "--ckpt_path", str(ckpt)))
    assert (run / "config.yaml").read_bytes() == config
    blob = torch.load(ckpt, weights_only=False)
    del blob["LMDataModule"]["fingerprints"]["val_blocks"]
    torch.save(blob, ckpt)
    assert main(_text_run(tmp_path, a, "--max_steps", "4", "--val_blocks", "4", "--ckpt_path", str(ckpt))) == run


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
    # cea keeps attention and embeddings by name; its Inner-FFN is new (well under 90% of the non-embedding parameters)
    cea = ["--variant", "cea", "--init_from", ckpt, "--init_min_share", "0.9"]
    with pytest.raises(ConfigError, match=r"only \d+\.\d% of the cea model's parameters .*--init_strict false"):
        main(_text_run(tmp_path, a, "--max_steps", "1", *cea))
    table = capsys.readouterr().err
    for row in ("loaded (same name)", "mapped (renamed)", "newly initialised", "unused in source"):
        assert row in table
    assert "inner" in table  # the new tensors are named
    assert not (tmp_path / "runs" / "cea-tiny").exists()
    run = main(_text_run(tmp_path, a, "--max_steps", "1", "--val_every", "1", *cea, "--init_strict", "false"))
    assert (run / "summary.json").is_file()


def test_init_from_vanilla_into_vanilla_loads_everything(tmp_path, two_corpora, capsys):
    from model_tools.weights import load_initial_weights
    from lightning_modules.lm import LanguageModelModule

    a, _ = two_corpora
    vanilla = main(_text_run(tmp_path, a, "--max_steps", "2", "--val_every", "2"))
    blob = torch.load(vanilla / "checkpoints" / "last.ckpt", weights_only=False)
    module = LanguageModelModule(model=blob["hyper_parameters"]["model"])
    report = load_initial_weights(module.model, str(vanilla / "checkpoints" / "last.ckpt"), strict=True)
    assert report.initialised_share == 1.0 and not report.new and not report.unused and not report.mapped
    torch.testing.assert_close(module.model.wte.weight, blob["state_dict"]["model.wte.weight"])


def test_init_from_a_checkpoint_trained_with_another_tokenizer_is_refused(tmp_path, two_corpora):
    from model_tools.weights import load_initial_weights
    from lightning_modules.lm import LanguageModelModule

    a, _ = two_corpora
    vanilla = main(_text_run(tmp_path, a, "--max_steps", "2", "--val_every", "2"))
    ckpt = vanilla / "checkpoints" / "last.ckpt"
    blob = torch.load(ckpt, weights_only=False)
    module = LanguageModelModule(model=blob["hyper_parameters"]["model"])
    with pytest.raises(ConfigError, match="was trained with tokenizer bytes:.*this run uses bpe:0123"):
        load_initial_weights(module.model, str(ckpt), strict=True, tokenizer="bpe:0123456789abcdef")
    load_initial_weights(module.model, str(ckpt), strict=False, tokenizer="bpe:0123456789abcdef")  # explicit override


# ---------------------------------------------------------------------------- fine-tuning does what it says
FT = ["--model.d_model", "32", "--model.n_layer", "1", "--model.n_head", "2", "--model.block_size", "48",
      "--batch_size", "4", "--trainer.enable_progress_bar", "false", "--tokenizer", "bytes", "--dropout", "0"]


def _sst2(root):
    folder = root / "SST-2"
    folder.mkdir(parents=True)
    rows = [("good great fine", 1), ("bad awful poor", 0)] * 4
    for name in ("train.tsv", "dev.tsv"):
        (folder / name).write_text("sentence\tlabel\n" + "".join(f"{s} {i}\t{y}\n" for i, (s, y) in enumerate(rows)))
    return root


def test_finetune_max_steps_overrides_epochs_and_sizes_the_schedule(tmp_path):
    from experiments import finetune

    glue = _sst2(tmp_path / "glue")  # 8 examples, batch 4: 2 steps per epoch, 3 epochs by default = 6 steps
    run_dir = finetune.main(["--task", "glue/sst2", "--data.path", str(glue), "--max_steps", "10",
                             "--log_dir", str(tmp_path / "runs"), *FT])
    assert json.loads((run_dir / "results.json").read_text())["steps"] == 10
    cfg = finetune.build_parser().parse_args(["--task", "glue/sst2", "--max_steps", "10", "--epochs", "3"])
    assert finetune.total_steps(cfg, 8, 3, 1) == 10  # the LR schedule's length


def test_glue_all_checks_every_tasks_files_before_training_anything(tmp_path):
    from datamodules.corpora import DataError
    from datamodules.glue import GLUE_TASKS
    from experiments import finetune

    root = tmp_path / "glue"
    for task in GLUE_TASKS.values():  # names only: the check runs before any file is read
        (root / task.folder).mkdir(parents=True)
        (root / task.folder / "train.tsv").write_text("")
        for split in task.val_splits:
            (root / task.folder / ("dev.tsv" if split == "validation" else split.replace("validation", "dev") + ".tsv")).write_text("")
    (root / "MNLI" / "dev_mismatched.tsv").unlink()
    (root / "RTE" / "train.tsv").unlink()
    with pytest.raises(DataError, match=r"missing GLUE files for glue/mnli validation_mismatched, glue/rte train "
                                        r"\(nothing was trained\)"):
        finetune.main(["--task", "glue/all", "--data.path", str(root), "--log_dir", str(tmp_path / "runs"), *FT])
    assert not (tmp_path / "runs").exists()


def test_glue_eval_only_reproduces_the_fine_tuned_checkpoints_validation(tmp_path):
    from experiments import finetune

    glue = _sst2(tmp_path / "glue")
    trained = finetune.main(["--task", "glue/sst2", "--data.path", str(glue), "--max_steps", "4", "--save_checkpoint",
                             "true", "--log_dir", str(tmp_path / "runs"), *FT])
    result = json.loads((trained / "results.json").read_text())
    ckpt = next(trained.rglob("*.ckpt"))
    (glue / "SST-2" / "train.tsv").unlink()  # evaluation only: the training file is not needed
    evaluated = finetune.main(["--task", "glue/sst2", "--data.path", str(glue), "--eval_only", "true",
                               "--init_from", str(ckpt), "--log_dir", str(tmp_path / "eval"), *FT])
    again = json.loads((evaluated / "results.json").read_text())
    assert again["steps"] == 0 and again["train_examples"] == 0 and again["eval_only"] is True
    assert again["metrics"] == result["metrics"]


def test_eval_only_needs_a_trained_head_for_glue_and_an_init_from(tmp_path, two_corpora):
    from experiments import finetune

    a, _ = two_corpora
    lm = main(_text_run(tmp_path, a, "--max_steps", "1", "--val_every", "1"))
    glue = _sst2(tmp_path / "glue")
    with pytest.raises(ConfigError, match="eval_only: needs --init_from"):
        finetune.main(["--task", "glue/sst2", "--data.path", str(glue), "--eval_only", "true", *FT])
    with pytest.raises(ConfigError, match="has no trained glue/sst2 classification head"):
        finetune.main(["--task", "glue/sst2", "--data.path", str(glue), "--eval_only", "true", "--init_from",
                       str(lm / "checkpoints" / "last.ckpt"), "--log_dir", str(tmp_path / "eval"), *FT])


def test_xsum_eval_only_from_a_pretraining_checkpoint_reads_no_training_file(tmp_path, two_corpora):
    from experiments import finetune

    a, _ = two_corpora
    lm = main(_text_run(tmp_path, a, "--max_steps", "1", "--val_every", "1"))
    folder = tmp_path / "xsum"
    folder.mkdir()
    (folder / "validation.jsonl").write_text("".join(
        json.dumps({"document": f"The cat sat on mat {i}.", "summary": "A cat.", "id": str(i)}) + "\n" for i in range(3)))
    run_dir = finetune.main(["--task", "xsum", "--data.path", str(folder), "--eval_only", "true", "--init_from",
                             str(lm / "checkpoints" / "last.ckpt"), "--max_new_tokens", "4", "--model.block_size", "64",
                             "--log_dir", str(tmp_path / "eval"), *FT[:6], *FT[8:]])
    result = json.loads((run_dir / "results.json").read_text())
    assert result["steps"] == 0 and result["train_examples"] == 0 and result["eval_examples"] == 3
    assert set(result["rouge"]) and len((run_dir / "predictions.jsonl").read_text().splitlines()) == 3


# ---------------------------------------------------------------------------- GLUE file layouts
def test_glue_accepts_val_jsonl_with_superglue_column_names(tmp_path):
    from datamodules.glue import get_task, load_split

    folder = tmp_path / "RTE"
    folder.mkdir()
    rows = [{"premise": "A man sleeps.", "hypothesis": "A man rests.", "label": "entailment", "idx": 0},
            {"premise": "It rains.", "hypothesis": "It is dry.", "label": "not_entailment", "idx": 1}]
    (folder / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    split = load_split(get_task("rte"), "validation", str(tmp_path))
    assert split.texts == [("A man sleeps.", "A man rests."), ("It rains.", "It is dry.")] and split.labels == [0, 1]


def test_hub_exported_rte_tsv_is_read_with_its_csv_quoting(tmp_path):
    from datamodules.glue import get_task, load_split

    folder = tmp_path / "RTE"
    folder.mkdir()
    # pandas' to_csv(sep="\t"): a field holding a quote is quoted and its quotes doubled; label 0 = entailment
    (folder / "dev.tsv").write_text('sentence1\tsentence2\tlabel\tidx\n'
                                    '"He watched ""The Osbournes"" twice."\tHe watched a show.\t0\t0\n'
                                    'Plain text here.\t"A ""quoted"" word"\t1\t1\n')
    split = load_split(get_task("rte"), "validation", str(tmp_path))
    assert split.texts == [('He watched "The Osbournes" twice.', "He watched a show."),
                           ("Plain text here.", 'A "quoted" word')]
    assert split.labels == [0, 1]


def test_real_hub_layout_rte_dev_matches_the_superglue_copy(shared_data):
    from datamodules.glue import get_task, read_split_file

    rte = get_task("rte")
    hub = read_split_file(rte, shared_data / "glue" / "RTE" / "dev_hf_layout.tsv")
    superglue = read_split_file(rte, shared_data / "glue" / "RTE" / "val.jsonl")
    assert len(hub) == len(superglue) == 277 and hub.labels == superglue.labels
    assert not [t for pair in hub.texts for t in pair if t.startswith('"') and t.endswith('"')]  # no CSV quotes kept
    differ = [(a, b) for a, b in zip(hub.texts, superglue.texts) if a != b]
    assert len(differ) <= 6  # SOURCES.md: six SuperGLUE texts lost their inner quotes
    assert all(tuple(t.replace('"', "") for t in a) == tuple(t.replace('"', "") for t in b) for a, b in differ)


def test_init_report_recognises_copied_and_sliced_source_tensors():
    """A variant's vanilla_state_mapping may return the source tensors themselves, copies (an upcycled
    expert) or views (a slice of the MLP): all count as mapped from their source, none as unused."""
    tiny = dict(size="tiny", d_model=32, n_layer=2, n_head=2, block_size=32, vocab_size=97)
    state = build_model(ModelConfig(variant="vanilla", **tiny).resolve()).state_dict()
    moe = build_model(apply_preset(ModelConfig(variant="moe", **tiny)).resolve())
    own = moe.state_dict()
    mapping = {k: v for k, v in state.items() if k in own}
    for name in own:
        if ".moe.experts." in name:  # sparse upcycling: every (stacked) expert a copy of its layer's MLP
            layer, rest = name.split(".")[1], name.split(".experts.")[1]
            mapping[name] = state[f"blocks.{layer}.mlp.{rest}"].expand_as(own[name]).clone()
    report = init_report(moe, state, mapping)
    assert report.unused == [] and all(source != "?" for _, source in report.mapped)
    assert report.new == ["blocks.0.moe.router.weight", "blocks.1.moe.router.weight"]
    assert ("blocks.1.moe.experts.c_fc.weight", "blocks.1.mlp.c_fc.weight") in report.mapped
    view = {"blocks.0.moe.experts.c_fc.weight": state["blocks.0.mlp.c_fc.weight"][16:]}  # shares storage
    assert init_report(moe, state, view).mapped == [("blocks.0.moe.experts.c_fc.weight", "blocks.0.mlp.c_fc.weight")]


@pytest.mark.parametrize("variant", ["moe", "mode_staged", "mode_integrated", "mot"])
def test_init_from_vanilla_upcycles_every_expert_from_its_layers_dense_weights(variant):
    """Sparse upcycling: the vanilla MLP (moe, MoDE) or block (mot) of layer i initialises every expert of
    layer i, so the upcycled model starts from all of the vanilla weights; only routers are new."""
    tiny = dict(size="tiny", vocab_size=64, d_model=32, n_head=2, n_layer=2, block_size=16)
    state = build_model(ModelConfig(variant="vanilla", **tiny)).state_dict()
    model = build_model(apply_preset(ModelConfig(variant=variant, **tiny)).resolve())
    mapping = model.vanilla_state_mapping(state)
    report = init_report(model, state, mapping)
    assert not report.unused and report.initialised_share > 0.95
    assert all(any(part in name for part in ("router", "gate", "predictor")) for name in report.new), report.new
    if variant == "mot":  # MoT's experts are whole blocks, one module each
        expert = next(n for n in mapping if ".experts.3." in n and n.endswith("c_fc.weight"))
        assert mapping[expert] is state[expert.replace(".experts.3.", ".")]
        return
    # MoE / MoDE: one stacked (E, ...) tensor, every expert a view of the dense tensor
    expert = next(n for n in mapping if n.endswith(".experts.c_fc.weight"))
    source = expert.replace(".moe.experts.", ".mlp.").replace(".mlp.experts.", ".mlp.")
    assert mapping[expert].shape[1:] == state[source].shape and mapping[expert].shape[0] > 1
    assert mapping[expert].untyped_storage().data_ptr() == state[source].untyped_storage().data_ptr()
    assert all(torch.equal(row, state[source]) for row in mapping[expert])
