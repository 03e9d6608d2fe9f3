"""Routing probes: generated data with exact difficulty labels, per-difficulty metrics, the experiment."""
from __future__ import annotations

import hashlib
import json
import os
import pathlib
import statistics
import subprocess
import sys

import numpy as np
import pytest
import torch

from datamodules import probe
from datamodules.catalog import get_corpus
from datamodules.corpora import DataError
from datamodules.lm import DataConfig, LMDataModule
from tests.conftest import REPO, assert_rows_name_their_origin

SMALL = 64 * probe.EPISODE_LEN  # 64 episodes: a few milliseconds to generate


def _datamodule(tmp_path, task="probe", batch_size=4, block_size=128, seed=0, tokens=SMALL):
    dm = LMDataModule(DataConfig(name=task, batch_size=batch_size, max_tokens=tokens, cache_dir=str(tmp_path)),
                      block_size=block_size, seed=seed)
    dm.prepare_data()
    dm.setup("fit")
    return dm


def _labels(levels):
    return {i: v for i, v in enumerate(levels) if v != probe.NO_LABEL}


# ---------------------------------------------------------------------------- generator and labels
@pytest.mark.parametrize("task", sorted(probe.TASKS))
def test_labels_match_the_brute_force_solver(task):
    seen_levels = set()
    for index in range(150):
        family, (data, levels) = probe.episode(task, index)
        assert len(data) == len(levels) == probe.EPISODE_LEN - 1
        solved = probe.solve_episode(family, data, probe.version(task))
        assert {i: (data[i], level) for i, level in _labels(levels).items()} == solved, (task, index)
        seen_levels |= {level for _, level in solved.values()}
    if task.split("/")[-1] in ("probe", "probe-v2", "arith", "bounce"):
        top = probe.BOUNCE_WIDE_LEVELS if probe.version(task) == "v6" else probe.MAX_DEPTH
        assert seen_levels == set(range(top + 1))  # d in 0..D mixed in the sequences
    if task.endswith("/recall"):
        assert seen_levels == set(range(probe.MAX_HOPS + 1))


def test_solver_catches_a_wrong_label():
    family, (data, levels) = probe.episode("probe/arith", 3)
    answer = next(i for i, level in enumerate(levels) if level > 0)
    wrong = bytearray(data)
    wrong[answer] = ord("0") + (data[answer] - ord("0") + 1) % 10
    assert probe.solve_episode(family, bytes(wrong))[answer][0] != wrong[answer]


@pytest.mark.parametrize("task, digest", [
    ("probe/arith", "b6751902ee7a866ce5a8b4faa14fd45be6fea1b17db976df88749dc803be6433"),
    ("probe/recall", "160c81bbdf03ee8703f0881cb660c636a44ecec53643be2a4664c8d86cea10b8"),
])
def test_v1_data_stay_reproducible_under_their_names(task, digest):
    """v2 added a generator; the v1 names must keep producing the bytes and labels of the published runs."""
    h = hashlib.sha256()
    for i in range(40):
        _, (data, levels) = probe.episode(task, i)
        h.update(data)
        h.update(np.asarray(levels, np.int8).tobytes())
    assert h.hexdigest() == digest


def test_v2_arithmetic_layout_and_labels():
    """Fixed-width segments: the units digit of the plain sum carries the depth, ';' level 0, nothing else."""
    family, (data, levels) = probe.episode("probe-v2/arith", 0)
    text = data.decode()
    segments = text.rstrip(".").split(";")[:-1]
    assert family == "arith" and len(segments) == (probe.EPISODE_LEN - 1) // (probe.MAX_DEPTH + 5)
    for k, segment in enumerate(segments):
        slots, total = segment.split("=")
        operands = [int(c) for c in slots if c != probe.BLANK]
        assert len(slots) == probe.MAX_DEPTH + 1 and slots == slots.lstrip(probe.BLANK).rjust(len(slots), probe.BLANK)
        assert int(total) == sum(operands)
        start = k * (probe.MAX_DEPTH + 5)
        assert levels[start : start + probe.MAX_DEPTH + 5] == [-1] * (probe.MAX_DEPTH + 3) + [len(operands) - 1, 0]
    wrong = bytearray(data)
    wrong[text.index("=") + 1] = ord("9") if text[text.index("=") + 1] != "9" else ord("8")  # the tens digit
    with pytest.raises(ValueError, match="does not hold its sum"):
        probe.solve_episode("arith", bytes(wrong), "v2")


_INDICES = [i for i in range(60) if i % 3 != 2]  # arith and recall episodes: no corpus to load in the child


def _stream_digest(task: str) -> str:
    script = ("import hashlib, numpy as np; from datamodules.probe import episode; h = hashlib.sha256()\n"
              f"for i in {_INDICES}: f, (d, l) = episode({task!r}, i); h.update(d); h.update(np.asarray(l, np.int8).tobytes())\n"
              "print(h.hexdigest())")
    env = dict(os.environ, PYTHONHASHSEED="123", PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True,
                          cwd=REPO).stdout.strip()


def test_generator_is_identical_across_processes():
    h = hashlib.sha256()
    for i in _INDICES:
        _, (data, levels) = probe.episode("probe", i)
        h.update(data)
        h.update(np.asarray(levels, np.int8).tobytes())
    assert _stream_digest("probe") == h.hexdigest()


def test_cache_holds_labels_beside_tokens_and_is_rank_independent(tmp_path):
    dm = _datamodule(tmp_path / "a")
    folder = dm._folder(dm.corpus)
    assert {"tokens.bin", "meta.json", "levels.npy", "families.npy"} <= {p.name for p in folder.iterdir()}
    assert dm.vocab_size == 257
    tokens = np.asarray(dm.train_set.tokens)
    levels, families = probe.open_labels(folder, len(tokens))
    assert len(tokens) == SMALL and (tokens[:: probe.EPISODE_LEN] == 256).all()  # every episode opens with EOT
    assert set(np.unique(families)) == {0, 1, 2} and levels.max() == probe.MAX_DEPTH
    # another process (a DDP rank) building the same corpus writes byte-identical files
    other = _datamodule(tmp_path / "b")
    assert other._folder(other.corpus).name == folder.name
    for name in ("tokens.bin", "levels.npy", "families.npy"):
        assert (folder / name).read_bytes() == (other._folder(other.corpus) / name).read_bytes()


class _Trainer:
    def __init__(self, rank, world):
        self.global_rank, self.world_size = rank, world


def test_ddp_ranks_read_disjoint_shards_of_the_same_stream(tmp_path):
    batches = {}
    for rank in (0, 1):
        dm = _datamodule(tmp_path)
        dm.trainer = _Trainer(rank, 2)
        it = iter(dm.train_dataloader())
        batches[rank] = [next(it) for _ in range(3)]
    rows = lambda bs: {tuple(r.tolist()) for b in bs for r in b}  # noqa: E731
    assert not rows(batches[0]) & rows(batches[1])


def test_probe_datamodule_resumes_mid_epoch_exactly(tmp_path):
    dm = _datamodule(tmp_path, batch_size=4)  # ~60 training blocks: 15 batches per epoch
    it = iter(dm.train_dataloader())
    straight = [next(it) for _ in range(20)]  # crosses the epoch boundary
    resumed_dm = _datamodule(tmp_path, batch_size=4)
    resumed_dm.load_state_dict({"samples_consumed": 7 * 4})
    it = iter(resumed_dm.train_dataloader())
    for expected in straight[7:]:
        assert torch.equal(next(it), expected)


def test_unknown_probe_and_wrong_tokenizer_are_one_line_errors(tmp_path):
    with pytest.raises(DataError, match="valid datasets"):
        get_corpus("probe/nope")
    with pytest.raises(DataError, match="max_tokens"):
        get_corpus("probe", max_tokens=100)
    assert get_corpus("probe/arith").default_tokenizer == "bytes"
    from datamodules.tokenizer import TextTokenizer, train_bpe

    bpe = TextTokenizer(train_bpe(["the cat sat on the mat"] * 50, vocab_size=300), "bpe")
    with pytest.raises(DataError, match="bytes"):
        probe.byte_ids(bpe)


def test_labelled_blocks_drop_labels_whose_episode_started_before_the_block(tmp_path):
    dm = _datamodule(tmp_path, block_size=96)  # not a multiple of the episode length
    tokens, levels, _ = probe.labelled_blocks(dm, 8)
    assert tokens.shape == (len(levels), 97)
    starts = np.asarray(dm.val_sets["val"].indices[:8]) * 96
    for row, start in enumerate(starts):
        targets = np.arange(start + 1, start + 97)
        cut = targets - targets % probe.EPISODE_LEN < start
        assert (levels[row][cut] == probe.NO_LABEL).all()


# ---------------------------------------------------------------------------- per-difficulty compute
def _tiny(variant, block_size=16, vocab_size=64):
    from architectures import ModelConfig, build_model

    config = ModelConfig(variant=variant, d_model=32, n_layer=2, n_head=2, block_size=block_size,
                         vocab_size=257 if block_size > 16 else vocab_size)
    torch.manual_seed(0)
    return build_model(config).eval()


