"""Issue 20 (argument errors and silent options): what each variant reads, sweeps over options a variant
ignores, probe labels verified like the token cache, GLUE split files that would be a silent choice.

The one-line errors themselves are rows of the bad-input table (tests/test_bad_inputs.py)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from architectures.config import ConfigError
from architectures.registry import VARIANTS, apply_preset, build_model, check_options_used, ignored_options
from datamodules import probe


# ---------------------------------------------------------------------------- what each variant reads
def _recording(group_cls, group: str, reads: set):
    """A subclass of a config group dataclass that records every field read (``dataclasses.replace`` keeps it)."""
    names = {f.name for f in dataclasses.fields(group_cls)}

    class Recording(group_cls):
        def __getattribute__(self, name):
            if name in names:
                reads.add(group)
            return object.__getattribute__(self, name)

    return Recording


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_each_variant_reads_exactly_the_config_groups_it_declares(variant, one_thread):
    """``config_groups`` is what the refusal of ignored options rests on: building, validating and
    running the model (train and eval forward, FLOPs) must read those groups and no other."""
    reads: set = set()
    config = VARIANTS[variant].test_config(variant)
    assert set(config.groups) == set(VARIANTS[variant].model_class().config_groups)  # a config holds those only
    groups = {g: _recording(type(v), g, reads)(**dataclasses.asdict(v)) for g, v in config.groups.items()}
    config = dataclasses.replace(config, **groups)
    model = build_model(config)
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size))
    model.train()
    model(tokens)
    model.eval()
    model(tokens)
    model.flops_per_token(None, config.block_size)
    assert reads == set(type(model).config_groups)


def _output(config, seed=0):
    torch.manual_seed(seed)
    model = build_model(config).eval()
    tokens = torch.randint(0, config.vocab_size, (2, config.block_size), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(tokens).logits, {k: tuple(v.shape) for k, v in model.state_dict().items()}


@pytest.mark.parametrize("field,value", [("num_experts", 3), ("top_k", 2), ("expert_ffn_ratio", 2.0), ("layers", "odd"),
                                         ("placement", "before_ffn")])
def test_moe_options_cea_moe_overrides_change_nothing_and_are_refused(field, value, one_thread):
    """cea_moe's Inner MoE takes its size from model.combo: these moe options would be silently ignored."""
    config = apply_preset(VARIANTS["cea_moe"].test_config("cea_moe"))
    changed = dataclasses.replace(config, moe=dataclasses.replace(config.moe, **{field: value}))
    (logits, shapes), (logits_changed, shapes_changed) = _output(config), _output(changed)
    assert shapes == shapes_changed and torch.equal(logits, logits_changed)
    with pytest.raises(ConfigError, match=rf"model\.moe\.{field}: the cea_moe variant does not use this option"):
        check_options_used(changed)


def test_presets_and_defaults_are_not_taken_for_ignored_options():
    for variant in VARIANTS:
        assert ignored_options(apply_preset(VARIANTS[variant].test_config(variant))) == [], variant


# ---------------------------------------------------------------------------- data options
def test_every_dataset_declares_the_data_options_it_reads():
    """A dataset missing from CORPUS_OPTIONS would be taken to read every option (nothing refused); the probe
    versions are generated alike, so v2 reads what v1 reads."""
    from datamodules.catalog import CORPORA, CORPUS_OPTIONS, ignored_data_options

    assert set(CORPUS_OPTIONS) == set(CORPORA)
    for name in CORPORA:
        if name.startswith("probe-v2"):
            assert CORPUS_OPTIONS[name] == CORPUS_OPTIONS[name.replace("probe-v2", "probe")] == ("max_tokens",)
            assert [o for o, _ in ignored_data_options(name, {"path": "x", "max_tokens": 10})] == ["path"]


# ---------------------------------------------------------------------------- sweeps
def test_sweep_over_an_option_one_variant_ignores_drops_it_there_and_removes_the_duplicates(capsys):
    from experiments import sweep

    jobs = sweep.main(["--grid", "variant=vanilla,mod", "--grid", "model.mod.capacity=0.125,0.25", "--launcher",
                       "local", "--dry_run", "--no_plan", "--", "--size", "tiny"])
    commands = [job[3:] for job in jobs]  # after "python -m experiments.run"
    assert commands == [["--size", "tiny", "--variant", "vanilla"],
                        ["--size", "tiny", "--variant", "mod", "--model.mod.capacity", "0.125"],
                        ["--size", "tiny", "--variant", "mod", "--model.mod.capacity", "0.25"]]
    err = capsys.readouterr().err
    assert "note: sweep: vanilla does not use --model.mod.capacity" in err
    assert "1 duplicate configuration(s) removed; 3 remain" in err


