"""Bring your own probe: label files for any corpus, the loss mask, and the probe evaluation as a library."""
from __future__ import annotations

import json
import pathlib
import re

import lightning as L
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from architectures.contract import RoutingSite
from datamodules import cache_build, probe_labels, token_cache
from datamodules.corpora import DataError
from datamodules.lm import DataConfig, LMDataModule
from datamodules.tokenizer import TextTokenizer, bytes_tokenizer, train_bpe
from tests.conftest import TINY_RUN

BLOCK = 32


def labelled_corpus(folder: pathlib.Path, docs: int = 40, seed: int = 0) -> pathlib.Path:
    """A .jsonl text corpus whose rows carry character-span labels: each answer digit of ``a+b=c`` (level 0),
    ``a*b=c`` (level 1), ``a*b+c=d`` (level 2)."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(docs):
        text, spans = "", []
        for _ in range(6):
            a, b, c = (int(x) for x in rng.integers(0, 10, size=3))
            level = int(rng.integers(0, 3))
            question, answer = [(f"{a}+{b}=", a + b), (f"{a}*{b}=", a * b), (f"{a}*{b}+{c}=", a * b + c)][level]
            text += f"so {question}"
            spans.append([len(text), len(text) + len(str(answer % 10)), level])
            text += f"{answer % 10}. "
        rows.append({"text": text, "spans": spans})
    path = folder / "labelled.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _datamodule(tmp_path, corpus, labels=None, mask="none", weight=0.0):
    """``corpus`` with a label file (default: the corpus's own spans)."""
    config = DataConfig(name="text", path=str(corpus), tokenizer="bytes", batch_size=4, val_fraction=0.2,
                        cache_dir=str(tmp_path / "cache"), labels=str(labels or corpus), loss_mask=mask,
                        unlabelled_weight=weight)
    dm = LMDataModule(config, block_size=BLOCK, seed=0)
    dm.prepare_data()
    dm.setup("fit")
    return dm


# ---------------------------------------------------------------------------- spans -> per-token levels
def _naive_levels(text, spans, offsets):
    out = []
    for start, end in offsets:
        chars = set(range(start, end))
        out.append(max([lvl for s, e, lvl in spans if chars & set(range(s, e))], default=-1))
    return out


@pytest.mark.parametrize("kind", ["bytes", "bpe"])
def test_label_tokens_labels_the_tokens_a_span_overlaps_in_the_cached_stream(kind, tmp_path):
    docs = ["the cat sat on 42 mats", "caf\u00e9 au lait: 7 cups", "no labels here"]
    spans = [[(15, 17, 2), (4, 7, 0)], [(3, 4, 1), (14, 15, 3)], []]
    tok = bytes_tokenizer() if kind == "bytes" else train_bpe(docs * 30, vocab_size=300)
    tokenizer = TextTokenizer(tok, kind)
    ids, levels = probe_labels.label_tokens(docs, spans, tokenizer)
    cached = cache_build.build_tokens(docs, tokenizer, tmp_path / "c")
    assert np.array_equal(ids, np.asarray(token_cache.open_tokens(cached), dtype=np.int64))  # the cache's stream
    expected = []
    for text, doc_spans in zip(docs, spans):
        offsets = tok.encode(text, add_special_tokens=False).offsets
        expected += _naive_levels(text, doc_spans, offsets) + [-1]  # EOT unlabelled
    assert levels.tolist() == expected and levels.dtype == np.int8
    assert set(levels.tolist()) == {-1, 0, 1, 2, 3}


def test_span_file_and_npy_file_give_the_same_per_token_levels(tmp_path):
    corpus = labelled_corpus(tmp_path)
    from_spans = _datamodule(tmp_path, corpus)
    npy = tmp_path / "levels.npy"
    np.save(npy, np.asarray(from_spans.token_levels, dtype=np.int16))
    from_npy = _datamodule(tmp_path, corpus, npy)
    assert np.array_equal(from_spans.token_levels, from_npy.token_levels)
    assert set(np.unique(from_npy.token_levels)) == {-1, 0, 1, 2}
    converted = probe_labels.converted_path(from_spans._folder(from_spans.corpus), corpus)
    assert converted.is_file() and converted.parent.parent == from_spans._folder(from_spans.corpus)  # beside tokens
    assert from_spans.fingerprints()["labels"] != from_npy.fingerprints()["labels"] != "none"
    converted.write_bytes(converted.read_bytes()[:50])  # a torn copy is rebuilt, not trusted
    assert np.array_equal(_datamodule(tmp_path, corpus).token_levels, from_npy.token_levels)


def test_the_loss_mask_uses_the_probe_datas_own_labels(tmp_path):
    from datamodules import probe

    dm = LMDataModule(DataConfig(name="probe-v2/arith", batch_size=4, max_tokens=32 * probe.EPISODE_LEN,
                                 cache_dir=str(tmp_path), loss_mask="labelled"), block_size=128)
    dm.prepare_data()
    dm.setup("fit")
    levels, _ = probe.open_labels(dm._folder(dm.corpus), len(dm.train_set.tokens))
    block, weights = dm.train_set[3]
    start = int(dm.train_set.indices[3]) * 128
    assert torch.equal(weights, torch.as_tensor(levels[start + 1 : start + 129] >= 0, dtype=torch.float32))
    assert 0 < weights.sum() < 128


# ---------------------------------------------------------------------------- validation
def _npy(tmp_path, name, array):
    path = tmp_path / name
    np.save(path, array)
    return path


def test_bad_label_files_are_refused_naming_the_field_and_what_is_allowed(tmp_path):
    with pytest.raises(DataError, match=r"data\.labels: .*float32 array .*1-D integer array"):
        probe_labels.check_label_file(str(_npy(tmp_path, "f.npy", np.zeros(9, np.float32))), 5)
    with pytest.raises(DataError, match=r"data\.labels: .*shape \(3, 3\)"):
        probe_labels.check_label_file(str(_npy(tmp_path, "m.npy", np.zeros((3, 3), np.int8))), 5)
    with pytest.raises(DataError, match=r"data\.labels: .*low\.npy: levels run from -2 to 1; allowed are -1 .* and 0\.\.4"):
        probe_labels.check_label_file(str(_npy(tmp_path, "low.npy", np.array([-2, 1]))), 5)
    with pytest.raises(DataError, match=r"from -1 to 5; allowed are -1 \(unlabelled\) and 0\.\.4 .*probe_levels"):
        probe_labels.check_label_file(str(_npy(tmp_path, "high.npy", np.array([-1, 5]))), 5)
    with pytest.raises(DataError, match=r"data\.labels: .*\.csv must be a \.npy .* or a \.jsonl"):
        probe_labels.check_label_file(str(tmp_path / "x.csv"))
    with pytest.raises(DataError, match=r"data\.labels: .*nope\.npy does not exist"):
        DataConfig(name="text", labels=str(tmp_path / "nope.npy")).validate()
    (tmp_path / "s.jsonl").write_text('{"spans": [[3, 1, 0]]}\n')
    with pytest.raises(DataError, match=r"s\.jsonl:1: span \[3, 1, 0\] is not \[start, end, level\]"):
        probe_labels.check_label_file(str(tmp_path / "s.jsonl"))
    (tmp_path / "t.jsonl").write_text('{"spans": [[0, 1, 3]]}\n')
    with pytest.raises(DataError, match=r"t\.jsonl:1: span level 3 is outside 0\.\.2"):
        probe_labels.check_label_file(str(tmp_path / "t.jsonl"), 3)


def test_a_label_file_of_the_wrong_length_or_another_corpus_is_refused_once_the_cache_exists(tmp_path):
    corpus = labelled_corpus(tmp_path)
    short = _npy(tmp_path, "short.npy", np.zeros(10, np.int8))
    with pytest.raises(DataError, match=r"data\.labels: .*short\.npy has 10 levels for the \d+ tokens"):
        _datamodule(tmp_path, corpus, short)
    (tmp_path / "other").mkdir()
    rows = [json.loads(line) for line in labelled_corpus(tmp_path / "other", seed=1).read_text().splitlines()]
    foreign = tmp_path / "foreign.jsonl"  # another corpus's texts and spans
    foreign.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError, match=r"data\.labels: .*foreign\.jsonl: row 1's text differs"):
        _datamodule(tmp_path, corpus, foreign)
    fewer = tmp_path / "fewer.jsonl"  # spans only, one row short
    fewer.write_text("".join(json.dumps({"spans": r["spans"]}) + "\n" for r in rows[1:]))
    with pytest.raises(DataError, match=r"data\.labels: .*fewer\.jsonl has 39 documents, the corpus 40"):
        _datamodule(tmp_path, corpus, fewer)