def test_per_difficulty_compute_from_a_hand_made_moe_trace():
    from architectures import flops as cost
    from callbacks.probe import stats_tensor, summarize, spearman, token_flops

    model = _tiny("moe")
    with torch.no_grad():
        trace = model(torch.zeros(1, 4, dtype=torch.long)).trace
    E = model.config.moe.num_experts
    for site in trace:  # hand-made routing: token 0 and 2 run one expert, 1 and 3 have theirs dropped
        site.selected = torch.tensor([[[0], [1], [E - 1], [2]]])
        site.dropped = torch.tensor([[[False], [True], [False], [True]]])
        site.weights = torch.ones(1, 4, 1)
    per_token = token_flops(model, trace, seq_len=4)
    d, T = 32, 4
    moe = [b.moe for b in model.blocks if hasattr(b, "moe")]
    dense = cost.lm_head(d, 64).forward + 2 * (cost.attention_projections(d) + cost.attention_scores(d, T))
    dense += sum(cost.linear(d, m.num_choices) for m in moe)
    dense += (2 - len(moe)) * cost.ffn(d, model.config.ffn_hidden)
    expert = sum(cost.ffn(d, m.hidden) for m in moe)
    assert per_token[0].tolist() == pytest.approx([dense + expert, dense, dense + expert, dense])
    tokens = {"level": np.array([0, 0, 4, 4]), "family": np.zeros(4, int), "loss": np.ones(4),
              "correct": np.array([1, 0, 1, 0]), "flops": per_token[0].numpy()}
    summary = summarize(stats_tensor(tokens, 1), spearman(tokens["level"], tokens["flops"]), ["arith"])
    assert summary["levels"]["0"]["flops"] == pytest.approx(dense + expert / 2)
    assert summary["levels"]["4"]["acc"] == 0.5 and summary["hard_token_share"] == 0.5
    assert summary["hard_compute_share"] == pytest.approx(0.5) and summary["spearman"] == pytest.approx(0.0)  # no correlation


def test_per_difficulty_compute_from_a_hand_made_mod_trace():
    from architectures import flops as cost
    from callbacks.probe import spearman, stats_tensor, summarize, token_flops

    model = _tiny("mod")
    with torch.no_grad():
        trace = model(torch.zeros(1, 8, dtype=torch.long)).trace
    routed = [s for s in trace if s.kind == "expert_choice"]
    assert routed
    for site in routed:  # the routed blocks process exactly the last four tokens (the hard ones)
        site.selected = torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]]).unsqueeze(-1)
    per_token = token_flops(model, trace, seq_len=8)[0]
    d = 32
    block = cost.attention_projections(d) + cost.attention_scores(d, 1) + cost.ffn(d, model.config.ffn_hidden)
    assert (per_token[4:] - per_token[:4]).tolist() == pytest.approx([len(routed) * block] * 4)
    levels = np.array([0, 0, 1, 1, 3, 3, 4, 4])
    tokens = {"level": levels, "family": np.zeros(8, int), "loss": np.zeros(8), "correct": np.ones(8),
              "flops": per_token.numpy()}
    summary = summarize(stats_tensor(tokens, 1), spearman(levels, tokens["flops"]), ["arith"])
    assert summary["spearman"] > 0.8 and summary["hard_token_share"] == 0.5
    assert summary["hard_compute_share"] > 0.5 and summary["hard_compute_ratio"] > 1


def test_per_block_counts_sum_to_the_pooled_accuracy(tmp_path):
    """The per-block (per validation sequence) counts the bootstrap resamples: summed over the blocks they are
    the pooled table, and each block's token counts are its labels'."""
    from callbacks.probe import evaluate_probe

    dm = _datamodule(tmp_path, tokens=4 * SMALL)  # at least 5 validation blocks
    summary = evaluate_probe(_tiny("mod", block_size=128), dm, blocks=5, batch_size=2)  # batches cut the blocks 2+2+1
    tokens, correct = np.asarray(summary["blocks"]["tokens"]), np.asarray(summary["blocks"]["correct"])
    assert tokens.shape == correct.shape == (5, probe.MAX_DEPTH + 1) and (correct <= tokens).all()
    for level, row in summary["levels"].items():
        assert tokens[:, int(level)].sum() == row["tokens"]
        assert correct[:, int(level)].sum() / tokens[:, int(level)].sum() == pytest.approx(row["acc"], abs=1e-12)
    _, levels, _ = probe.labelled_blocks(dm, 5)
    for block in range(5):
        assert tokens[block].tolist() == [int((levels[block] == k).sum()) for k in range(probe.MAX_DEPTH + 1)]


def test_depth_gate_compute_is_the_depth_its_gate_reads():
    from callbacks.probe import token_flops

    model = _tiny("depth_gate")
    with torch.no_grad():
        trace = model(torch.zeros(1, 2, dtype=torch.long)).trace
    site = trace[0]
    site.selected = torch.arange(2).expand(1, 2, 2)
    site.weights = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])  # token 0 reads layer 0, token 1 the last layer
    full = model.flops_per_token(trace, 2)
    per_token = token_flops(model, trace, seq_len=2)[0]
    layers = full.attn_proj + full.attn_scores + full.ffn
    assert per_token.tolist() == pytest.approx([full.forward - layers / 2, full.forward])


def test_cli_run_on_probe_data_logs_per_difficulty_metrics(tmp_path, one_thread):
    from experiments.run import main
    from tests.conftest import TINY_RUN

    run_dir = main(["--data", "probe/arith", "--data.max_tokens", str(SMALL), "--data.cache_dir", str(tmp_path / "c"),
                    "--max_steps", "3", "--val_every", "3", "--log_dir", str(tmp_path), *TINY_RUN,
                    "--model.block_size", "128", "--callbacks.probe_blocks", "4", "--variant", "mod"])
    summary = json.loads((run_dir / "summary.json").read_text())
    metrics = summary["val_metrics"]
    assert {f"probe/level{d}/acc" for d in range(probe.MAX_DEPTH + 1)} <= set(metrics)
    assert all(0 <= metrics[f"probe/level{d}/acc"] <= 1 for d in range(probe.MAX_DEPTH + 1))
    assert metrics["probe/level4/flops"] > 0 and 0 < metrics["probe/hard_token_share"] < 1
    detail = json.loads((run_dir / "probe.json").read_text())
    assert detail["step"] == 3 and set(detail["families"]) == set(probe.FAMILIES)
    assert detail["families"]["arith"]["4"]["tokens"] == detail["levels"]["4"]["tokens"]


# ---------------------------------------------------------------------------- the experiment
@pytest.mark.slow
def test_probe_experiment_quick_writes_tables_plots_and_goals(tmp_path, one_thread):
    from experiments.repro import main

    common = ["--quick", "--steps", "20", "--seeds", "2", "--blocks", "4", "--variants", "vanilla,mod",
              "--dense_shapes", "1x32", "--threads", "1"]
    tail = ["--", "--data.cache_dir", str(tmp_path / "cache")]
    results = main(["probe", "--out", str(tmp_path / "programme"), *common, *tail])
    assert list(results["variants"]) == ["vanilla", "dense:1x32", "mod"] and len(results["runs"]) == 6
    mod, vanilla = results["variants"]["mod"], results["variants"]["vanilla"]
    assert mod["steps"] > vanilla["steps"]  # matched FLOPs: MoD's cheaper steps buy more of them
    assert mod["matched"] and vanilla["matched"] and vanilla["steps_seeds"] == [20, 20]
    for r in results["runs"]:  # each run stopped at the first step whose measured count reached the budget
        assert results["budget"] <= r["train_flops"] and r["measured_deviation"] >= 0
        assert r["train_time_s"] == pytest.approx(r["step_time_s"] * r["steps"])
        assert r["wall_measured"] and r["wall_s"] >= r["train_time_s"]  # the run's process: start-up, steps, validation
    assert abs(mod["planned_deviation"]) < 0.05 and len(mod["spearman_seeds"]) == 2
    assert vanilla["spearman_seeds"] == [None, None]  # dense compute has no rank correlation
    dense = {v: a["headline_val_loss"][0] for v, a in results["variants"].items() if a["dense"]}
    assert results["best_dense"] == min(dense, key=dense.get) and set(results["tests"]["loss"]) == {"mod"}
    for level, row in mod["levels"].items():  # the hierarchical interval holds the seed mean; solved shares
        assert row["acc_ci"][0] <= row["acc"][0] <= row["acc_ci"][1] and len(row["acc_seeds"]) == 2
        assert row["solved_share"] == sum(a >= 0.9 for a in row["acc_seeds"]) / 2
    assert "spearman_positive_significant" in results["goals"] and "beats_best_dense_loss" in results["goals"]
    out = tmp_path / "programme"
    report = (out / "results.md").read_text()
    assert "Accuracy per difficulty level" in report and "| mod |" in report and "Δ loss vs best dense" in report
    walls = {v: sum(r["wall_s"] for r in results["runs"] if r["variant"] == v) for v in results["variants"]}
    for v, total in walls.items():  # the wall time per part: each entry's runs summed, from their summaries
        assert f"| {v} | 2 | {total:,.0f} |" in report
    assert "Wall time per part" in report and "Wall time of this invocation per part: planning" in report
    assert_rows_name_their_origin(results["runs"], report)
    for name in ("probe_accuracy.png", "probe_compute.png", "results.json"):
        assert (out / name).stat().st_size > 1000
    # --verify against this table: the row retrained from nothing gives the published numbers again, exactly
    check = main(["probe", "--out", str(tmp_path / "verify"), *common, "--verify", "mod", "--published",
                  str(out / "results.json"), *tail])
    assert {r["run_dir"] for r in results["runs"]}.isdisjoint(r["run_dir"] for r in check["runs"])  # retrained
    for figure in check["figures"]:
        if figure["figure"] != "train time s":  # wall clock is measured, not computed
            assert figure["this_run"] == figure["published"] and figure["inside_published_ci"] in (True, None)
    assert "| acc L0 |" in (tmp_path / "verify" / "results.md").read_text()
    # published into the repository (experiments.repro.publish): the run records rebuild the same tables
    from experiments.repro.publish import publish

    publish(out, tmp_path / "docs")
    main(["probe", "--out", str(tmp_path / "rebuilt"), "--tables_from", str(tmp_path / "docs" / "results.json")])
    assert _report_tables(tmp_path / "rebuilt" / "results.md") == _report_tables(out / "results.md")
    assert _run_table(tmp_path / "rebuilt" / "results.md") == _run_table(out / "results.md") != ""  # from the records
    origin = [[line for line in (d / "results.md").read_text().splitlines() if line.startswith(("Code the", "CPUs the"))]
              for d in (out, tmp_path / "rebuilt")]
    assert origin[0] == origin[1] and len(origin[0]) == 2  # the code and the CPU of every run survive publishing
    published = json.loads((tmp_path / "docs" / "results.json").read_text())["runs"]
    assert len(published) == 6 and all((tmp_path / "docs" / r["run_dir"] / "probe.json").is_file() for r in published)