def test_sweep_still_refuses_an_ignored_option_it_cannot_drop(tmp_path):
    """An option from a --config file is not in the command line to drop: the run's own refusal stands."""
    from experiments import sweep

    config = tmp_path / "moe.yaml"
    config.write_text("model:\n  moe:\n    top_k: 2\n")
    with pytest.raises(ConfigError, match=r"model\.moe\.top_k: the vanilla variant does not use this option"):
        sweep.main(["--grid", "variant=vanilla,moe", "--dry_run", "--", "--config", str(config)])


# ---------------------------------------------------------------------------- bench
def test_bench_accepts_a_set_that_a_benchmarked_variant_reads():
    from experiments import bench

    args = bench.parse_args(["--variants", "mod", "--set", "mod.capacity=0.5", "--set", "d_model=64", "--no_hf",
                             "--no_minimal", "--device", "cpu"])
    config = bench.base_config(args, "mod")
    assert config.mod.capacity == 0.5 and config.d_model == 64


# ---------------------------------------------------------------------------- probe labels
SMALL = 32 * probe.EPISODE_LEN


def _probe_data(cache_dir):
    from datamodules.lm import DataConfig, LMDataModule

    dm = LMDataModule(DataConfig(name="probe/arith", max_tokens=SMALL, cache_dir=str(cache_dir)), block_size=128)
    dm.prepare_data()
    dm.setup("fit")
    return dm


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete"])
def test_damaged_probe_labels_are_rebuilt_before_training(damage, tmp_path):
    """The labels are read only at the first validation, after training: prepare_data must verify them
    (checksums recorded in meta.json, as the token cache verifies tokens.bin) and rebuild."""
    folder = _probe_data(tmp_path)._folder(probe.ProbeCorpus("probe/arith", SMALL))
    path = folder / "levels.npy"
    good = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(good[: len(good) // 2])
    elif damage == "flip":  # same size, one label changed: only the checksum can tell
        data = bytearray(good)
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    else:
        path.unlink()
    dm = _probe_data(tmp_path)
    assert path.read_bytes() == good
    levels, _ = probe.open_labels(folder, len(dm.train_set.tokens))
    assert np.array_equal(np.asarray(levels), np.load(folder / "levels.npy"))


def test_probe_labels_get_the_permissions_of_the_token_cache(tmp_path):
    """Issue 30: the label files were mkstemp's 0600 beside a 0644 tokens.bin (a shared cache's other users could
    read the tokens but not the labels)."""
    import os

    mask = os.umask(0o022)
    try:
        folder = _probe_data(tmp_path)._folder(probe.ProbeCorpus("probe/arith", SMALL))
    finally:
        os.umask(mask)
    modes = {name: oct((folder / name).stat().st_mode & 0o777) for name in ("tokens.bin", *probe.LABEL_FILES)}
    assert modes == {name: oct(0o644) for name in modes}


def test_unreadable_probe_labels_are_one_data_error_naming_the_file(tmp_path):
    from datamodules.corpora import DataError

    folder = _probe_data(tmp_path)._folder(probe.ProbeCorpus("probe/arith", SMALL))
    (folder / "families.npy").write_bytes((folder / "families.npy").read_bytes()[:100])
    with pytest.raises(DataError, match=r"families\.npy: probe labels are unreadable .*delete"):
        probe.open_labels(folder, SMALL)


# ---------------------------------------------------------------------------- GLUE split files
@pytest.mark.parametrize("names", [("dev.tsv", "validation.jsonl"), ("val.jsonl", "validation-00000.parquet"),
                                   ("dev.tsv", "val.jsonl")])
def test_two_files_for_one_glue_split_are_refused_naming_both(names, tmp_path):
    from datamodules.glue import AmbiguousFiles, find_split_file, get_task

    folder = tmp_path / "SST-2"
    folder.mkdir()
    for name in names:
        (folder / name).write_text("")
    with pytest.raises(AmbiguousFiles, match=rf"several glue/sst2 validation files \({', '.join(sorted(names))}\)"):
        find_split_file(get_task("sst2"), tmp_path, "validation")
