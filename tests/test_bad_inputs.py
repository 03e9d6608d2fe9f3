"""Issue 14: every user mistake is one clear line, exit status 2, no traceback, within seconds, and
leaves nothing behind that a later run could take for a valid run, checkpoint or token cache.

The table runs the command-line entry in-process (``experiments.run.cli``: what ``python -m`` calls),
catching its SystemExit and reading stderr; a few rows also run as real subprocesses to prove the exit
status and the absence of a traceback end to end."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import time

import pytest

from experiments import analyze, bench, compare, finetune, repro, run, sweep
from experiments.repro import publish, retrain
from tests.conftest import REPO, TINY_RUN, DiskFillsAfter, file_states

SECONDS = 30  # generous for a loaded 2-core CI machine; the failures themselves take well under 5 s
TINY_FINETUNE = ["--model.d_model", "32", "--model.n_layer", "1", "--model.n_head", "2", "--model.block_size", "48",
                 "--batch_size", "4", "--trainer.enable_progress_bar", "false", "--tokenizer", "bytes"]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> pathlib.Path:
    """Bad (and a few good) input files, and one real checkpoint, shared by every row."""
    root = tmp_path_factory.mktemp("inputs")
    (root / "good.txt").write_text("It was the best of times, it was the worst of times. " * 80)
    (root / "latin1.txt").write_bytes("first line\nsecond line caf\xe9\n".encode("latin-1"))
    (root / "binary.txt").write_bytes(bytes(range(256)) * 8)
    (root / "empty.txt").write_bytes(b"")
    (root / "blank.txt").write_text("  \n\n\t \n")
    (root / "latin1.jsonl").write_bytes(b'{"text": "ok"}\n{"text": "ok"}\n{"text": "caf\xe9"}\n')
    (root / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    (root / "nokey.jsonl").write_text('{"body": "ok"}\n')
    (root / "notes.ckpt").write_text("this is not a checkpoint\n")
    bounce = json.loads((REPO / "docs" / "results" / "probe_bounce" / "results.json").read_text())
    no_vanilla = {**bounce, "runs": [r for r in bounce["runs"] if r["variant"] != "vanilla"]}
    for name, runs in (("report_without_runs", []), ("report_of_gone_runs", [{"variant": "vanilla", "seed": 1337,
                                                                             "run_dir": "out/gone/version_0"}])):
        (root / name).mkdir()
        (root / name / "results.json").write_text(json.dumps({"runs": runs}))
    gone = {"variant": "vanilla", "seed": 1337, "run_dir": "out/gone/version_0"}
    for name, runs in (("merged_report", [{**gone, "source": "docs/results/a/results.json"}]),
                       ("mixed_report", [{**gone, "run_dir_trained": "x"}, {**gone, "seed": 1338}])):
        (root / name).mkdir()
        (root / name / "results.json").write_text(json.dumps({"runs": runs}))
    another_cpu = root / "report_of_another_cpu"  # a real published report, as if trained on a CPU no machine has
    another_cpu.mkdir()
    provenance = {**bounce["provenance"], "kernels": {**bounce["provenance"]["kernels"], "cpu": "No Such CPU"}}
    (another_cpu / "results.json").write_text(json.dumps({**bounce, "provenance": provenance}))
    (root / "broken_board").mkdir()
    (root / "broken_board" / "leaderboard.json").write_text('{"rows": ')
    (root / "probe_without_vanilla.json").write_text(json.dumps(no_vanilla))
    bad_vocab = root / "tok_vocab"
    bad_vocab.mkdir()
    (bad_vocab / "vocab.json").write_text('{"a": 0, "b": ')
    (bad_vocab / "merges.txt").write_text("#version: 0.2\n")
    bad_json = root / "tok_json"
    bad_json.mkdir()
    (bad_json / "tokenizer.json").write_bytes(b"\x00\x01garbage")
    # GLUE: SST-2 with a latin-1 byte in train.tsv; RTE without its dev file
    (root / "glue" / "SST-2").mkdir(parents=True)
    (root / "glue" / "SST-2" / "train.tsv").write_bytes(b"sentence\tlabel\ngood\t1\ncaf\xe9 bad\t0\n")
    (root / "glue" / "SST-2" / "dev.tsv").write_text("sentence\tlabel\ngood\t1\nbad\t0\n")
    (root / "glue" / "RTE").mkdir()
    (root / "glue" / "RTE" / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n")
    (root / "xsum").mkdir()
    (root / "xsum" / "train.jsonl").write_bytes(b'{"document": "caf\xe9", "summary": "s", "id": "1"}\n')
    (root / "xsum" / "validation.jsonl").write_text('{"document": "d", "summary": "s", "id": "2"}\n')
    (root / "xsum_parquet").mkdir()
    (root / "xsum_parquet" / "train.parquet").write_bytes(b"PAR1 truncated")
    (root / "xsum_parquet" / "validation.jsonl").write_text('{"document": "d", "summary": "s", "id": "2"}\n')
    (root / "glue_parquet" / "sst2").mkdir(parents=True)
    (root / "glue_parquet" / "sst2" / "train-00000.parquet").write_bytes(b"not parquet at all")
    (root / "glue_parquet" / "sst2" / "validation.jsonl").write_text('{"sentence": "ok", "label": 1}\n')
    # issue 20: a GLUE folder with two validation files; a one-token corpus; sweep grids that are not
    # YAML / not UTF-8; routing statistics without sites, with a broken line, not UTF-8
    (root / "glue_two" / "RTE").mkdir(parents=True)
    (root / "glue_two" / "RTE" / "train.tsv").write_text("index\tsentence1\tsentence2\tlabel\n0\ta\tb\tentailment\n")
    for name in ("val.jsonl", "validation.jsonl"):
        (root / "glue_two" / "RTE" / name).write_text('{"premise": "a", "hypothesis": "b", "label": 0}\n')
    (root / "tiny.txt").write_text("a")
    (root / "vlogs" / "vanilla-tiny").mkdir(parents=True)  # issue 30: a --version that names a file
    (root / "vlogs" / "vanilla-tiny" / "notes.txt").write_text("not a run folder")
    (root / "empty_config_run").mkdir()  # issue 30: a run folder whose config.yaml is empty
    (root / "empty_config_run" / "config.yaml").write_text("")
    (root / "empty_config_run" / "summary.json").write_text('{"steps": 2, "final_val_loss": 5.0}')
    (root / "hf_no_weights").mkdir()
    (root / "hf_no_weights" / "config.json").write_text('{"model_type": "gpt2"}')
    (root / "vanilla_with_moe.yaml").write_text("model:\n  moe:\n    top_k: 2\n")
    (root / "grid_bad.yaml").write_text("grid: [unclosed\n  variant: vanilla\n")
    (root / "grid_latin1.yaml").write_bytes(b"grid:\n  variant: [caf\xe9]\n")
    for name, lines in (("stats_nosites", b'{"step": 1, "transitions": []}\n'),
                        ("stats_broken", b'{"step": 1, "sites": {}, "transitions": []}\n{"step": 2, "si\n'),
                        ("stats_latin1", b'{"step": 1, "sites": {"caf\xe9": 1}}\n')):
        (root / name / "routing").mkdir(parents=True)
        (root / name / "routing" / "stats.jsonl").write_bytes(lines)
    # one real checkpoint (block_size 64) to resume with the wrong settings, and a truncated copy
    ckpt_run = run.main(["--data", "text", "--data.path", str(root / "good.txt"), "--tokenizer", "bytes",
                         "--max_steps", "1", "--val_every", "1", "--log_dir", str(root / "ckpt_runs"),
                         "--data.cache_dir", str(root / "ckpt_cache"), *TINY_RUN])
    ckpt = ckpt_run / "checkpoints" / "last.ckpt"
    (root / "last.ckpt").write_bytes(ckpt.read_bytes())
    (root / "truncated.ckpt").write_bytes(ckpt.read_bytes()[: ckpt.stat().st_size // 2])
    # and one probe run's (probe-v7/shift: 2 levels, 16 probe blocks) to resume with other probe settings
    probe_run = run.main([*TINY_RUN, *PROBE_RUN, "--max_steps", "1", "--val_every", "1", "--log_dir",
                          str(root / "probe_runs"), "--data.cache_dir", str(root / "probe_cache")])
    (root / "probe_last.ckpt").write_bytes((probe_run / "checkpoints" / "last.ckpt").read_bytes())
    return root


def _text(name: str):
    return lambda d: ["--data", "text", "--data.path", str(d / name), "--tokenizer", "bytes"]


PROBE_RUN = ["--data", "probe-v7/shift", "--data.max_tokens", "8192", "--model.block_size", "128",
             "--callbacks.probe_blocks", "16"]


def _good(*extra):
    return lambda d: ["--data", "text", "--data.path", str(d / "good.txt"), "--tokenizer", "bytes",
                      *[a.format(d=d) for a in extra]]


def _ft(*extra):
    return lambda d: [*[a.format(d=d) for a in extra]]


# (id, command, argv from the inputs folder, what the one line must say)
CASES = [
    ("unknown-variant", "run", lambda d: ["--variant", "nope"], r"model\.variant: unknown variant 'nope'"),
    ("unknown-size", "run", lambda d: ["--size", "huge"], r"model\.size: unknown size"),
    ("unknown-dataset", "run", lambda d: ["--data", "nope"], r"data\.name: unknown dataset"),
    ("bad-d_model", "run", lambda d: ["--model.d_model", "33"], r"model\.d_model"),
    ("max_steps-0", "run", lambda d: ["--max_steps", "0"], r"trainer\.max_steps"),
    ("max_steps-not-int", "run", lambda d: ["--max_steps", "abc"], r"trainer\.max_steps.*abc"),
    ("unknown-option", "run", lambda d: ["--nope", "1"], r"unrecognized arguments: --nope"),
    # issue 32's families: a bad option is the field's name and what it accepts, before anything is built
    ("recur_halt-max_steps-1", "run", lambda d: ["--variant", "recur_halt", "--model.recur_halt.max_steps", "1"],
     r"model\.recur_halt\.max_steps: must be >= 2"),
    ("recur_halt-halting", "run", lambda d: ["--variant", "recur_halt", "--model.recur_halt.halting", "lstm"],
     r"model\.recur_halt\.halting: must be one of act, ponder"),
    ("mor-too-few-layers", "run", lambda d: ["--variant", "mor", "--model.n_layer", "2"],
     r"model\.mor\.num_recursions: 2 recursions need model\.n_layer >= 4"),
    ("mor-sharing", "run", lambda d: ["--variant", "mor_token", "--model.mor.sharing", "ring"],
     r"model\.mor\.sharing: unknown value 'ring'; use one of"),
    ("early_exit-confidence", "run", lambda d: ["--variant", "early_exit", "--model.early_exit.confidence", "entropy"],
     r"model\.early_exit\.confidence: must be one of softmax, margin, state"),
    ("early_exit-threshold", "run", lambda d: ["--variant", "early_exit", "--model.early_exit.exit_threshold", "0"],
     r"model\.early_exit\.exit_threshold: must be in \(0, 1\]"),
    ("negative-lr", "run", lambda d: ["--optim.lr", "-1"], r"optim\.lr"),
    ("batch_size-0", "run", lambda d: ["--data.batch_size", "0"], r"data\.batch_size"),
    ("val_every-0", "run", lambda d: ["--val_every", "0"], r"val_every"),
    ("val_fraction", "run", lambda d: ["--data.val_fraction", "0.7"], r"data\.val_fraction"),
    ("init_min_share", "run", lambda d: ["--init_min_share", "2"], r"init_min_share"),
    ("missing-config-file", "run", lambda d: ["--config", str(d / "nope.yaml")], r"nope\.yaml"),
    ("text-without-path", "run", lambda d: ["--data", "text", "--tokenizer", "bytes"], r"data\.path: no files"),
    ("text-missing-file", "run", _text("missing.txt"), r"data\.path: .*missing\.txt does not exist"),
    ("text-not-utf8", "run", _text("latin1.txt"), r"latin1\.txt:2: not UTF-8 text .*byte offset 26"),
    ("text-binary", "run", _text("binary.txt"), r"binary\.txt:1: NUL byte at byte offset 0"),
    ("text-empty", "run", _text("empty.txt"), r"empty\.txt hold no text"),
    ("text-whitespace", "run", _text("blank.txt"), r"blank\.txt hold no text"),
    ("text-empty-bpe", "run", lambda d: ["--data", "text", "--data.path", str(d / "blank.txt"), "--tokenizer", "bpe"],
     r"blank\.txt hold no text"),
    ("jsonl-not-utf8", "run", _text("latin1.jsonl"), r"latin1\.jsonl:3: not UTF-8 text .*byte offset 43"),
    ("jsonl-broken", "run", _text("broken.jsonl"), r"broken\.jsonl:2: not valid JSON"),
    ("jsonl-missing-key", "run", _text("nokey.jsonl"), r"nokey\.jsonl:1: missing column 'text'"),
    ("corrupt-vocab.json", "run", lambda d: ["--data", "text", "--data.path", str(d / "good.txt"),
                                             "--tokenizer", str(d / "tok_vocab")], r"tok_vocab/vocab\.json .*not a valid tokenizer"),
    ("corrupt-tokenizer.json", "run", lambda d: ["--data", "text", "--data.path", str(d / "good.txt"),
                                                 "--tokenizer", str(d / "tok_json")], r"tokenizer\.json is not a valid tokenizer"),
    ("unknown-tokenizer", "run", lambda d: ["--tokenizer", "nope"], r"data\.tokenizer: 'nope' is not a known tokenizer"),
    ("ckpt-missing", "run", _good("--ckpt_path", "{d}/none.ckpt"), r"none\.ckpt does not exist"),
    ("ckpt-truncated", "run", _good("--ckpt_path", "{d}/truncated.ckpt"), r"truncated\.ckpt is not a readable PyTorch checkpoint"),
    ("ckpt-not-a-checkpoint", "run", _good("--ckpt_path", "{d}/notes.ckpt"), r"notes\.ckpt is not a readable PyTorch checkpoint"),
    ("ckpt-last-nothing", "run", _good("--ckpt_path", "last"), r"no last\.ckpt under"),
    ("ckpt-other-block_size", "run", _good("--ckpt_path", "{d}/last.ckpt", "--model.block_size", "32"),
     r"model\.block_size \(64 in the checkpoint, 32 now\)"),
    ("ckpt-other-variant", "run", _good("--ckpt_path", "{d}/last.ckpt", "--variant", "mod"), r"model\.variant \('vanilla'"),
    ("ckpt-other-size", "run", _good("--ckpt_path", "{d}/last.ckpt", "--size", "small"), r"model\.size \('tiny'"),
    ("ckpt-other-data", "run", lambda d: [*_text("latin1.jsonl")(d)[:-4], "--data.path", str(d / "nokey.jsonl"),
                                          "--tokenizer", "bytes", "--ckpt_path", str(d / "last.ckpt")], r"different data \(text:text-"),
    # a resume under another --val_blocks would mix two validation sets in one run's curves and val_history
    ("ckpt-other-val_blocks", "run", _good("--ckpt_path", "{d}/last.ckpt", "--val_blocks", "4"),
     r"ckpt_path: .*last\.ckpt was trained with a different --val_blocks \(8 in the checkpoint, 4 now\); resume with "
     r"the command that trained it, or start a new run without --ckpt_path"),
    ("ckpt-other-probe-levels", "run", lambda d: [*PROBE_RUN, "--callbacks.probe_levels", "3", "--ckpt_path",
                                                   str(d / "probe_last.ckpt")],
     r"ckpt_path: the run measured its probe metrics with other settings: callbacks\.probe_levels \(2 in the "
     r"checkpoint, 3 now\); resume with --callbacks\.probe_levels 2 --callbacks\.probe_hard_from 1 "
     r"--callbacks\.probe_blocks 16, or start a new run"),
    ("init_from-missing", "run", _good("--init_from", "{d}/none.ckpt"), r"init_from: .*none\.ckpt does not exist"),
    ("init_from-truncated", "run", _good("--init_from", "{d}/truncated.ckpt"), r"init_from: .*truncated\.ckpt is not a readable"),
    ("init_from-not-a-checkpoint", "run", _good("--init_from", "{d}/notes.ckpt"), r"init_from: .*notes\.ckpt is not a readable"),
    # issue 20: an unwritable log dir is found before the data are prepared (a folder below a file: even root
    # cannot write there; read-only and permission cases are in tests/test_nothing_lost.py)
    ("log_dir-below-a-file", "run", _good("--log_dir", "{d}/good.txt/runs"),
     r"log_dir: cannot write to .*good\.txt/runs\S* \(Not a directory\); make it writable or choose another --log_dir"),
    # issue 20: argument errors found before the data, options that would be ignored, one-line errors
    ("init_from-hf-offline", "run", _good("--init_from", "hf:dyncomp-tests/not-cached"),
     r"init_from: Hugging Face model 'dyncomp-tests/not-cached' is not cached and the Hub is unreachable"),
    ("init_from-hf-folder-without-weights", "run", _good("--init_from", "{d}/hf_no_weights"),
     r"init_from: .*hf_no_weights has config\.json but no weights"),
    ("unused-group-option", "run", lambda d: ["--model.mod.capacity", "0.5"],
     r"model\.mod\.capacity: the vanilla variant does not use this option \(set to 0\.5\); it applies to mod, "
     r"mode_integrated, mode_staged"),
    ("unused-group-option-at-its-default", "run", lambda d: ["--model.mod.capacity", "0.125"],
     r"model\.mod\.capacity: the vanilla variant does not use this option \(set to 0\.125\); .*\(groups vanilla "
     r"reads: none\)$"),
    ("unused-group-option-in-yaml", "run", lambda d: ["--config", str(d / "vanilla_with_moe.yaml")],
     r"model\.moe\.top_k: the vanilla variant does not use this option"),
    ("overridden-field-cea_moe", "run", lambda d: ["--variant", "cea_moe", "--model.moe.num_experts", "16"],
     r"model\.moe\.num_experts: the cea_moe variant does not use this option"),
    ("probe-with-path", "run", lambda d: ["--data", "probe/arith", "--data.path", str(d / "good.txt")],
     r"data\.path: dataset 'probe/arith' does not read this option; it applies to openwebtext, slimpajama, text"),
    ("probe-levels-below-the-datas", "run", lambda d: ["--data", "probe-v6/bounce", "--callbacks.probe_levels", "5"],
     r"callbacks\.probe_levels: probe-v6/bounce's labels use levels 0\.\.7, more than the 5 given; raise it to 8"),
    ("probe-v2-with-path", "run", lambda d: ["--data", "probe-v2/recall", "--data.path", str(d / "good.txt")],
     r"data\.path: dataset 'probe-v2/recall' does not read this option; it applies to openwebtext, slimpajama, text"),
    ("text-with-max_tokens", "run", _good("--data.max_tokens", "1000"), r"data\.max_tokens: dataset 'text' does not read"),
    ("text-too-small", "run", _text("tiny.txt"),
     r"dataset 'text' \(.*tiny\.txt\) has 2 tokens: fewer than two blocks of 65 .*smaller --model\.block_size"),
    ("sweep-grid-not-yaml", "sweep", lambda d: [str(d / "grid_bad.yaml"), "--dry_run"],
     r"grid_bad\.yaml:2: not a valid YAML grid file"),
    ("sweep-grid-not-utf8", "sweep", lambda d: [str(d / "grid_latin1.yaml"), "--dry_run"],
     r"grid_latin1\.yaml:2: not UTF-8 text"),
    ("bench-set-unknown-field", "bench", lambda d: ["--set", "foo.bar=1"], r"--set foo\.bar: no such model config field"),
    ("bench-set-without-value", "bench", lambda d: ["--set", "d_model"], r"--set d_model: expected FIELD=VALUE"),
    ("bench-set-unused", "bench", lambda d: ["--set", "mod.capacity=0.5"],
     r"--set mod\.capacity=0\.5: none of the benchmarked variants \(vanilla\) uses model\.mod\.capacity"),
    ("analyze-stats-without-sites", "analyze", lambda d: ["routing", str(d / "stats_nosites")],
     r"stats_nosites/routing/stats\.jsonl:1: not a routing statistics record: no 'sites' field"),
    ("analyze-stats-broken-line", "analyze", lambda d: ["routing", str(d / "stats_broken")],
     r"stats_broken/routing/stats\.jsonl:2: not valid JSON"),
    ("analyze-stats-not-utf8", "analyze", lambda d: ["routing", str(d / "stats_latin1")],
     r"stats_latin1/routing/stats\.jsonl:1: not UTF-8 text"),
    ("ft-glue-two-validation-files", "finetune", _ft("--task", "glue/rte", "--data.path", "{d}/glue_two"),
     r"RTE: several glue/rte validation files \(val\.jsonl, validation\.jsonl\); keep one"),
    ("ft-unused-group-option", "finetune", _ft("--task", "glue/sst2", "--data.path", "{d}/glue", "--model.mot.top_k", "1"),
     r"model\.mot\.top_k: the vanilla variant does not use this option"),
    ("ft-init_from-hf-offline", "finetune", _ft("--task", "glue/sst2", "--data.path", "{d}/glue", "--init_from",
                                                "hf:dyncomp-tests/not-cached"), r"init_from: Hugging Face model .* is not cached"),
    ("ft-unknown-task", "finetune", _ft("--task", "summarise"), r"task: unknown task 'summarise'"),
    ("ft-max_train_examples-0", "finetune", _ft("--task", "glue/sst2", "--data.max_train_examples", "0"),
     r"data\.max_train_examples: must be a positive integer"),
    ("ft-max_eval_examples-0", "finetune", _ft("--task", "xsum", "--data.max_eval_examples", "0"),
     r"data\.max_eval_examples: must be a positive integer"),
    ("ft-num_beams-0", "finetune", _ft("--task", "xsum", "--num_beams", "0"), r"num_beams"),
    ("ft-glue-tsv-not-utf8", "finetune", _ft("--task", "glue/sst2", "--data.path", "{d}/glue"),
     r"SST-2/train\.tsv:3: not UTF-8 text"),
    ("ft-glue-missing-dev", "finetune", _ft("--task", "glue/rte", "--data.path", "{d}/glue"), r"RTE"),
    ("ft-xsum-jsonl-not-utf8", "finetune", _ft("--task", "xsum", "--data.path", "{d}/xsum"),
     r"train\.jsonl:1: not UTF-8 text"),
    ("ft-xsum-parquet-truncated", "finetune", _ft("--task", "xsum", "--data.path", "{d}/xsum_parquet"),
     r"train\.parquet: not a readable parquet file"),
    ("ft-glue-parquet-foreign", "finetune", _ft("--task", "glue/sst2", "--data.path", "{d}/glue_parquet"),
     r"train-00000\.parquet: not a readable parquet file"),
    ("ft-init_from-truncated", "finetune", _ft("--task", "glue/sst2", "--data.path", "{d}/glue", "--init_from",
                                               "{d}/truncated.ckpt"), r"truncated\.ckpt is not a readable"),
    ("ft-eval_only-missing-ckpt", "finetune", _ft("--task", "glue/sst2", "--data.path", "{d}/glue", "--eval_only", "true",
                                                  "--init_from", "{d}/none.ckpt"), r"init_from: .*none\.ckpt does not exist"),
    ("ft-eval_only-no-head", "finetune", _ft("--task", "glue/sst2", "--data.path", "{d}/glue", "--eval_only", "true",
                                             "--init_from", "{d}/last.ckpt"), r"has no trained glue/sst2 classification head"),
    # fine-tuning resumes (2026-12-07): --ckpt_path with nothing to resume, or where it cannot apply
    ("ft-ckpt_path-last-nothing", "finetune", _ft("--task", "glue/sst2", "--data.path", "{d}/glue", "--ckpt_path",
                                                  "last"), r"--ckpt_path last: no interrupted run under .*glue-sst2-"),
    ("ft-ckpt_path-missing", "finetune", _ft("--task", "glue/sst2", "--data.path", "{d}/glue", "--ckpt_path",
                                             "{d}/none.ckpt"), r"ckpt_path: .*none\.ckpt is not a file"),
    ("ft-ckpt_path-eval_only", "finetune", _ft("--task", "glue/sst2", "--data.path", "{d}/glue", "--eval_only", "true",
                                               "--init_from", "{d}/last.ckpt", "--ckpt_path", "last"),
     r"ckpt_path: resumes a preempted training run; --eval_only trains nothing"),
    ("ft-ckpt_path-glue-all-file", "finetune", _ft("--task", "glue/all", "--data.path", "{d}/glue", "--ckpt_path",
                                                   "{d}/last.ckpt"),
     r"ckpt_path: glue/all resumes its newest interrupted run with --ckpt_path last"),
    # this session's options and commands: the FLOPs budget, activation checkpointing, the leaderboard, --jobs
    ("max_train_flops-0", "run", lambda d: ["--max_train_flops", "0"], r"max_train_flops: must be a positive, finite"),
    ("activation_checkpointing-bad", "run", lambda d: ["--activation_checkpointing", "every_k:0"],
     r"activation_checkpointing: unknown value 'every_k:0'"),
    # issue 30: the validation set is a global count of blocks; --val_batches is its deprecated alias
    ("val_blocks-0", "run", lambda d: ["--val_blocks", "0"], r"val_blocks: must be a positive integer, got 0"),
    ("val_batches-and-val_blocks", "run", lambda d: ["--val_batches", "2", "--val_blocks", "8"],
     r"val_batches: deprecated alias of --val_blocks, and both are set; keep only --val_blocks"),
    ("version-is-a-file", "run", _good("--log_dir", "{d}/vlogs", "--version", "notes.txt"),
     r"version: .*vlogs/vanilla-tiny/notes\.txt is a file, not a run folder; choose another --version"),
    ("max_train_flops-negative-exponent", "run", lambda d: ["--max_train_flops", "-1e12"],
     r"max_train_flops: must be a positive, finite number"),
    ("max_train_flops-minus-inf", "run", lambda d: ["--max_train_flops", "-inf"],
     r"max_train_flops: must be a positive, finite number .*got -inf"),
    ("max_train_flops-inf", "run", lambda d: ["--max_train_flops", "inf"],
     r"max_train_flops: must be a positive, finite number .*got inf"),
    ("probe-v2-with-a-tokenizer-folder", "run", lambda d: ["--data", "probe-v2", "--tokenizer", str(d / "tok_json")],
     r"data\.tokenizer: dataset 'probe-v2' needs the byte-level 'bytes' tokenizer, got '.*tok_json'; drop --tokenizer"),
    ("bench-plan-gpu_memory-inf", "bench", lambda d: ["--plan", "--gpu_memory_gb", "inf"],
     r"--gpu_memory_gb: must be a positive, finite number of GiB \(e\.g\. 80\), got inf"),
    ("bench-plan-gpu_memory-0", "bench", lambda d: ["--plan", "--gpu_memory_gb", "0"], r"--gpu_memory_gb: .*got 0\.0"),
    ("bench-plan-gpu_memory-negative", "bench", lambda d: ["--plan", "--gpu_memory_gb", "-1"],
     r"--gpu_memory_gb: .*got -1\.0"),
    ("bench-plan-gpu_memory-nan", "bench", lambda d: ["--plan", "--gpu_memory_gb", "nan"], r"--gpu_memory_gb: .*got nan"),
    ("bench-plan-seq_len-negative", "bench", lambda d: ["--plan", "--seq_len", "-5"],
     r"--seq_len: must be a positive integer, got -5"),
    ("sweep-gpu_memory-inf", "sweep", lambda d: ["--grid", "variant=vanilla", "--dry_run", "--gpu_memory_gb", "inf"],
     r"--gpu_memory_gb: must be a positive, finite number"),
    ("compare-out-is-a-file", "compare", lambda d: [str(d / "ckpt_runs"), "--out", str(d / "good.txt")],
     r"--out: .*good\.txt is a file, not a folder"),
    ("compare-out-below-a-file", "compare", lambda d: [str(d / "ckpt_runs"), "--out", str(d / "good.txt" / "board")],
     r"--out: cannot write to .*good\.txt/board \(Not a directory\); make it writable or choose another folder"),
    ("compare-plain-file-argument", "compare", lambda d: [str(d / "good.txt")], r"no run folders matched .*good\.txt"),
    ("compare-empty-config", "compare", lambda d: [str(d / "empty_config_run")],
     r"empty_config_run/config\.yaml: empty; every run folder of experiments\.run holds its resolved config\.yaml"),
    ("compare-no-runs", "compare", lambda d: [str(d / "no_runs_here")], r"no run folders matched .*no_runs_here"),
    ("repro-jobs-0", "repro", lambda d: ["probe", "--out", str(d / "repro_out"), "--quick", "--jobs", "0"],
     r"--jobs: must be a positive integer, got 0"),
    ("repro-tables_from-missing-file", "repro",
     lambda d: ["probe", "--out", str(d / "repro_out"), "--tables_from", str(d / "nope.json")],
     r"--tables_from: no file .*nope\.json; give the results\.json of the published table"),
    ("repro-tables_from-not-json", "repro",
     lambda d: ["probe", "--out", str(d / "repro_out"), "--tables_from", str(d / "good.txt")],
     r"--tables_from: .*good\.txt is unreadable \(Expecting value"),
    ("repro-isoflop-tables_from-a-probe-file", "repro",
     lambda d: ["mod_isoflop", "--out", str(d / "repro_out"), "--tables_from", str(d / "probe_without_vanilla.json")],
     r"--tables_from: .*probe_without_vanilla\.json's run rows lack budget, n_layer, d_model, .*: not a "
     r"mod_isoflop results\.json"),
    ("repro-tables_from-without-vanilla", "repro",
     lambda d: ["probe", "--out", str(d / "repro_out"), "--tables_from", str(d / "probe_without_vanilla.json")],
     r"--tables_from: no vanilla rows in the files; the tables are relative to the reference vanilla"),
    ("publish-out-without-results", "publish", lambda d: [str(d / "no_runs_here"), str(d / "published")],
     r"publish: .*no_runs_here/results\.json is not a finished programme's report \(.*\); give the --out folder"),
    ("publish-results-without-runs", "publish", lambda d: [str(d / "report_without_runs"), str(d / "published")],
     r"publish: .*report_without_runs/results\.json has no run rows with a run_dir; nothing to publish"),
    ("publish-run-folder-gone", "publish", lambda d: [str(d / "report_of_gone_runs"), str(d / "published")],
     r"publish: the run folder .*gone/version_0 of vanilla seed 1337 is not there \(no summary\.json of that run\)"),
    ("retrain-a-report-that-names-no-commit", "repro.retrain", lambda d: [str(d / "report_of_gone_runs")],
     r"retrain: .*report_of_gone_runs/results\.json names no commit; only a report that does can be retrained"),
    ("retrain-on-another-cpu", "repro.retrain", lambda d: [str(d / "report_of_another_cpu")],
     r"retrain: .*report_of_another_cpu: its runs trained with CPU 'No Such CPU', this machine has .*; bit for bit "
     r"needs the same CPU model, kernel variables and torch: retrain it on such a machine"),
    ("retrain-a-folder-without-a-report", "repro.retrain", lambda d: [str(d / "no_runs_here")],
     r"retrain: .*no_runs_here/results\.json is not a finished programme's report \(.*\); give the docs/results folder"),
    ("retrain-jobs-0", "repro.retrain", lambda d: [str(d / "report_of_another_cpu"), "--jobs", "0"],
     r"--jobs: 0 is not a positive number of runs at once"),
    ("publish-restore-into-an-unpublished-report", "publish",
     lambda d: [str(d / "report_of_gone_runs"), str(d / "report_of_gone_runs"), "--restore"],
     r"publish --restore: DEST .*report_of_gone_runs is OUT itself, not a published report; give the docs/results "
     r"folder of the report"),
    ("publish-restore-into-a-folder-without-a-report", "publish",
     lambda d: [str(d / "report_of_gone_runs"), str(d / "no_runs_here"), "--restore"],
     r"publish --restore: .*no_runs_here/results\.json is not a finished programme's report \(.*\); give as DEST the "
     r"docs/results folder publish wrote"),
    ("publish-restore-from-a-folder-without-a-report", "publish",
     lambda d: [str(d / "no_runs_here"), str(d / "report_of_gone_runs"), "--restore"],
     r"publish --restore: .*no_runs_here/results\.json is not a finished programme's report \(.*\); give as OUT the "
     r"--out folder of a retraining that finished"),
    ("publish-restore-into-a-merged-report", "publish",
     lambda d: [str(d / "report_of_gone_runs"), str(d / "merged_report"), "--restore"],
     r"publish --restore: .*merged_report merges other reports \(its rows have a source\); restore each folder its "
     r"rows came from"),
    ("publish-restore-into-mixed-rows", "publish",
     lambda d: [str(d / "report_of_gone_runs"), str(d / "mixed_report"), "--restore"],
     r"publish --restore: .*mixed_report's rows mix publish's \(with run_dir_trained\) and others"),
    ("publish-restore-into-a-broken-leaderboard", "publish",
     lambda d: [str(d / "no_runs_here"), str(d / "broken_board"), "--restore"],
     r"publish --restore: .*broken_board/leaderboard\.json is not a leaderboard of experiments\.compare \(.*\); give "
     r"the folder compare wrote it to"),
    ("publish-runs-no-folder", "publish", lambda d: [str(d / "no_such_log_dir"), str(d / "published"), "--runs"],
     r"publish --runs: .*no_such_log_dir is not a folder; give the --log_dir the runs wrote to"),
    ("sweep-plan_workers-0", "sweep", lambda d: ["--grid", "variant=vanilla", "--dry_run", "--plan_workers", "0"],
     r"--plan_workers: must be a positive integer, got 0"),
    ("repro-necessity-one-depth", "repro", lambda d: ["necessity", "--out", str(d / "repro_out"), "--layers", "2"],
     r"--layers: at least two different positive depths, got 2"),
    ("repro-necessity-min_solving-above-seeds", "repro",
     lambda d: ["necessity", "--out", str(d / "repro_out"), "--seeds", "3", "--min_solving", "4"],
     r"--min_solving: 1 to 3 \(--seeds\), got 4"),
    *((f"repro-{name}-seeds-0", "repro", lambda d, name=name: [name, "--out", str(d / "repro_out"), "--seeds", "0"],
       r"--seeds: must be a positive integer, got 0") for name in ("mom_kh", "mom_two_phase", "contribution")),
    ("repro-contribution-mi_restarts-0", "repro",
     lambda d: ["contribution", "--out", str(d / "repro_out"), "--mi_restarts", "0"],
     r"--mi_restarts: must be a positive integer, got 0"),
    ("repro-head_to_head-unknown-entry-option", "repro",
     lambda d: ["head_to_head", "--out", str(d / "repro_out"), "--variants", "mod:nope=1", "--seeds", "1"],
     r"--variants: mod:nope=\.\.\. is no option of mod; options: "),
]
SUBPROCESS_CASES = {"text-not-utf8", "ckpt-truncated", "ft-max_train_examples-0", "bench-set-unknown-field",
                    "analyze-stats-without-sites", "compare-no-runs", "retrain-on-another-cpu"}
LEAVES_A_VALID_TOKEN_CACHE = {"text-too-small",  # the corpus was tokenised correctly; it is only too short
                              "ckpt-other-probe-levels"}  # the probe settings are checked once the checkpoint loads
ENTRIES = {"run": run.main, "finetune": finetune.main, "sweep": sweep.main, "bench": bench.main, "analyze": analyze.main,
           "compare": compare.main, "repro": repro.main, "publish": publish.main, "repro.retrain": retrain.main}
# options that keep a bench row quick should today's code run it instead of refusing it
QUICK_BENCH = ["--steps", "1", "--warmup", "0", "--no_hf", "--no_minimal", "--device", "cpu", "--size", "tiny"]


def _argv(command: str, build, inputs: pathlib.Path, out: pathlib.Path):
    if command == "run":
        return [*TINY_RUN, "--max_steps", "2", "--log_dir", str(out / "logs"), "--data.cache_dir", str(out / "cache"),
                *build(inputs)]
    if command == "finetune":
        return [*TINY_FINETUNE, "--max_steps", "1", "--log_dir", str(out / "logs"), *build(inputs)]
    return [*build(inputs), *(QUICK_BENCH if command == "bench" else [])]


def _left_behind(out: pathlib.Path, name: str = ""):
    """Files a later run could take for a valid run, checkpoint or token cache."""
    valid_looking = {"config.yaml", "summary.json", "results.json", "glue_results.json", "meta.json"}
    found = [p for p in out.rglob("*") if p.is_file() and (p.name in valid_looking or p.suffix == ".ckpt"
                                                           or p.name.startswith("tokens.bin"))]
    if name in LEAVES_A_VALID_TOKEN_CACHE:
        found = [p for p in found if p.parent.parent.name != "tokens"]
    return found


def _assert_one_line(stderr: str, pattern: str):
    assert "Traceback" not in stderr, stderr
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stderr
    import re

    assert re.search(pattern, errors[0]), errors[0]


@pytest.mark.parametrize("name,command,build,pattern", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_exit_2_and_leaves_nothing(name, command, build, pattern, inputs, tmp_path, capsys,
                                                         monkeypatch):
    monkeypatch.setenv("DYNCOMP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.time()
    with pytest.raises(SystemExit) as exit_info:
        run.cli(ENTRIES[command], _argv(command, build, inputs, tmp_path))
    assert time.time() - start < SECONDS
    assert exit_info.value.code == 2
    _assert_one_line(capsys.readouterr().err, pattern)
    assert _left_behind(tmp_path, name) == []


@pytest.mark.parametrize("name,command,build,pattern", [c for c in CASES if c[0] in SUBPROCESS_CASES],
                         ids=sorted(SUBPROCESS_CASES, key=[c[0] for c in CASES].index))
def test_bad_input_end_to_end_in_a_subprocess(name, command, build, pattern, inputs, tmp_path):
    env = dict(os.environ, DYNCOMP_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("DYNCOMP_RUN_VERSION", None)
    proc = subprocess.run([sys.executable, "-m", f"experiments.{command}", *_argv(command, build, inputs, tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    _assert_one_line(proc.stderr, pattern)
    assert _left_behind(tmp_path, name) == []


def test_disk_full_while_building_the_cache_says_where_and_how_much(inputs, tmp_path, capsys, monkeypatch):
    from datamodules import token_cache

    real_fdopen = os.fdopen
    monkeypatch.setattr(token_cache.os, "fdopen", lambda fd, mode="r", **kw: DiskFillsAfter(real_fdopen(fd, mode, **kw))
                        if "b" in mode else real_fdopen(fd, mode, **kw))
    with pytest.raises(SystemExit) as exit_info:
        run.cli(run.main, _argv("run", _good(), inputs, tmp_path))
    assert exit_info.value.code == 2
    _assert_one_line(capsys.readouterr().err,
                     rf"disk full while building the token cache in {tmp_path}/cache/tokens/.*: 0\.0 KiB written, "
                     r"[\d,.]+ [MKG]iB free, needs up to [\d,.]+ [MKG]iB in all")  # the estimate printed before
    assert _left_behind(tmp_path) == []


# ---------------------------------------------------------------------------- issue 20: errors before the data
# Argument errors of experiments.run that need no corpus or tokenizer: each must be reported before either
# is built (building them takes minutes for a large corpus; these used to come after it, 54-121 s in).
BEFORE_THE_DATA = ["init_from-missing", "init_from-truncated", "init_from-not-a-checkpoint", "init_from-hf-offline",
                   "init_from-hf-folder-without-weights", "ckpt-missing", "ckpt-truncated", "ckpt-not-a-checkpoint",
                   "ckpt-last-nothing", "ckpt-other-block_size", "ckpt-other-variant", "ckpt-other-size",
                   "unused-group-option", "unused-group-option-in-yaml", "overridden-field-cea_moe", "probe-with-path",
                   "text-with-max_tokens", "version-is-a-file", "probe-v2-with-a-tokenizer-folder",
                   "probe-levels-below-the-datas"]


@pytest.mark.parametrize("name,command,build,pattern", [c for c in CASES if c[0] in BEFORE_THE_DATA],
                         ids=[c[0] for c in CASES if c[0] in BEFORE_THE_DATA])
def test_argument_errors_come_before_the_corpus_and_tokenizer(name, command, build, pattern, inputs, tmp_path, capsys,
                                                              monkeypatch):
    from datamodules import lm

    def data_preparation(*args, **kwargs):
        raise AssertionError("the data module was built before the argument error was found")

    monkeypatch.setattr(lm.LMDataModule, "__init__", data_preparation)
    monkeypatch.setenv("DYNCOMP_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.time()
    with pytest.raises(SystemExit) as exit_info:
        run.cli(run.main, _argv(command, build, inputs, tmp_path))
    assert time.time() - start < 15  # the checks themselves take well under a second
    assert exit_info.value.code == 2
    _assert_one_line(capsys.readouterr().err, pattern)


SLOW_ARGUMENT_ERRORS = [  # the measurements: 121 s, 101 s, 54-64 s before the error
    (["--init_from", "hf:dyncomp-tests/not-cached"], r"init_from: Hugging Face model .* is not cached"),
    (["--ckpt_path", "last"], r"--ckpt_path last: no last\.ckpt under"),
    (["--init_from", "{d}/none.ckpt"], r"init_from: .*none\.ckpt does not exist"),
    (["--ckpt_path", "{d}/none.ckpt"], r"ckpt_path: .*none\.ckpt does not exist"),
]


@pytest.mark.slow
@pytest.mark.parametrize("extra,pattern", SLOW_ARGUMENT_ERRORS, ids=["hf-offline", "ckpt-last", "init-missing", "ckpt-missing"])
def test_argument_errors_end_a_fresh_process_within_seconds_without_preparing_data(extra, pattern, tmp_path):
    """As a user runs it: the default corpus and tokenizer (whose preparation writes the cache folder),
    a fresh process and cache. The cache folder must never have been created, and the process must end
    within seconds: its CPU time (load-independent: ~5 s, nearly all importing torch and Lightning) under
    15 s, its wall time under 90 s even on a CI machine loaded many times over (the wall bound catches
    waits on the network, which cost no CPU time)."""
    env = dict(os.environ, DYNCOMP_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    env.pop("DYNCOMP_RUN_VERSION", None)
    argv = [a.format(d=tmp_path) for a in extra]
    start, cpu_before = time.time(), _children_cpu_seconds()
    proc = subprocess.run([sys.executable, "-m", "experiments.run", "--max_steps", "2", "--log_dir",
                           str(tmp_path / "logs"), *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    elapsed, cpu = time.time() - start, _children_cpu_seconds() - cpu_before
    assert proc.returncode == 2, proc.stderr[-2000:]
    _assert_one_line(proc.stderr, pattern)
    assert not (tmp_path / "cache").exists(), "data preparation started before the argument error"
    assert cpu < 15 and elapsed < 90, f"the argument error came after {cpu:.1f} CPU s, {elapsed:.1f} s wall clock"


def _children_cpu_seconds() -> float:
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# ---------------------------------------------------------------------------- a second programme on one command
def test_a_second_programme_on_a_run_that_is_training_is_one_line_exit_2_and_touches_nothing(tmp_path, capsys,
                                                                                               monkeypatch):
    """The ``runs.started`` lock end to end: a first ``repro`` programme is frozen (SIGSTOP) while it trains its
    first run, holding that run's lock; the same command from a second programme ends with one line, status 2,
    and changes no file of the first one (its record, its run folder, the index)."""
    import glob
    import signal

    out = tmp_path / "repro_out"
    argv = ["probe", "--out", str(out), "--quick", "--jobs", "1", "--seeds", "1", "--variants", "vanilla"]
    env = dict(os.environ, DYNCOMP_CACHE=str(tmp_path / "cache"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    first = subprocess.Popen([sys.executable, "-m", "experiments.repro", *argv], cwd=REPO, env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 180
        while not glob.glob(str(out / "runs.started" / "*.json")):  # written once the run holds its lock
            assert first.poll() is None, f"the first programme ended early: {first.stderr.read()[-2000:]}"
            assert time.time() < deadline, "the first programme never started its first run"
            time.sleep(0.2)
        os.kill(first.pid, signal.SIGSTOP)
        before = file_states(out)
        monkeypatch.setenv("DYNCOMP_CACHE", str(tmp_path / "cache"))
        start = time.time()
        with pytest.raises(SystemExit) as exit_info:
            run.cli(repro.main, argv)
        assert time.time() - start < SECONDS
        assert exit_info.value.code == 2
        _assert_one_line(capsys.readouterr().err, r"another programme is training this run now \(.*runs\.started/"
                                                  r"\w+\.lock is locked\); wait for it to end, or stop it")
        assert file_states(out) == before
    finally:
        first.kill()
        first.wait(timeout=60)