def _published(path, **settings) -> pathlib.Path:
    """A hand-made published table: one row, the settings of the quick command below."""
    base = {"experiment": "probe", "size": "tiny", "steps": 20, "seed": 1337, "seeds": 2, "blocks": 4, "quick": True,
            "run_options": []}
    row = {"headline_val_loss": [4.5, 0.01], "headline_val_loss_ci": [4.4, 4.6],
           "levels": {"2": {"acc": [0.3, 0.1], "acc_ci": [0.0, 0.01], "solved_share": 0.0}}}
    path.write_text(json.dumps({"settings": {**base, **settings}, "variants": {"mod": row}}))
    return path


@pytest.mark.slow
def test_verify_reports_each_figure_beside_the_published_one_and_repeats_bit_identically(tmp_path, one_thread):
    from architectures.config import ConfigError
    from experiments.repro import main

    published = _published(tmp_path / "published.json")
    common = ["--quick", "--steps", "20", "--seeds", "2", "--blocks", "4", "--threads", "1", "--verify", "mod",
              "--published", str(published)]
    tail = ["--", "--data.cache_dir", str(tmp_path / "cache")]  # where the data are cached changes no number
    first = main(["probe", "--out", str(tmp_path / "a"), *common, *tail])
    second = main(["probe", "--out", str(tmp_path / "b"), *common, *tail])
    figures = {f["figure"]: f for f in first["figures"]}
    loss = figures["val loss (causal where present)"]
    assert loss["published"] == [4.5, 4.4, 4.6] and loss["inside_published_ci"] == (4.4 <= loss["this_run"][0] <= 4.6)
    assert loss["this_run"][0] == pytest.approx(statistics.fmean(first["variants"]["mod"]["headline_val_loss_seeds"]))
    assert figures["acc L3"]["published"] == [None, None, None] and figures["acc L3"]["inside_published_ci"] is None
    report = (tmp_path / "a" / "results.md").read_text()
    assert "| val loss (causal where present) | 4.5000 [4.4000, 4.6000] |" in report
    # the same command on the same machine and thread count: bit-identical numbers (wall clock aside)
    assert [(f["figure"], f["this_run"]) for f in first["figures"] if f["figure"] != "train time s"] == \
        [(f["figure"], f["this_run"]) for f in second["figures"] if f["figure"] != "train time s"]
    assert first["variants"]["mod"]["headline_val_loss_seeds"] == second["variants"]["mod"]["headline_val_loss_seeds"]
    with pytest.raises(ConfigError, match="is not empty"):  # from nothing: a used folder is refused
        main(["probe", "--out", str(tmp_path / "a"), *common, *tail])
    with pytest.raises(ConfigError, match="steps is 30, the published table's .* is 20"):
        main(["probe", "--out", str(tmp_path / "c"), *common, "--steps", "30", *tail])
    with pytest.raises(ConfigError, match="no row 'moe'.*rows: mod"):
        main(["probe", "--out", str(tmp_path / "c"), *common[:-4], "--verify", "moe", "--published", str(published), *tail])
    assert not (tmp_path / "c").exists()


def test_verify_refuses_another_kernel_path_than_the_published_runs_before_training(tmp_path, monkeypatch):
    """A published table records its runs' kernels; --verify on another path (here: the variable that pins it
    set differently) would move the figures like a seed does: refused in one line naming what to export."""
    from analysis.provenance import kernels
    from architectures.config import ConfigError
    from experiments.repro import main

    published = _published(tmp_path / "published.json")
    table = json.loads(published.read_text())
    theirs = kernels()
    theirs["environment"] = {**theirs["environment"], "MKL_CBWR": "AVX2"}
    monkeypatch.delenv("MKL_CBWR", raising=False)
    published.write_text(json.dumps({**table, "provenance": {"kernels": theirs}}))
    with pytest.raises(ConfigError, match="kernel environment .*export .*MKL_CBWR=AVX2"):
        main(["probe", "--out", str(tmp_path / "v"), "--quick", "--steps", "20", "--seeds", "2", "--blocks", "4",
              "--threads", "1", "--verify", "mod", "--published", str(published)])
    assert not (tmp_path / "v").exists()  # nothing trained, nothing written
    monkeypatch.setenv("MKL_CBWR", "AVX2")  # the same path: accepted (the check passes; training is the slow test's)
    from experiments.repro.common import check_kernels
    check_kernels({"provenance": {"kernels": kernels()}}, published)


BOUNCE = REPO / "docs" / "results" / "probe_bounce"


def _report_tables(path: pathlib.Path) -> str:
    """results.md from its "Budget" paragraph to the runs' origin lines or the invocation's own wall-time line
    (tables, tests, goals; a report written before runs recorded their CPU has no CPU line)."""
    text = path.read_text()
    start = text.index("\nBudget ")
    ends = [i for marker in ("\nCode the runs", "\nCPUs the runs", "\nWall time of this invocation")
            if (i := text.find(marker, start)) >= 0]
    return text[start:min(ends)]


def _rebuilt(out: pathlib.Path, published: pathlib.Path, *sources: pathlib.Path):
    """The programme's report rebuilt into ``out`` (``--tables_from``) from the stored rows of ``sources`` (published
    folders; ``published`` itself by default), its tables checked against ``published``'s results.md to the
    character; the rebuilt results."""
    from experiments.repro import main

    files = ",".join(str(folder / "results.json") for folder in sources or (published,))
    results = main(["probe", "--out", str(out), "--tables_from", files])
    assert _report_tables(out / "results.md") == _report_tables(published / "results.md")
    return results


def test_the_published_bounce_tables_rebuild_from_their_stored_rows(tmp_path):
    """The repository keeps each published probe table's run rows (results.json): the programme rebuilds its
    tables, tests and goal lines from them, without the run folders, to the character."""
    results = _rebuilt(tmp_path / "rebuilt", BOUNCE)
    published = json.loads((BOUNCE / "results.json").read_text())
    assert json.loads(json.dumps(results["tests"])) == published["tests"]
    assert (tmp_path / "rebuilt" / "probe_accuracy.png").is_file()
    # its dense shapes (4 x 64, 1 x 64, 8 x 64) have one width at the best one's depth: the report says so
    assert results["dense_grid"] == "not bracketed: only one shape tried (over the widths at n_layer=1)"
    assert ("Dense grid: the best dense model is dense:1x64, not bracketed"
            in (tmp_path / "rebuilt" / "results.md").read_text())
    # the hard and answer levels the text names are the runs' own (unchanged here; probe-v7/shift's: "level 1")
    assert ("share of tokens on levels 3-4; 'answers only': the correlation over the tokens of levels 1-4;"
            in (tmp_path / "rebuilt" / "results.md").read_text())


def _run_table(path: pathlib.Path) -> str:
    """results.md's run table (``## Runs``) to its end, or '' where it has none."""
    text = path.read_text()
    return text[text.index("## Runs"):] if "## Runs" in text else ""


def test_a_rebuilt_report_has_the_run_table_of_its_records_or_says_which_one_is_missing(tmp_path):
    """--tables_from puts the published records (each row's run_dir, beside its report) into the rebuilt report's
    run table: the table ``experiments.compare`` gives over those records. Without every row's folder there is no
    table (a table of some rows would read as the whole), and a line names the first one missing."""
    import shutil

    from analysis import compare
    from experiments.repro import main

    folder = REPO / "docs" / "results" / "probe"
    rows = json.loads((folder / "results.json").read_text())["runs"]
    main(["probe", "--out", str(tmp_path / "rebuilt"), "--tables_from", str(folder / "results.json")])
    board = compare.leaderboard(compare.read_runs([folder / r["run_dir"] for r in rows]))
    assert compare.to_markdown(board) in _run_table(tmp_path / "rebuilt" / "results.md")
    assert (tmp_path / "rebuilt" / "leaderboard.csv").is_file()

    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    shutil.rmtree(copy / rows[3]["run_dir"])
    main(["probe", "--out", str(tmp_path / "partial"), "--tables_from", str(copy / "results.json")])
    text = (tmp_path / "partial" / "results.md").read_text()
    assert _run_table(tmp_path / "partial" / "results.md") == "" and not (tmp_path / "partial" / "leaderboard.csv").exists()
    assert (f"No run table: 1 of the 20 rows' run folders are not here (first {rows[3]['variant']} seed "
            f"{rows[3]['seed']} ({rows[3]['run_dir']}))") in text
    main(["probe", "--out", str(tmp_path / "bounce"), "--tables_from", str(BOUNCE / "results.json")])
    assert "No run table: 25 of the 25 rows' run folders are not here" in (tmp_path / "bounce" / "results.md").read_text()
    # a row that names another loss, variant or parameter count than the record at its path is not that record's
    shutil.copytree(folder / "runs", copy / "runs", dirs_exist_ok=True)
    changed = [dict(row) for row in rows]
    for key in ("headline_val_loss", "val_loss"):  # probe rows hold no final_val_loss
        changed[5][key] += 1e-6
    changed[6]["registry_variant"] = "mod" if changed[6]["registry_variant"] != "mod" else "vanilla"
    changed[7]["parameters"] = changed[7].get("parameters", 0) + 1
    (copy / "results.json").write_text(json.dumps({**json.loads((folder / "results.json").read_text()), "runs": changed}))
    main(["probe", "--out", str(tmp_path / "changed"), "--tables_from", str(copy / "results.json")])
    assert "No run table: 3 of the 20 rows' run folders are not here" in (tmp_path / "changed" / "results.md").read_text()