def test_option_combinations_are_checked(tmp_path):
    with pytest.raises(DataError, match=r"data\.loss_mask: must be one of none, labelled"):
        DataConfig(loss_mask="all").validate()
    with pytest.raises(DataError, match=r"data\.unlabelled_weight: .*add --data\.loss_mask labelled"):
        DataConfig(unlabelled_weight=0.5).validate()
    with pytest.raises(DataError, match=r"data\.unlabelled_weight: must be in \[0, 1\]"):
        DataConfig(loss_mask="labelled", unlabelled_weight=2.0).validate()
    with pytest.raises(DataError, match=r"data\.loss_mask: needs labels"):
        LMDataModule(DataConfig(loss_mask="labelled", cache_dir=str(tmp_path)), block_size=BLOCK)
    npy = _npy(tmp_path, "ok.npy", np.zeros(4, np.int8))
    with pytest.raises(DataError, match=r"data\.labels: the probe data 'probe/arith' carry their own labels"):
        LMDataModule(DataConfig(name="probe/arith", labels=str(npy), cache_dir=str(tmp_path)), block_size=BLOCK)
    from architectures.config import ConfigError
    from callbacks import CallbacksConfig

    with pytest.raises(ConfigError, match=r"callbacks\.probe_hard_from: must be an integer in 1\.\.2"):
        CallbacksConfig(probe_levels=3, probe_hard_from=3).validate()
    with pytest.raises(ConfigError, match=r"callbacks\.probe_levels: must be an integer in 2\.\.127"):
        CallbacksConfig(probe_levels=1, probe_hard_from=1).validate()


