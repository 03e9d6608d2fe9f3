"""``experiments.finetune --eval_only --init_from <fine-tuned checkpoint>``: the checkpoint records its task and
tokenizer, so evaluation needs no ``--tokenizer``, and a wrong-task or missing checkpoint gets its own line."""
from __future__ import annotations

import json

import pytest

from architectures.config import ConfigError

TINY = ["--model.d_model", "32", "--model.n_layer", "1", "--model.n_head", "2", "--model.block_size", "48",
        "--batch_size", "4", "--trainer.enable_progress_bar", "false", "--dropout", "0"]


def _glue(root, folder="SST-2"):
    (root / folder).mkdir(parents=True)
    rows = [("good great fine", 1), ("bad awful poor", 0)] * 4
    for name in ("train.tsv", "dev.tsv"):
        body = "".join(f"{s} {i}\t{y}\n" for i, (s, y) in enumerate(rows))
        (root / folder / name).write_text("sentence\tlabel\n" + body)
    return root


@pytest.fixture(scope="module")
def fine_tuned(tmp_path_factory):
    from experiments import finetune

    tmp = tmp_path_factory.mktemp("ft")
    glue = _glue(tmp / "glue")
    run_dir = finetune.main(["--task", "glue/sst2", "--data.path", str(glue), "--max_steps", "2", "--save_checkpoint",
                             "true", "--tokenizer", "bytes", "--log_dir", str(tmp / "runs"), *TINY])
    return glue, run_dir, next(run_dir.rglob("*.ckpt"))


def test_fine_tuned_checkpoint_records_task_and_tokenizer(fine_tuned):
    from experiments.finetune import FINETUNE_RECORD
    from model_tools.weights import read_checkpoint

    record = read_checkpoint(fine_tuned[2])[FINETUNE_RECORD]
    assert record["task"] == "glue/sst2" and record["tokenizer"]["spec"] == "bytes"


def test_eval_only_uses_the_recorded_tokenizer_without_tokenizer_option(fine_tuned, tmp_path):
    from experiments import finetune

    glue, run_dir, ckpt = fine_tuned
    evaluated = finetune.main(["--task", "glue/sst2", "--data.path", str(glue), "--eval_only", "true",
                               "--init_from", str(ckpt), "--log_dir", str(tmp_path), *TINY])
    again = json.loads((evaluated / "results.json").read_text())
    assert again["metrics"] == json.loads((run_dir / "results.json").read_text())["metrics"]


def test_eval_only_on_another_task_names_the_checkpoints_task(fine_tuned, tmp_path):
    from experiments import finetune

    glue, _, ckpt = fine_tuned
    with pytest.raises(ConfigError, match=r"was fine-tuned on glue/sst2, not glue/rte; pass --task glue/sst2"):
        finetune.main(["--task", "glue/rte", "--data.path", str(glue), "--eval_only", "true", "--init_from", str(ckpt),
                       "--log_dir", str(tmp_path), *TINY])
    with pytest.raises(ConfigError, match=r"was fine-tuned on glue/sst2, not xsum"):
        finetune.main(["--task", "xsum", "--data.path", str(glue), "--eval_only", "true", "--init_from", str(ckpt),
                       "--log_dir", str(tmp_path), *TINY])
    assert not any(tmp_path.iterdir())


def test_eval_only_with_a_missing_checkpoint_says_so(tmp_path):
    from experiments import finetune

    glue = _glue(tmp_path / "glue")
    with pytest.raises(FileNotFoundError, match=r"init_from: .*nope\.ckpt does not exist"):
        finetune.main(["--task", "glue/sst2", "--data.path", str(glue), "--eval_only", "true", "--init_from",
                       str(tmp_path / "nope.ckpt"), "--log_dir", str(tmp_path / "runs"), *TINY])


def test_eval_only_says_it_ignores_max_steps(fine_tuned, tmp_path, capsys):
    from experiments import finetune

    glue, _, ckpt = fine_tuned
    finetune.main(["--task", "glue/sst2", "--data.path", str(glue), "--eval_only", "true", "--init_from", str(ckpt),
                   "--max_steps", "5", "--log_dir", str(tmp_path), *TINY])
    assert "--eval_only trains nothing, so --max_steps / --epochs are ignored" in capsys.readouterr().err