def test_a_rebuilt_reports_run_table_takes_a_relative_out_and_only_the_rows_own_runs(tmp_path, monkeypatch):
    """A programme run with a relative --out stores run_dir relative to where it ran (here: ``out/p/runs/...`` from
    tmp_path), and the rebuild finds them from there; a folder at a row's path that holds another run (two seeds'
    version folders swapped) is not that row's, so there is no table."""
    import shutil

    from analysis import compare
    from experiments.repro import main

    folder = REPO / "docs" / "results" / "probe"
    results = json.loads((folder / "results.json").read_text())
    shutil.copytree(folder / "runs", tmp_path / "out" / "p" / "runs")
    for row in results["runs"]:  # as the programme wrote them, before publish
        row["run_dir"] = f"out/p/{row['run_dir']}"
        del row["run_dir_trained"]
    (tmp_path / "out" / "p" / "results.json").write_text(json.dumps(results))
    monkeypatch.chdir(tmp_path)
    main(["probe", "--out", "rebuilt", "--tables_from", "out/p/results.json"])
    board = compare.leaderboard(compare.read_runs([folder / r["run_dir"][len("out/p/"):] for r in results["runs"]]))
    assert compare.to_markdown(board) in _run_table(tmp_path / "rebuilt" / "results.md")
    a, b = (tmp_path / results["runs"][i]["run_dir"] for i in (0, 1))  # two seeds of one entry
    a.rename(tmp_path / "swap")
    b.rename(a)
    (tmp_path / "swap").rename(b)
    main(["probe", "--out", "swapped", "--tables_from", "out/p/results.json"])
    assert _run_table(tmp_path / "swapped" / "results.md") == ""
    assert "No run table: 2 of the 20 rows' run folders are not here" in (tmp_path / "swapped" / "results.md").read_text()


INDUCT_ROUTED = REPO / "docs" / "results" / "probe_induct_routed"


def test_the_preregistered_routed_comparison_on_induct_rebuilds_and_no_routed_entry_beats_the_best_dense(tmp_path):
    """docs/results/probe_induct_routed (docs/results/preregistered/probe_induct_routed.md: dense 1x64 / 2x64 / 4x64,
    MoD 4 layers at capacity 0.125 and depth_gate_skip at matched measured FLOPs, seeds 1352-1356): the stored rows
    give the committed tables, tests and goal lines, and the plan's verdicts. Primary: neither routed entry's loss is
    below the best dense model's (4x64) after Holm over the two. The level-1 accuracy test does not apply (the best
    dense model does not solve level 1: mean < 0.6). Seeds solving level 1: MoD 2/5, depth_gate_skip 1/5, every
    dense shape 0/5."""
    results = _rebuilt(tmp_path / "rebuilt", INDUCT_ROUTED)
    tests = results["tests"]
    assert tests["best_dense"] == "dense:4x64"
    routed = ("mod:n_layer=4:capacity=0.125", "depth_gate_skip")
    assert all(tests["loss"][e]["difference"] < 0 and tests["loss"][e]["p_holm"] > 0.05 for e in routed)
    assert results["goals"]["beats_best_dense_loss"] == []
    levels = {name: row["levels"]["1"] for name, row in results["variants"].items()}
    assert levels["dense:4x64"]["acc"][0] < 0.6  # the secondary test's condition is not met
    solved = {name: sum(a >= 0.9 for a in level["acc_seeds"]) for name, level in levels.items()}
    assert solved == {"vanilla": 0, "dense:1x64": 0, "dense:4x64": 0, routed[0]: 2, routed[1]: 1}
    assert {r["code"] for r in results["runs"]} == {"3eea67a6b3"}  # the commit the plan names


INDUCT_ROUTED_MORE = REPO / "docs" / "results" / "probe_induct_routed_more"


def test_the_preregistered_extension_on_induct_rebuilds_and_no_routed_entry_of_seven_beats_the_best_dense(tmp_path):
    """docs/results/probe_induct_routed_more (docs/results/preregistered/probe_induct_routed_more.md): the routed
    comparison's 25 runs plus MoD 8 layers at 0.125, MoD 4 layers at 0.25, mode_staged, moe and mom_e (25 runs at
    0c5766c). Primary: no entry's loss is below the best dense model's (still 4x64) after Holm over all seven, and the
    two earlier entries' verdicts (Holm over two, p 0.323) do not change. Seeds solving level 1: none of the new
    entries but MoD at capacity 0.25 (1/5). MoD with 8 layers gives level 1 less compute than level 0 in every seed."""
    results = _rebuilt(tmp_path / "rebuilt", INDUCT_ROUTED_MORE)
    tests = results["tests"]
    assert tests["best_dense"] == "dense:4x64"
    assert len(tests["loss"]) == 7 and all(row["p_holm"] > 0.05 for row in tests["loss"].values())
    assert results["goals"]["beats_best_dense_loss"] == []
    earlier = json.loads((INDUCT_ROUTED / "results.json").read_text())
    for entry, row in earlier["tests"]["loss"].items():  # the shared runs: the same differences and raw p-values
        assert (tests["loss"][entry]["difference"], tests["loss"][entry]["p"]) == (row["difference"], row["p"])
    levels = {name: row["levels"]["1"] for name, row in results["variants"].items()}
    solved = {name: sum(a >= 0.9 for a in level["acc_seeds"]) for name, level in levels.items()}
    assert solved == {"vanilla": 0, "dense:1x64": 0, "dense:4x64": 0, "mod:n_layer=4:capacity=0.125": 2,
                      "depth_gate_skip": 1, "mod:n_layer=8:capacity=0.125": 0, "mod:n_layer=4:capacity=0.25": 1,
                      "mode_staged:n_layer=4": 0, "moe": 0, "mom_e:n_layer=4": 0}
    assert max(results["variants"]["mod:n_layer=8:capacity=0.125"]["spearman_seeds"]) < 0
    assert {r["code"] for r in results["runs"]} == {"3eea67a6b3", "0c5766c7bc"}  # the two commits the plans name


HALTING_REPLICATION = REPO / "docs" / "results" / "probe_bounce_halting_replication"


def test_the_preregistered_halting_replication_rebuilds_and_early_exit_grades_the_answers_again(tmp_path):
    """docs/results/probe_bounce_halting_replication (docs/results/preregistered/probe_bounce_halting_replication.md:
    probe-v5/bounce at 4,000 reference steps, new seeds 1362-1366, an Intel Xeon where the first sample trained on an
    AMD EPYC; vanilla, dense 1x64 and 1x32, recur_halt, early_exit; 25 runs at 37c5b98): the stored rows give the
    committed tables, tests and goal lines, and the plan's verdict. Primary: early_exit's answers-only Spearman is
    positive in every seed and its one-sided t-test passes Holm over the two routed entries (replicated). Also: ACT's
    answers-only test does not pass (it leans negative here), and neither routed entry's loss is below the best dense
    model's (1x32); ACT's loss is above it by a bootstrap interval just clear of 0 (reported without a verdict)."""
    results = _rebuilt(tmp_path / "rebuilt", HALTING_REPLICATION)
    exit_, act = results["variants"]["early_exit"], results["variants"]["recur_halt"]
    assert min(exit_["spearman_answers_seeds"]) > 0 and exit_["spearman_answers_t_p_holm"] < 0.05  # the verdict
    assert act["spearman_answers_t_p_holm"] > 0.05 and sum(r > 0 for r in act["spearman_answers_seeds"]) == 1
    assert results["goals"]["families_grading_answers"] == ["early_exit"]
    tests = results["tests"]
    assert tests["best_dense"] == "dense:1x32" and results["goals"]["beats_best_dense_loss"] == []
    assert tests["loss"]["recur_halt"]["ci_low"] > 0  # ACT above the best dense model, its interval clear of 0
    assert {r["code"] for r in results["runs"]} == {"37c5b98f50"}  # the commit that added the plan
    assert {r["seed"] for r in results["runs"]} == set(range(1362, 1367)) and len(results["runs"]) == 25


HALTING_EARLY = REPO / "docs" / "results" / "probe_bounce_halting_early"
HALTING_MERGED = REPO / "docs" / "results" / "probe_bounce_halting_merged"