def test_a_label_files_level_count_is_the_default_and_explicit_values_beat_it(tmp_path):
    """--callbacks.probe_levels defaults to the file's top level + 1 and probe_hard_from to its top level where the
    usual 3 lies past it (also beside an explicit probe_levels: the data hold no level above). No labelled token,
    one level, more levels than the metrics keep, or an unreadable file leave the dataclass defaults, and the
    up-front checks report the file."""
    from experiments.run import build_parser, expand_aliases, parse_with_presets

    def levels(labels, *argv):
        cfg = parse_with_presets(build_parser(), expand_aliases(["--data", "text", "--data.labels", str(labels), *argv]))
        return cfg.callbacks.probe_levels, cfg.callbacks.probe_hard_from

    assert levels(_npy(tmp_path, "seven.npy", np.array([-1, 0, 6, 2], np.int16))) == (7, 3)
    (tmp_path / "two.jsonl").write_text('{"spans": [[0, 2, 1]]}\n{"spans": []}\n')
    assert levels(tmp_path / "two.jsonl") == (2, 1)
    assert levels(tmp_path / "seven.npy", "--callbacks.probe_levels", "12") == (12, 3)
    assert levels(tmp_path / "two.jsonl", "--callbacks.probe_levels", "5") == (5, 1)
    (tmp_path / "explicit.yaml").write_text("callbacks:\n  probe_levels: 9\n  probe_hard_from: 4\n")
    assert levels(tmp_path / "seven.npy", "--config", str(tmp_path / "explicit.yaml")) == (9, 4)
    assert levels(_npy(tmp_path, "none.npy", np.full(4, -1, np.int8))) == (5, 3)
    assert levels(_npy(tmp_path, "one.npy", np.zeros(4, np.int8))) == (5, 3)  # one level: no metric to default
    assert levels(_npy(tmp_path, "huge.npy", np.array([0, 300], np.int16))) == (5, 3)  # past 127: the file's fault
    assert levels(tmp_path / "missing.npy") == levels(_npy(tmp_path, "f.npy", np.zeros(3, np.float32))) == (5, 3)
    with pytest.raises(DataError, match=r"data\.labels: .*seven\.npy: levels run from -1 to 6; allowed are .* 0\.\.3"):
        probe_labels.check_label_file(str(tmp_path / "seven.npy"), 4)
    _npy(tmp_path, "seven.npy", np.array([-1, 0, 3], np.int16))  # the same path rewritten: not the cached count
    assert levels(tmp_path / "seven.npy") == (4, 3)