def test_the_halting_replications_extension_merges_and_no_early_decision_grades_the_answers(tmp_path):
    """docs/results/probe_bounce_halting_early (docs/results/preregistered/probe_bounce_halting_replication_early.md:
    mor and MoD 8 layers at capacity 0.125 at the replication's seeds, CPU and settings, the reference and 1x64
    retrained at d9bd1d3): its stored rows give its committed tables; merged with the replication's (the retrained
    vanilla and 1x64 runs bit for bit the replication's, or the merge is refused) they give the committed merged tables.
    The plan's verdict: with Holm over the four routed entries, neither early decision's answers-only test passes (the
    "only" holds on this sample), and early exit's still does."""
    own = _rebuilt(tmp_path / "own", HALTING_EARLY)
    assert {r["code"] for r in own["runs"]} == {"d9bd1d3d49"} and len(own["runs"]) == 20
    merged = _rebuilt(tmp_path / "merged", HALTING_MERGED, HALTING_REPLICATION, HALTING_EARLY)
    answers = {name: row["spearman_answers_t_p_holm"] for name, row in merged["variants"].items()
               if row.get("spearman_answers_t_p_holm") is not None}
    assert set(answers) == {"recur_halt", "early_exit", "mor", "mod:n_layer=8:capacity=0.125"}
    assert answers["early_exit"] < 0.05 and all(p > 0.05 for name, p in answers.items() if name != "early_exit")
    assert merged["goals"]["families_grading_answers"] == ["early_exit"]
    assert max(merged["variants"]["mod:n_layer=8:capacity=0.125"]["spearman_seeds"]) < 0  # all labelled: every seed


HALTING_REST = REPO / "docs" / "results" / "probe_bounce_halting_rest"
SECOND_SAMPLE = REPO / "docs" / "results" / "probe_bounce_second_sample"
SECOND_BRACKET = REPO / "docs" / "results" / "probe_bounce_second_sample_bracket"


def test_the_second_sample_completed_merges_and_both_halves_of_the_headline_hold_on_it(tmp_path):
    """docs/results/probe_bounce_halting_rest (docs/results/preregistered/probe_bounce_halting_replication_rest.md:
    mode_staged, mom_e, moe, depth_gate_skip, mor_token and MoD 8 layers at capacity 0.25 at the replication's seeds,
    CPU and settings, 30 runs at 1fbf8c6; the reference vanilla and 1x64 reused from the extension's runs at d9bd1d3):
    its stored rows give its committed tables; merged with the replication's and the extension's they give the
    committed tables of the whole second sample (probe_bounce_second_sample: the ten routed entries of the first
    sample, and six dense shapes since the pre-registered bracket below). The plan's verdicts, Holm over the ten (the
    correction counts the entries with a test: six for the answers' grading): early exit's answers-only test passes
    and no other entry's does (four have no test: every answer token gets the same compute in all or all but one
    seed), and no routed entry's loss is below the best dense model's (1x32)."""
    own = _rebuilt(tmp_path / "own", HALTING_REST)
    assert len(own["runs"]) == 40 and {r["seed"] for r in own["runs"]} == set(range(1362, 1367))
    reference = [r["variant"] in ("vanilla", "dense:1x64") for r in own["runs"]]
    assert {r["code"] for r, reused in zip(own["runs"], reference) if reused} == {"d9bd1d3d49"}  # not retrained
    assert {r["code"] for r, reused in zip(own["runs"], reference) if not reused} == {"1fbf8c6582"}
    merged = _rebuilt(tmp_path / "merged", SECOND_SAMPLE, HALTING_REPLICATION, HALTING_EARLY, HALTING_REST,
                      SECOND_BRACKET)
    routed = {name: row for name, row in merged["variants"].items() if not row.get("dense")}
    assert len(routed) == 10 and merged["tests"]["best_dense"] == "dense:1x32"
    answers = {name: row.get("spearman_answers_t_p_holm") for name, row in routed.items()}
    assert answers["early_exit"] < 0.05 and all(p is None or p > 0.05 for n, p in answers.items() if n != "early_exit")
    assert {n for n, p in answers.items() if p is None} == {"mom_e", "moe", "depth_gate_skip", "mor_token"}
    raw = routed["early_exit"]["spearman_answers_t_p"]
    assert answers["early_exit"] == pytest.approx(6 * raw)  # Holm's m is the six entries with a test, not ten
    assert merged["goals"]["families_grading_answers"] == ["early_exit"]
    assert merged["goals"]["beats_best_dense_loss"] == [] and len(merged["tests"]["loss"]) == 10
    assert all(row["ci_low"] > 0 for row in merged["tests"]["loss"].values())  # every routed loss above 1x32's
    assert max(routed["mode_staged"]["spearman_answers_seeds"]) < 0  # MoDE: less compute the harder, every seed
    assert_second_sample_brackets_its_best_dense_model(merged)


def test_the_second_samples_dense_bracket_rebuilds_and_brackets_its_best_dense_model(tmp_path):
    """docs/results/probe_bounce_second_sample_bracket (docs/results/preregistered/
    probe_bounce_second_sample_dense_bracket.md: dense 1x24, 1x48 and 2x32 at the second sample's seeds, CPU and
    settings, 15 runs at 78a217b; the reference vanilla reused from d9bd1d3): its stored rows give its committed
    tables. The plan's verdict is checked on the merged second sample by the test above
    (``assert_second_sample_brackets_its_best_dense_model``): the best dense model stays 1x32 and the grid brackets
    it, over the widths at one layer (1x24 and 1x48 worse, and 1x64) and over the depths at d = 32 by the floor (2x32
    worse, and no model has fewer layers than one)."""
    own = _rebuilt(tmp_path / "own", SECOND_BRACKET)
    assert len(own["runs"]) == 20 and {r["seed"] for r in own["runs"]} == set(range(1362, 1367))
    reused = [r["variant"] == "vanilla" for r in own["runs"]]
    assert {r["code"] for r, old in zip(own["runs"], reused) if old} == {"d9bd1d3d49"}  # not retrained
    assert {r["code"] for r, old in zip(own["runs"], reused) if not old} == {"78a217b721"}
    assert own["tests"]["best_dense"] == "dense:2x32"  # of its own dense shapes; 1x32 is in the merged report


def assert_second_sample_brackets_its_best_dense_model(merged: dict) -> None:
    """The bracket plan's verdict on the merged second sample."""
    assert merged["tests"]["best_dense"] == "dense:1x32"
    assert merged["dense_grid"] == ("bracketed (over the depths at d_model=32 by the floor, 1 layer, the fewest a "
                                    "model can have)")
    dense = {name: row["headline_val_loss"][0] for name, row in merged["variants"].items() if row.get("dense")}
    assert set(dense) == {"vanilla", "dense:1x64", "dense:1x32", "dense:1x24", "dense:1x48", "dense:2x32"}
    assert min(dense, key=dense.get) == "dense:1x32"
    # the loss half of the headline cannot turn on this sample: every routed mean is above the best dense model's
    assert merged["goals"]["beats_best_dense_loss"] == []
    assert all(row["difference"] > 0 for row in merged["tests"]["loss"].values())


MODE_THIRD = REPO / "docs" / "results" / "probe_bounce_mode_staged_third"


def test_the_preregistered_third_sample_does_not_support_mode_staged_grading_the_answers_negatively(tmp_path):
    """docs/results/probe_bounce_mode_staged_third (docs/results/preregistered/probe_bounce_mode_staged_third_sample.md:
    the reference vanilla and mode_staged at new seeds 1400-1404, the Intel Xeon, 10 runs at e1136a1): its stored rows
    give its committed tables. The plan's test: MoDE staged's answers-only Spearman (causal routing) over the seeds,
    one-sided t-test for a mean below 0, one hypothesis, p < 0.05 to support. Four seeds have a correlation (in the
    fifth every answer token got the same compute), three of them negative: p 0.068, **not supported**."""
    from experiments.repro.probe import one_sided_t

    own = _rebuilt(tmp_path / "own", MODE_THIRD)
    assert len(own["runs"]) == 10 and {r["seed"] for r in own["runs"]} == set(range(1400, 1405))
    assert {r["code"] for r in own["runs"]} == {"e1136a14a3"}  # the commit that added the plan
    rhos = own["variants"]["mode_staged"]["spearman_answers_seeds"]
    assert sum(r is None for r in rhos) == 1 and sum(r < 0 for r in rhos if r is not None) == 3
    p = one_sided_t(rhos, "less")
    assert p == pytest.approx(0.0677, abs=1e-4) and p >= 0.05  # the verdict: not supported
    # the programme's own test, for more compute on harder answers, is the other tail of the same test
    assert own["variants"]["mode_staged"]["spearman_answers_t_p"] == pytest.approx(1 - p)


def test_the_report_names_the_levels_its_runs_have():
    from experiments.repro.probe import level_span

    assert (level_span(3, 4), level_span(1, 7), level_span(1, 1)) == ("levels 3-4", "levels 1-7", "level 1")


def test_the_dense_grid_verdict_reads_the_reference_shape_from_the_stored_options(tmp_path):
    from experiments.repro.common import Context
    from experiments.repro.probe import dense_grid_verdict

    published = json.loads((BOUNCE / "results.json").read_text())
    ctx, settings = Context(out=tmp_path), published["settings"]
    rows, best = published["variants"], published["best_dense"]
    assert dense_grid_verdict(ctx, settings, rows, best) == published_verdict()
    # vanilla at 1 x 64 by its stored options: the best shape is then one of two at that depth, the wider
    one_layer = {**settings, "run_options": [*settings["run_options"], "--model.n_layer", "1", "--model.d_model", "32"]}
    assert dense_grid_verdict(ctx, one_layer, rows, best).startswith("not bracketed: the best is the largest shape")
    # options this code no longer parses: the verdict is unknown, the tables are not refused
    gone = {**settings, "run_options": ["--model.nope", "1"]}
    assert dense_grid_verdict(ctx, gone, rows, best).startswith("unknown (the stored run options do not parse here")


def published_verdict() -> str:
    return "not bracketed: only one shape tried (over the widths at n_layer=1)"


def _split(tmp_path, published, parts):
    paths = []
    for i, entries in enumerate(parts):
        path = tmp_path / f"part{i}.json"
        path.write_text(json.dumps({**published, "runs": [r for r in published["runs"] if r["variant"] in entries]}))
        paths.append(path)
    return paths


def test_tables_merged_from_two_invocations_equal_the_tables_of_one(tmp_path):
    """Two invocations at the same settings and budget (vanilla trained in both, the same runs) merge into the
    table one invocation of all their entries gives; a row stored twice with different numbers, or files of
    another budget, are refused with the entry, seed and field named."""
    from architectures.config import ConfigError
    from experiments.repro import main

    published = json.loads((BOUNCE / "results.json").read_text())
    a, b = _split(tmp_path, published, [("vanilla", "dense:1x64", "recur_halt"),
                                         ("vanilla", "dense:8x64", "mod:n_layer=8:capacity=0.125")])
    main(["probe", "--out", str(tmp_path / "merged"), "--tables_from", f"{a},{b}"])
    assert _report_tables(tmp_path / "merged" / "results.md") == _report_tables(BOUNCE / "results.md")
    assert "different CPUs" not in (tmp_path / "merged" / "results.md").read_text()
    # a part computed on another CPU: merged (its rows are other entries), with the warning in the report
    other_cpu = json.loads(b.read_text())
    other_cpu["provenance"] = {**other_cpu["provenance"],
                               "kernels": {**other_cpu["provenance"]["kernels"], "cpu": "Intel(R) Xeon(R) Processor"}}
    other_cpu["runs"] = [r for r in other_cpu["runs"] if r["variant"] != "vanilla"]
    c = tmp_path / "other_cpu.json"
    c.write_text(json.dumps(other_cpu))
    main(["probe", "--out", str(tmp_path / "mixed"), "--tables_from", f"{a},{c}"])
    report = (tmp_path / "mixed" / "results.md").read_text()
    assert "different CPUs (AMD EPYC, Intel(R) Xeon(R) Processor)" in report and "on Intel(R) Xeon(R) Processor;" in report
    # rows stored before runs recorded their CPU take their file's, where the programme that trained them wrote it
    mixed = json.loads((tmp_path / "mixed" / "results.json").read_text())
    assert {r["cpu"] for r in mixed["runs"] if r["variant"] == "vanilla"} == {"AMD EPYC"}
    assert {r["cpu"] for r in mixed["runs"] if r["variant"] == "dense:8x64"} == {"Intel(R) Xeon(R) Processor"}
    # ... and fed back in from a merged file (whose provenance names the merging machine) they keep what they had
    merged_on_intel = {**mixed, "provenance": other_cpu["provenance"],
                       "runs": [{k: v for k, v in r.items() if k != "cpu" or r["variant"] != "vanilla"} for r in mixed["runs"]]}
    (tmp_path / "merged_on_intel.json").write_text(json.dumps(merged_on_intel))
    again = main(["probe", "--out", str(tmp_path / "again"), "--tables_from", str(tmp_path / "merged_on_intel.json")])
    assert {r.get("cpu") for r in again["runs"] if r["variant"] == "vanilla"} == {None}
    assert "; 5 stored before runs recorded it (unknown)." in (tmp_path / "again" / "results.md").read_text()

    changed = json.loads(b.read_text())
    next(r for r in changed["runs"] if r["variant"] == "vanilla" and r["seed"] == 1338)["val_loss"] += 1e-6
    b.write_text(json.dumps(changed))
    with pytest.raises(ConfigError, match=r"vanilla seed 1338 is stored in .* with different val_loss: not the same run"):
        main(["probe", "--out", str(tmp_path / "refused"), "--tables_from", f"{a},{b}"])
    b.write_text(json.dumps({**published, "budget": published["budget"] * 2}))
    with pytest.raises(ConfigError, match=r"budget is .*; only runs of the same programme settings and budget"):
        main(["probe", "--out", str(tmp_path / "refused"), "--tables_from", f"{a},{b}"])


def test_settings_that_differ_only_in_the_progress_bar_are_one_programme(tmp_path):
    """``--trainer.enable_progress_bar`` changes what a run prints, not what it computes: --verify's settings check
    and --tables_from take a table stored with it as one stored without it; an option that changes results differs."""
    from architectures.config import ConfigError
    from experiments.repro import main
    from experiments.repro.common import check_settings, result_options

    quiet = ["--trainer.enable_progress_bar", "false", "--model.n_layer", "2", "--trainer.enable_progress_bar=true"]
    assert result_options(quiet) == ["--model.n_layer", "2"]
    check_settings({"steps": 5, "run_options": quiet}, {"steps": 5, "run_options": ["--model.n_layer", "2"]}, tmp_path)
    with pytest.raises(ConfigError, match=r"--verify: this command's run_options is \[\]"):
        check_settings({"run_options": quiet}, {"run_options": []}, tmp_path)
    published = json.loads((BOUNCE / "results.json").read_text())
    a, b = _split(tmp_path, published, [("vanilla", "dense:1x64", "recur_halt"),
                                         ("vanilla", "dense:8x64", "mod:n_layer=8:capacity=0.125")])
    stored = json.loads(b.read_text())
    options = stored["settings"].get("run_options", [])
    b.write_text(json.dumps({**stored, "settings": {**stored["settings"], "run_options": [*options, *quiet[:2]]}}))
    main(["probe", "--out", str(tmp_path / "merged"), "--tables_from", f"{a},{b}"])
    assert _report_tables(tmp_path / "merged" / "results.md") == _report_tables(BOUNCE / "results.md")
    b.write_text(json.dumps({**stored, "settings": {**stored["settings"], "run_options": [*options, *quiet[2:4]]}}))
    with pytest.raises(ConfigError, match=r"settings is .*; only runs of the same programme settings"):
        main(["probe", "--out", str(tmp_path / "refused"), "--tables_from", f"{a},{b}"])


def test_sweeps_accept_probe_datasets(capsys):
    from experiments import sweep

    jobs = sweep.main(["--grid", "data=probe,probe/recall", "--grid", "variant=vanilla,mod", "--launcher", "local",
                       "--dry_run", "--no_plan"])
    assert len(jobs) == 4 and any("probe/recall" in " ".join(job) for job in jobs)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _probe_ddp_worker(rank: int, world: int, port: int, cache: str, out: str) -> None:
    import torch.distributed as dist

    from callbacks.probe import distributed_summary

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        dm = LMDataModule(DataConfig(name="probe", max_tokens=SMALL, cache_dir=cache), block_size=128)
        dm.setup("validate")  # the parent prepared the cache, as Lightning's rank-0 prepare_data does
        summary = distributed_summary(_tiny("mod", block_size=128), dm, 3, rank, world, batch_size=2)
        if rank == 0:
            pathlib.Path(out).write_text(json.dumps(summary))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_process_probe_metrics_equal_one_process_over_all_blocks(tmp_path):
    import torch.multiprocessing as mp

    from callbacks.probe import evaluate_probe

    _datamodule(tmp_path)  # builds the cache once
    out = str(tmp_path / "summary.json")
    mp.start_processes(_probe_ddp_worker, args=(2, _free_port(), str(tmp_path), out), nprocs=2, join=True,
                       start_method="spawn")
    distributed = json.loads(pathlib.Path(out).read_text())
    single = evaluate_probe(_tiny("mod", block_size=128), _datamodule(tmp_path), blocks=3, batch_size=2)
    assert distributed["levels"].keys() == single["levels"].keys()
    for level, row in single["levels"].items():
        assert distributed["levels"][level]["tokens"] == row["tokens"]
        for key in ("loss", "acc", "flops", "compute_share"):
            assert distributed["levels"][level][key] == pytest.approx(row[key], rel=1e-5), (level, key)
    assert distributed["spearman"] == pytest.approx(single["spearman"], rel=1e-6, abs=1e-9)
    assert distributed["blocks"] == single["blocks"]  # gathered in block order


# ---------------------------------------------------------------------------- the comparison's goals and workers
def _aggregate(acc, rhos=(None, None, None), ps=(None, None, None), t_p=None, loss=(2.0, 2.0, 2.0), dense=False,
               variant=None, acc_seeds=None):
    """A per-entry aggregate as experiments.repro.probe.aggregate makes it, from seed values."""
    import statistics

    levels = {str(k): {"acc": (a, 0.0), "acc_seeds": list(acc_seeds.get(k, [a] * 3) if acc_seeds else [a] * 3)}
              for k, a in enumerate(acc)}
    return {"levels": levels, "dense": dense, "variant": variant, "spearman_seeds": list(rhos),
            "spearman_p_seeds": list(ps), "spearman_t_p": t_p, "spearman_answers_t_p": None,
            "headline_val_loss": (statistics.fmean(loss), None), "headline_val_loss_seeds": list(loss),
            "train_time_s": (1.0, 0.0)}