def test_a_label_file_is_read_once_for_its_default_and_its_up_front_check(tmp_path, monkeypatch):
    """The default of --callbacks.probe_levels and the up-front range check share one pass over a .npy (a label
    file may be as large as the token stream)."""
    from experiments.run import build_parser, expand_aliases, parse_with_presets

    reads = []
    load = probe_labels.load_npy
    monkeypatch.setattr(probe_labels, "load_npy", lambda path: reads.append(path) or load(path))
    labels = _npy(tmp_path, "once.npy", np.array([-1, 0, 2], np.int8))
    cfg = parse_with_presets(build_parser(), expand_aliases(["--data", "text", "--data.labels", str(labels)]))
    probe_labels.check_label_file(str(labels), cfg.callbacks.probe_levels)
    assert cfg.callbacks.probe_levels == 3 and len(reads) == 1


def test_every_stage_refuses_too_few_levels_with_one_message():
    """The dataset-name check and the fit-start check build the same message (the label file's up-front
    check names its file and line instead)."""
    from callbacks.probe import check_metric_levels
    from experiments.run import check_probe_levels

    from architectures.config import ConfigError

    with pytest.raises(ConfigError) as by_name:
        check_probe_levels("probe-v6/bounce", 5)
    with pytest.raises(ConfigError) as at_fit:
        check_metric_levels(np.array([-1, 3, 7]), 5)
    tail = "use levels 0..7, more than the 5 given; raise it to 8 or drop it (the default is the labels' own count)"
    assert str(by_name.value) == f"callbacks.probe_levels: probe-v6/bounce's labels {tail}"
    assert str(at_fit.value) == f"callbacks.probe_levels: the data's labels {tail}"
    check_metric_levels(np.array([-1, 4]), 5)  # within the levels: no error


@pytest.mark.parametrize("case", ["level-outside", "wrong-length"])
def test_cli_refuses_bad_labels_in_one_line_with_exit_2(case, tmp_path, capsys):
    from experiments import run

    corpus = labelled_corpus(tmp_path)
    if case == "level-outside":  # found up front: before any tokenisation
        labels, extra, pattern = corpus, ["--callbacks.probe_levels", "2", "--callbacks.probe_hard_from", "1"], \
            r"data\.labels: .*span level 2 is outside 0\.\.1"
    else:  # found once the token cache exists, before any training step
        labels, extra, pattern = _npy(tmp_path, "short.npy", np.zeros(10, np.int8)), [], \
            r"data\.labels: .*short\.npy has 10 levels for the \d+ tokens"
    with pytest.raises(SystemExit) as exit_info:
        run.cli(run.main, ["--data", "text", "--data.path", str(corpus), "--data.labels", str(labels),
                           "--tokenizer", "bytes", *extra, "--log_dir", str(tmp_path / "logs"),
                           "--data.cache_dir", str(tmp_path / "cache"), *TINY_RUN])
    assert exit_info.value.code == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and re.search(pattern, errors[0]), errors
    written = {p.name for p in tmp_path.rglob("*") if p.is_file()}
    assert not written & {"config.yaml", "summary.json", "last.ckpt"}
    if case == "level-outside":
        assert not (tmp_path / "cache").exists() and not (tmp_path / "logs").exists()


# ---------------------------------------------------------------------------- the loss mask
def test_blocks_carry_the_loss_weight_of_each_target(tmp_path):
    corpus = labelled_corpus(tmp_path)
    dm = _datamodule(tmp_path, corpus, mask="labelled", weight=0.25)
    levels = np.asarray(dm.token_levels)
    for i in range(len(dm.train_set)):
        block, weights = dm.train_set[i]
        start = int(dm.train_set.indices[i]) * BLOCK
        assert torch.equal(block, torch.as_tensor(np.asarray(dm.train_set.tokens[start : start + BLOCK + 1],
                                                             dtype=np.int64)))
        expected = np.where(levels[start + 1 : start + BLOCK + 1] >= 0, 1.0, 0.25)
        assert np.array_equal(weights.numpy(), expected.astype(np.float32))
    assert not isinstance(_datamodule(tmp_path, corpus).train_set[0], tuple)  # labels without a mask


def _module():
    from lightning_modules.lm import LanguageModelModule

    torch.manual_seed(0)
    return LanguageModelModule(model={"variant": "mod", "size": "tiny", "d_model": 32, "n_layer": 2, "n_head": 2,
                                      "block_size": BLOCK, "vocab_size": 257}, optim={"warmup_steps": 0}, max_steps=3)