def _programme(**routed):
    """vanilla (the reference) and two dense controls, the best of them dense:2x64 (lowest loss), plus ``routed``."""
    return {"vanilla": _aggregate([1.0, 0.95, 0.7, 0.5, 0.2], loss=(2.0, 2.1, 2.05), dense=True, variant="vanilla"),
            "dense:2x64": _aggregate([1.0, 0.9, 0.65, 0.55, 0.2], loss=(1.9, 1.95, 1.92), dense=True, variant="vanilla",
                                     acc_seeds={2: [0.55, 0.65, 0.75], 3: [0.5, 0.55, 0.6]}),
            "dense:4x48": _aggregate([1.0, 0.9, 0.6, 0.4, 0.2], loss=(2.2, 2.3, 2.25), dense=True, variant="vanilla"),
            **routed}


def test_the_programme_tables_every_level_the_runs_logged_in_level_order():
    """``-- --data probe-v6/bounce --callbacks.probe_levels 8`` (or more levels): the accuracy and compute tables
    have a column per logged level, L10 after L9, not the five of probe-v2/arith."""
    from experiments.repro.probe import accuracy_table, table_levels

    per_variant = {"vanilla": _aggregate([1.0 - k / 20 for k in range(11)], dense=True, variant="vanilla")}
    assert table_levels(per_variant) == [str(k) for k in range(11)]
    header = accuracy_table(per_variant).splitlines()[0]
    assert header == "| entry | " + " | ".join(f"acc L{k}" for k in range(11)) + " |"


def test_goals_are_met_only_when_the_corrected_test_against_the_best_dense_model_passes():
    from experiments.repro.probe import dense_tests, goal_figures

    up, sig = (0.2, 0.3, 0.25), (1e-5, 1e-6, 1e-4)
    per_variant = _programme(
        # family mod: positive; lower loss than the best dense model in every seed; better L3
        mod=_aggregate([1.0, 0.9, 0.6, 0.8, 0.2], up, sig, 0.001, loss=(1.5, 1.55, 1.52), variant="mod",
                       acc_seeds={3: [0.8, 0.82, 0.78]}),
        **{"mod:n_layer=8": _aggregate([1.0, 0.9, 0.6, 0.56, 0.2], up, sig, 0.03, loss=(1.9, 2.0, 1.8), variant="mod",
                                       acc_seeds={3: [0.5, 0.6, 0.58]})},  # t p 0.03 -> Holm 0.06 (with moe's 0.03)
        mom=_aggregate([1.0, 0.96, 0.72, 0.6, 0.3], (0.2, -0.1, 0.3), sig, 0.001, loss=(1.91, 1.94, 1.93), variant="mom"),
        moe=_aggregate([1.0, 0.9, 0.71, 0.5, 0.2], up, (1e-5, 0.02, 1e-4), 0.03, loss=(2.5, 2.6, 2.55), variant="moe"))
    tests = dense_tests(per_variant)
    assert tests["best_dense"] == "dense:2x64" and set(tests["loss"]) == {"mod", "mod:n_layer=8", "mom", "moe"}
    loss = tests["loss"]
    from analysis import stats

    raw = {v: stats.welch_p(per_variant[v]["headline_val_loss_seeds"], [1.9, 1.95, 1.92], "less") for v in loss}
    assert {v: t["p_holm"] for v, t in loss.items()} == pytest.approx(stats.holm(raw))
    assert loss["mod"]["difference"] == pytest.approx(1.5233333 - 1.9233333, abs=1e-6) and loss["mod"]["hedges_g"] < -5
    # the reference vanilla is tested too (the second column)
    assert tests["loss_vs_reference"]["mod"]["difference"] == pytest.approx(1.5233333 - 2.05, abs=1e-6)
    # Holm over the four routed entries: 0.001 x 4, 0.001 x 3, then 0.03 x 2 for both of the others
    assert per_variant["mod:n_layer=8"]["spearman_t_p_holm"] == pytest.approx(0.06)
    assert per_variant["moe"]["spearman_t_p_holm"] == pytest.approx(0.06)
    goals = goal_figures(per_variant, tests)
    assert goals["learnable_met"] and goals["learnable"] == {"1": (0.95, 0.9), "2": (0.7, 0.6)}
    assert goals["spearman_positive_significant"] == {"mod": True, "mod:n_layer=8": False, "mom": False, "moe": False}
    assert goals["families_positive"] == ["mod"] and not goals["two_families_positive"]
    assert goals["beats_best_dense_loss"] == ["mod"]  # mod:n_layer=8's lower mean is within its seeds' spread
    # the best dense model solves L2 (0.65) but not L3 (0.55 < 0.6): the hardest level is L2, where its seeds spread
    # too widely for mom's and moe's higher means to pass
    assert goals["hardest_solvable_level"] == 2 and goals["best_routed"] == "mom" and goals["beats_best_dense"] == []
    assert goals["routed_at_least_dense"] == ["moe", "mom"]  # point estimates only, not a claim
    per_variant["dense:2x64"]["levels"]["3"]["acc"] = (0.6, 0.0)  # now it solves L3 too, where mod is better
    goals = goal_figures(per_variant, dense_tests(per_variant))
    assert goals["hardest_solvable_level"] == 3 and goals["beats_best_dense"] == ["mod"]


def test_the_one_sided_t_test_over_seeds_on_known_numbers_in_either_direction():
    """The seeds' one-sample t-test: mean 2, sd 1 over 3 seeds is t = 2 sqrt(3) on 2 degrees of freedom, one-sided
    p = (1 - t / sqrt(t^2 + 2)) / 2; the two directions' p-values sum to 1; no spread: the values' sign decides."""
    from experiments.repro.probe import one_sided_t

    t = 2 * 3 ** 0.5
    p = (1 - t / (t * t + 2) ** 0.5) / 2  # Student's t with 2 degrees of freedom, closed form
    assert one_sided_t([1.0, 2.0, 3.0]) == pytest.approx(p, rel=1e-9)
    assert one_sided_t([-1.0, -2.0, -3.0], "less") == pytest.approx(p, rel=1e-9)
    assert one_sided_t([1.0, 2.0, 3.0], "less") == pytest.approx(1 - p, rel=1e-9)
    assert one_sided_t([-0.3, -0.3], "less") == 0.0 and one_sided_t([-0.3, -0.3]) == 1.0
    assert one_sided_t([0.4, None, float("nan")]) is None  # one finite value: no test
    with pytest.raises(ValueError, match="alternative"):
        one_sided_t([1.0, 2.0], "two-sided")


def test_learnable_is_judged_on_the_levels_the_task_has():
    """A two-level task (probe-v7/shift, probe-v8/induct): L1's floor alone decides, not a missing L2 (which read as
    'not met' whatever the accuracy); a task without L1 or L2 is not called learnable."""
    from experiments.repro.probe import dense_tests, goal_figures

    two_levels = {"vanilla": _aggregate([1.0, 0.97], loss=(1.0, 1.1, 1.05), dense=True, variant="vanilla"),
                  "dense:1x64": _aggregate([1.0, 0.1], loss=(2.0, 2.1, 2.05), dense=True, variant="vanilla"),
                  "mod": _aggregate([1.0, 0.5], loss=(1.5, 1.6, 1.55), variant="mod")}
    goals = goal_figures(two_levels, dense_tests(two_levels))
    assert goals["learnable"] == {"1": (0.97, 0.9)} and goals["learnable_met"]
    two_levels["vanilla"]["levels"]["1"]["acc"] = (0.5, 0.0)
    assert not goal_figures(two_levels, dense_tests(two_levels))["learnable_met"]
    one_level = {"vanilla": _aggregate([1.0], dense=True, variant="vanilla"),
                 "mod": _aggregate([1.0], loss=(1.5, 1.6, 1.55), variant="mod")}
    goals = goal_figures(one_level, dense_tests(one_level))
    assert goals["learnable"] == {} and not goals["learnable_met"]


def test_the_chance_line_is_drawn_for_digit_answers_only(tmp_path):
    from experiments.repro.common import Context
    from experiments.repro.probe import answer_chance

    assert answer_chance(Context(out=tmp_path)) == 0.1  # the programme's default task, probe-v2/arith
    assert answer_chance(Context(out=tmp_path, run_options=["--data", "probe-v8/induct"])) is None
    assert answer_chance(Context(out=tmp_path, run_options=["--data", "probe-v6/bounce", "--data", "probe-v2/arith"])) == 0.1
    assert answer_chance(Context(out=tmp_path, run_options=["--data", "probe-v2/arith", "--data=probe-v7/shift"])) is None
    assert answer_chance(Context(out=tmp_path, run_options=["--data.name", "probe-v8/induct"])) is None  # --data's name



def test_the_figures_level_axis_says_what_the_runs_task_counts(tmp_path):
    """Every probe family names what its levels count (a new family cannot be added without it); a mixed probe or
    another corpus (a label file's levels) gets the plain word; the figures' axis follows the runs' own task."""
    import matplotlib.pyplot as plt

    from datamodules.probe import FAMILIES, LEVEL_MEANINGS, level_meaning
    from experiments.repro.common import Context
    from experiments.repro.probe import plot_accuracy

    assert set(LEVEL_MEANINGS) == set(FAMILIES)
    assert level_meaning("probe-v8/induct") == "difficulty level (0 = copy at a fixed position, 1 = induction copy)"
    assert level_meaning("probe-v3/hops") == "difficulty level (dependent lookups)"
    assert level_meaning("probe-v2") == level_meaning("text") == level_meaning(None) == "difficulty level"
    ctx = Context(out=tmp_path, run_options=["--data", "probe-v8/induct"])
    levels = {"0": {"acc": (1.0, 0.0)}, "1": {"acc": (0.5, 0.1)}}
    figures = []
    ctx.save_figure = lambda fig, name: figures.append(fig)
    plot_accuracy(ctx, {"vanilla": {"levels": levels}})
    assert figures[0].axes[0].get_xlabel() == level_meaning("probe-v8/induct")
    plt.close(figures[0])