def test_changing_masked_targets_cannot_change_the_loss_or_its_gradient(tmp_path):
    dm = _datamodule(tmp_path, labelled_corpus(tmp_path), mask="labelled")
    tokens, weights = next(iter(dm.train_dataloader()))
    module = _module()
    idx, targets = module.split(tokens)
    logits = module.model(idx).logits
    masked = weights == 0
    assert masked.any() and (~masked).any()
    other = torch.where(masked, (targets + 1 + torch.randint(0, 200, targets.shape)) % 257, targets)
    assert (other != targets)[masked].all()

    def loss_and_grad(t):
        loss = module.lm_loss(logits, t, weights)
        return loss, torch.autograd.grad(loss, logits, retain_graph=True)[0]

    (loss, grad), (loss_other, grad_other) = loss_and_grad(targets), loss_and_grad(other)
    assert torch.equal(loss, loss_other) and torch.equal(grad, grad_other)
    one = other.clone()
    first_labelled = tuple(int(i) for i in (~masked).nonzero()[0])
    one[first_labelled] = (one[first_labelled] + 1) % 257
    assert not torch.equal(module.lm_loss(logits, one, weights), loss)  # a labelled target does change it
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 257), targets.reshape(-1), reduction="none")
    labelled = (~masked).reshape(-1)
    assert torch.allclose(loss, ce[labelled].mean())  # the mean over the labelled targets only


def test_an_unlabelled_weight_weighs_the_unlabelled_targets():
    module = _module()
    logits = torch.randn(2, 5, 257)
    targets = torch.randint(0, 257, (2, 5))
    weights = torch.tensor([[1, 0.1, 0.1, 1, 1], [0.1, 0.1, 1, 0.1, 1]])
    naive = sum(float(weights[b, t]) * float(torch.nn.functional.cross_entropy(logits[b, t], targets[b, t]))
                for b in range(2) for t in range(5)) / float(weights.sum())
    assert module.lm_loss(logits, targets, weights).item() == pytest.approx(naive, rel=1e-6)
    assert torch.equal(module.lm_loss(logits, targets, torch.ones(2, 5)), module.lm_loss(logits, targets))


def _fit_on(batch, steps=2) -> dict:
    module = _module()
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(max_steps=steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([batch] * steps, batch_size=None))
    return {k: v.clone() for k, v in module.model.state_dict().items()}


def test_a_training_run_whose_masked_targets_change_trains_the_same_weights(tmp_path):
    """Each row's last target is never an input of its block; where it is masked, changing it changes nothing."""
    dm = _datamodule(tmp_path, labelled_corpus(tmp_path), mask="labelled")
    tokens, weights = next(iter(dm.train_dataloader()))
    weights = weights.clone()
    weights[:, -1] = 0  # the last targets: masked
    weights[0, 0] = 1  # and at least one labelled target
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 7) % 257
    straight, other = _fit_on((tokens, weights)), _fit_on((changed, weights))
    assert all(torch.equal(straight[k], other[k]) for k in straight)
    unmasked = weights.clone()
    unmasked[:, -1] = 1
    moved = _fit_on((changed, unmasked))
    assert not all(torch.equal(straight[k], moved[k]) for k in straight)  # the same change, unmasked, moves them


def test_the_lm_module_hands_the_model_its_loss_weights_divided_by_the_lm_loss_s_divisor(tmp_path):
    """A model's own losses over the targets (early exit's) get the loss mask as the LM loss uses it."""
    dm = _datamodule(tmp_path, labelled_corpus(tmp_path), mask="labelled")
    tokens, weights = next(iter(dm.train_dataloader()))
    module = _module()
    seen = []
    forward = module.model.forward
    module.model.forward = lambda idx, **kwargs: seen.append(kwargs) or forward(idx, **kwargs)
    trainer = L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0)
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader([(tokens, weights)], batch_size=None))
    torch.testing.assert_close(seen[0]["loss_weights"], weights / weights.sum())
    unmasked = _module()
    unmasked_seen = []
    forward_unmasked = unmasked.model.forward
    unmasked.model.forward = lambda idx, **kwargs: unmasked_seen.append(kwargs) or forward_unmasked(idx, **kwargs)
    L.Trainer(max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
              enable_model_summary=False, accelerator="cpu", num_sanity_val_steps=0).fit(
        unmasked, train_dataloaders=torch.utils.data.DataLoader([tokens], batch_size=None))
    assert unmasked_seen[0] == {}  # no mask: the forward every variant has always had