def test_entries_name_variants_with_their_own_model_options_and_dense_shapes():
    from architectures.config import ConfigError, ModelConfig
    from experiments.repro.probe import default_dense_shapes, parse_entry, programme_entries

    entry = parse_entry("mod:n_layer=8:capacity=0.125")
    assert entry.variant == "mod" and entry.model == (("n_layer", "8"), ("mod.capacity", "0.125")) and not entry.dense
    assert entry.run_options() == ["--variant", "mod", "--model.n_layer", "8", "--model.mod.capacity", "0.125"]
    assert parse_entry("mode_staged:moe.top_k=2").model == (("moe.top_k", "2"),)
    assert parse_entry("dense:2x64").run_options() == ["--variant", "vanilla", "--model.n_layer", "2",
                                                       "--model.d_model", "64"]
    for bad, message in (("mod:colour=1", "is no option of mod"), ("mod:n_layer", "is not key=value"),
                         ("nope", "unknown 'nope'"), ("dense:2by64", "n_layer x d_model")):
        with pytest.raises(ConfigError, match=message):
            parse_entry(bad)
    assert default_dense_shapes(4, 64, 4) == [(2, 64), (4, 48), (2, 48), (8, 64)]
    base = ModelConfig(d_model=64, n_layer=4, n_head=4)
    labels = [e.label for e in programme_entries(["mod", "vanilla", "mom_e"], None, base)]
    assert labels == ["vanilla", "dense:2x64", "dense:4x48", "dense:2x48", "dense:8x64", "mod", "mom_e"]
    assert [e.label for e in programme_entries(["mod"], "4x64,2x32", base)] == ["vanilla", "dense:2x32", "mod"]
    with pytest.raises(ConfigError, match="multiples of n_head=4"):
        programme_entries(["mod"], "2x30", base)


def test_dense_controls_span_the_routed_entries_flops_per_token(tmp_path):
    """The default dense shapes cost less and more per token than the routed entries of the issue's list."""
    from experiments.repro.common import Context
    from experiments.repro.probe import parse_entry, plan_entries, prepare

    ctx = Context(out=tmp_path, steps=600)
    _, entries, budget, tokens, vocab = prepare(ctx, ["mod:n_layer=8:capacity=0.125", "mod:n_layer=8:capacity=0.25",
                                                      "mode_staged", "depth_gate_skip", "mom_e", "moe"], 5, 8, False, None)
    plan = {c.entry.label: c for c in plan_entries(ctx, entries, budget, tokens, vocab, 20)}
    dense = [c.flops_per_token for c in plan.values() if c.entry.dense]
    routed = [c.flops_per_token for c in plan.values() if not c.entry.dense]
    assert min(dense) < min(routed) and max(dense) > max(routed)
    assert plan["vanilla"].steps == 600 and parse_entry("dense:2x64") in [c.entry for c in plan.values()]


@pytest.mark.slow
def test_parallel_workers_train_the_same_runs_as_one_after_another(tmp_path, one_thread):
    from experiments.repro import main

    common = ["--quick", "--steps", "30", "--seeds", "2", "--blocks", "4", "--variants", "vanilla,mod", "--threads", "1",
              "--dense_shapes", "2x32"]  # the reference's own shape: no other dense control
    tail = ["--", "--data.cache_dir", str(tmp_path / "cache")]
    serial = main(["probe", "--out", str(tmp_path / "serial"), *common, *tail])
    parallel = main(["probe", "--out", str(tmp_path / "parallel"), "--jobs", "2", *common, *tail])
    assert len({r["run_dir"] for r in parallel["runs"]}) == 4  # every seed its own folder
    for a, b in zip(serial["runs"], parallel["runs"]):
        assert (a["variant"], a["seed"], a["steps"]) == (b["variant"], b["seed"], b["steps"])
        assert a["val_loss"] == pytest.approx(b["val_loss"], abs=1e-6) and a["train_flops"] == b["train_flops"]
    again = main(["probe", "--out", str(tmp_path / "parallel"), "--jobs", "2", *common, *tail])  # reused, not retrained
    assert [r["run_dir"] for r in again["runs"]] == [r["run_dir"] for r in parallel["runs"]]


def test_answers_only_correlation_separates_grading_from_telling_answers_from_format_tokens():
    from callbacks.probe import spearman, spearman_answers

    level = np.array([0, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    flat = np.array([1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2], dtype=float)  # more compute on every answer, no grading
    assert spearman(level, flat)["rho"] > 0.5 and spearman_answers(level, flat)["rho"] is None
    graded = np.array([1, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5], dtype=float)
    assert spearman_answers(level, graded)["rho"] == pytest.approx(1.0)
    inverse = np.array([1, 1, 1, 5, 5, 4, 4, 3, 3, 2, 2], dtype=float)
    assert spearman(level, inverse)["rho"] > 0 and spearman_answers(level, inverse)["rho"] == pytest.approx(-1.0)


def test_a_runs_wall_time_is_its_process_time_or_for_resumed_and_older_runs_a_marked_lower_bound():
    from analysis.wall_time import run_wall_seconds, wall_time_lines

    assert run_wall_seconds({"run_seconds": 12.5, "step_times_s": [[1, 1.0]]}) == (12.5, True)
    assert run_wall_seconds({"run_seconds": 12.5, "train_started_at_steps": [0]}) == (12.5, True)
    # resumed from a checkpoint that carried the clock: every process is in run_seconds
    resumed = {"run_seconds": 12.5, "train_started_at_steps": [0, 4000]}
    assert run_wall_seconds({**resumed, "run_seconds_complete": True}) == (12.5, True)
    # resumed from an older checkpoint, or a summary from before run_seconds_complete: its last process's only
    assert run_wall_seconds({**resumed, "run_seconds_complete": False}) == (12.5, False)
    assert run_wall_seconds(resumed) == (12.5, False)
    assert run_wall_seconds({"seconds_to_first_step": 3.0, "step_times_s": [[1, 0.5], [2, 1.5]]}) == (2.0, False)
    assert run_wall_seconds({"seconds_to_first_step": 3.0}) == (None, False)
    rows = [{"variant": "a", "wall_s": 10.0, "wall_measured": True}, {"variant": "a", "wall_s": 30.0, "wall_measured": True},
            {"variant": "b", "wall_s": 5.0, "wall_measured": False}]
    lines = wall_time_lines(rows, lambda r: r["variant"], workers=2)
    assert "| a | 2 | 40 | 20 |" in lines and "| b | 1 | >= 5 | >= 5 |" in lines
    assert "45 s summed, about 22 s at 2 at once" in lines[0] and "a resumed run:" not in lines[0]
    assert wall_time_lines([{"variant": "a"}], lambda r: r["variant"], workers=2) == []  # stored before: no table
    older = wall_time_lines([*rows, {"variant": "c", "wall_measured": False}], lambda r: r["variant"], workers=2)
    assert "| c | 1 | - | - |" in older and "45 s summed" in older[0] and "(1 stored before runs recorded" in older[0]
    mixed = wall_time_lines([*rows, {"variant": "a"}], lambda r: r["variant"], workers=2)  # one of a's runs untimed
    assert "| a | 3 | >= 40 | 20 |" in mixed and "'>=' on the sum of a part with some" in mixed[0]
    resumed = [{**rows[0], "wall_resumed": True}, *rows[1:]]  # a measured resumed run: the header says what it holds
    assert "a resumed run: each of its processes to the checkpoint the next resumed from" in \
        wall_time_lines(resumed, lambda r: r["variant"], workers=2)[0]
    from analysis.wall_time import run_wall
    assert run_wall({"run_seconds": 3.0, "run_seconds_complete": True, "train_started_at_steps": [0, 9]}) == \
        {"wall_s": 3.0, "wall_measured": True, "wall_resumed": True}


def test_the_report_names_the_code_and_the_cpu_of_every_run():
    from analysis.provenance import origin_lines

    rows = [{"code": "abc", "cpu": "AMD EPYC"}, {"code": "abc", "cpu": "AMD EPYC"}, {"code": "def+dirty:12345678"}]
    assert origin_lines(rows) == ["Code the runs trained at: `abc` (2 runs), `def+dirty:12345678` (1 run).", "",
                                  "CPUs the runs trained on: `AMD EPYC` (2 runs); 1 stored before runs recorded it "
                                  "(unknown).", ""]
    assert origin_lines([{"variant": "vanilla"}]) == []  # rows stored before runs recorded their code and CPU
    assert origin_lines([{"code": "abc"}, {}])[0] == ("Code the runs trained at: `abc` (1 run); 1 stored before runs "
                                                     "recorded it (their file's provenance names its commit).")
    mixed = origin_lines([{"code": "abc", "cpu": "AMD EPYC"}, {"code": "abc", "cpu": "Intel(R) Xeon(R)"}])
    assert mixed[4].startswith("Warning: the runs were computed on different CPUs (AMD EPYC, Intel(R) Xeon(R));")
    resumed = origin_lines([{"code": "abc", "cpu": "AMD EPYC>Intel(R) Xeon(R)"}])  # one run, two machines
    assert "`AMD EPYC>Intel(R) Xeon(R)` (1 run)" in resumed[2] and resumed[4].startswith("Warning: the runs were")