# ---------------------------------------------------------------------------- sharding and resume with labels
class _Trainer:
    def __init__(self, rank, world):
        self.global_rank, self.world_size = rank, world


def test_labelled_blocks_shard_across_ranks_and_resume_mid_epoch_exactly(tmp_path):
    corpus = labelled_corpus(tmp_path, docs=60)
    rows = {}
    for rank in (0, 1):
        dm = _datamodule(tmp_path, corpus, mask="labelled")
        dm.trainer = _Trainer(rank, 2)
        it = iter(dm.train_dataloader())
        rows[rank] = {tuple(r.tolist()) for _ in range(3) for r in next(it)[0]}
    assert rows[0] and not rows[0] & rows[1]
    dm = _datamodule(tmp_path, corpus, mask="labelled")
    it = iter(dm.train_dataloader())
    straight = [next(it) for _ in range(len(dm.train_set) // 4 + 3)]  # crosses the epoch boundary
    resumed = _datamodule(tmp_path, corpus, mask="labelled")
    resumed.load_state_dict({"samples_consumed": 5 * 4})
    it = iter(resumed.train_dataloader())
    for tokens, weights in straight[5:]:
        got_tokens, got_weights = next(it)
        assert torch.equal(got_tokens, tokens) and torch.equal(got_weights, weights)


# ---------------------------------------------------------------------------- the routed share
def _site(kind, names, selected, dropped=None):
    selected = torch.tensor(selected)
    return RoutingSite(name="s", kind=kind, choice_names=names, selected=selected,
                       weights=torch.ones(selected.shape), dropped=None if dropped is None else torch.tensor(dropped))


def test_routed_share_counts_the_slots_that_did_work():
    from experiments.probes import routed_share

    mod = _site("expert_choice", ["skip", "block"], [[[1], [0], [1]]])
    moe = _site("token_choice", ["expert0", "expert1", "skip"], [[[0, 1], [2, 1], [0, 2]]],
                dropped=[[[False, True], [False, False], [False, False]]])
    gate = _site("soft_gate", ["l0", "l1"], [[[0, 1], [0, 1], [0, 1]]])
    # per token: (MoD slot + MoE slots that worked) / 3 slots; the soft gate is left out
    assert routed_share([mod, moe, gate], (1, 3)).tolist() == [[(1 + 1) / 3, (0 + 1) / 3, (1 + 1) / 3]]
    assert routed_share([gate], (1, 3)).tolist() == [[1.0, 1.0, 1.0]]


def test_per_level_table_against_a_naive_count():
    from experiments.probes import per_level_table

    levels = np.array([[-1, 0, 2, 2], [0, -1, 2, 0]])
    flops = np.array([[9.0, 1.0, 4.0, 6.0], [2.0, 100.0, 5.0, 3.0]])
    table = per_level_table(levels, flops=flops, n_levels=3)
    assert table == {"0": {"tokens": 3, "token_share": 0.5, "flops": 2.0, "flops_share": 6 / 21},
                     "2": {"tokens": 3, "token_share": 0.5, "flops": 5.0, "flops_share": 15 / 21}}
    with pytest.raises(ValueError, match="outside 0..1"):
        per_level_table(levels, flops=flops, n_levels=2)


# ---------------------------------------------------------------------------- end to end
def _scalar_tags(run_dir: pathlib.Path):
    events = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    events.Reload()
    return set(events.Tags()["scalars"])


def test_labelled_text_run_logs_per_level_metrics_everywhere_and_the_library_recomputes_them(tmp_path, one_thread):
    from experiments import probes
    from experiments.run import main

    corpus = labelled_corpus(tmp_path, docs=60)
    run_dir = main(["--data", "text", "--data.path", str(corpus), "--data.labels", str(corpus), "--tokenizer", "bytes",
                    "--data.loss_mask", "labelled", "--data.val_fraction", "0.2", "--callbacks.probe_levels", "3",
                    "--callbacks.probe_hard_from", "2", "--callbacks.probe_blocks", "6", "--max_steps", "3",
                    "--val_every", "3", "--log_dir", str(tmp_path / "logs"), "--data.cache_dir", str(tmp_path / "c"),
                    *TINY_RUN, "--model.block_size", str(BLOCK), "--variant", "mod"])
    metrics = json.loads((run_dir / "summary.json").read_text())["val_metrics"]
    detail = json.loads((run_dir / "probe.json").read_text())
    names = [f"probe/level{d}/{k}" for d in range(3) for k in ("loss", "acc", "flops", "token_share", "compute_share")]
    assert set(names) <= set(metrics) and set(names) <= _scalar_tags(run_dir)
    assert {"probe/hard_token_share", "probe/hard_compute_ratio"} <= set(metrics) & _scalar_tags(run_dir)
    assert detail["hard_from"] == 2 and detail["n_levels"] == 3 and detail["families"] == {}
    assert set(detail["levels"]) == {"0", "1", "2"} and not any(f"probe/level{d}/acc" in metrics for d in (3, 4))
    # the tokens per level are the labels of the first 6 validation blocks' targets
    run = probes.load_run(run_dir)
    levels_all, T = np.asarray(run.datamodule.token_levels), BLOCK
    starts = np.asarray(run.datamodule.val_sets["val"].indices[:6]) * T
    counted = np.concatenate([levels_all[s + 1 : s + T + 1] for s in starts])
    assert {k: v["tokens"] for k, v in detail["levels"].items()} == {
        str(d): int((counted == d).sum()) for d in range(3)}
    assert detail["hard_token_share"] == pytest.approx((counted == 2).sum() / (counted >= 0).sum())
    # the library: the final model recomputes probe.json (written at the final validation)
    again = probes.evaluate(run, blocks=6)
    for level, row in detail["levels"].items():
        assert again["levels"][level] == pytest.approx(row, rel=1e-5)
    tokens, levels = probes.labelled_batch(run, blocks=6)
    flops = probes.per_token_compute(run.model, tokens[:, :-1])
    table = probes.per_level_table(levels, flops=flops, routed_share=probes.per_token_routed_share(
        run.model, tokens[:, :-1]), n_levels=run.levels)
    for level, row in detail["levels"].items():
        assert table[level]["flops"] == pytest.approx(row["flops"]) and table[level]["tokens"] == row["tokens"]
        assert table[level]["flops_share"] == pytest.approx(row["compute_share"])
        assert 0 <= table[level]["routed_share"] <= 1


@pytest.mark.slow
def test_two_process_masked_run_trains_on_the_global_weighted_mean(tmp_path, one_thread):
    """Two ranks of 4 blocks hold different numbers of labelled targets; the loss they train on and log is the
    weighted mean over the global batch of 8, as one process with batch 8 computes it."""
    import os
    import subprocess
    import sys

    from experiments.run import main
    from tests.conftest import REPO

    corpus = labelled_corpus(tmp_path, docs=60)
    common = ["--data", "text", "--data.path", str(corpus), "--data.labels", str(corpus), "--tokenizer", "bytes",
              "--data.loss_mask", "labelled", "--data.val_fraction", "0.2", "--max_steps", "3", "--val_every", "3",
              "--data.cache_dir", str(tmp_path / "c"), "--trainer.log_every_n_steps", "1", *TINY_RUN,
              "--model.block_size", str(BLOCK), "--variant", "vanilla", "--callbacks.contribution", "false"]
    single = main([*common, "--data.batch_size", "8", "--val_blocks", "16", "--log_dir", str(tmp_path / "one")])
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    env.pop("DYNCOMP_RUN_VERSION", None)
    two_ranks = ["--data.batch_size", "4", "--val_blocks", "16", "--log_dir", str(tmp_path / "two"),
                 "--trainer.accelerator", "cpu", "--trainer.devices", "2", "--trainer.strategy", "ddp"]
    proc = subprocess.run([sys.executable, "-m", "experiments.run", *common, *two_ranks], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = json.loads((single / "summary.json").read_text())
    two = json.loads((pathlib.Path(proc.stdout.strip().splitlines()[-1]) / "summary.json").read_text())
    assert two["world_size"] == 2 and [s for s, _ in two["train_loss_curve"]] == [1, 2, 3]
    for (_, a), (_, b) in zip(one["train_loss_curve"], two["train_loss_curve"]):
        assert b == pytest.approx(a, rel=1e-5)  # per-rank means instead: 1e-4 off at step 1
    assert two["val_metrics"]["val/loss"] == pytest.approx(one["val_metrics"]["val/loss"], rel=1e-4)
