"""Start-up costs that are the suite's own (issue 29, docs/benchmarks.md): the embedded corpus's stdlib docstrings
are parsed once and then read from the cache folder, exactly as parsed, and parsed again when the stdlib changes;
the sweep's memory plan, measured in forked processes with one bf16 cast per weight, has the figures of the
in-process measurement with a cast per forward."""
from __future__ import annotations

import ast
import pathlib

import pytest
import torch

from datamodules import corpora


@pytest.fixture
def fake_stdlib(tmp_path, monkeypatch):
    """A two-file "stdlib" and an empty cache folder, with the docstrings' in-process memo cleared."""
    root = tmp_path / "lib"
    (root / "pkg").mkdir(parents=True)
    (root / "a.py").write_text('"""Module a: a docstring long enough to be kept by the corpus rule."""\n')
    (root / "pkg" / "b.py").write_text('def f():\n    """Function f: another docstring long enough to be kept."""\n')
    (root / "test").mkdir()
    (root / "test" / "c.py").write_text('"""A test module: skipped whatever its docstring says, by the rule."""\n')
    monkeypatch.setattr(corpora.sysconfig, "get_paths", lambda: {"stdlib": str(root)})
    monkeypatch.setenv("DYNCOMP_CACHE", str(tmp_path / "cache"))
    corpora._stdlib_docstrings.cache_clear()
    yield root
    corpora._stdlib_docstrings.cache_clear()


def _count_parses(monkeypatch) -> list:
    parsed = []
    real = ast.parse

    def counting(source, *args, **kwargs):
        parsed.append(source)
        return real(source, *args, **kwargs)

    monkeypatch.setattr(corpora.ast, "parse", counting)
    return parsed


def test_stdlib_docstrings_are_parsed_once_then_read_back_exactly(fake_stdlib, monkeypatch):
    parsed = _count_parses(monkeypatch)
    first = corpora._stdlib_docstrings()
    assert first == ("Module a: a docstring long enough to be kept by the corpus rule.",
                     "Function f: another docstring long enough to be kept.")
    assert len(parsed) == 2  # the test/ folder is skipped
    corpora._stdlib_docstrings.cache_clear()
    assert corpora._stdlib_docstrings() == first and len(parsed) == 2  # from the cache file: no parse


def test_a_changed_stdlib_file_is_parsed_again(fake_stdlib, monkeypatch):
    parsed = _count_parses(monkeypatch)
    corpora._stdlib_docstrings()
    (fake_stdlib / "a.py").write_text('"""Module a, edited: its new docstring is what the corpus must hold now."""\n')
    corpora._stdlib_docstrings.cache_clear()
    docs = corpora._stdlib_docstrings()
    assert docs[0] == "Module a, edited: its new docstring is what the corpus must hold now." and len(parsed) == 4


@pytest.mark.parametrize("content", ["", "[1, 2]", '{"not": "a list"}', '["torn'])
def test_a_torn_or_foreign_cache_file_is_parsed_again(fake_stdlib, monkeypatch, content):
    first = corpora._stdlib_docstrings()
    (cached,) = pathlib.Path(corpora.default_cache_dir(), "embedded").glob("stdlib-docstrings-*.json")
    cached.write_text(content)
    corpora._stdlib_docstrings.cache_clear()
    parsed = _count_parses(monkeypatch)
    assert corpora._stdlib_docstrings() == first and len(parsed) == 2


def test_an_unwritable_cache_folder_costs_only_the_parse(fake_stdlib, tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("DYNCOMP_CACHE", str(tmp_path / "file"))  # a file: no folder can be made under it
    assert len(corpora._stdlib_docstrings()) == 2


@pytest.mark.slow
def test_the_real_stdlib_docstrings_equal_a_fresh_parse(tmp_path, monkeypatch):
    """On the running Python (one parse, ~5-10 s): what the cache gives back is what parsing every file gave (the
    corpus, and so its fingerprint, is unchanged by the cache)."""
    monkeypatch.setenv("DYNCOMP_CACHE", str(tmp_path))
    corpora._stdlib_docstrings.cache_clear()
    try:
        parsed = corpora._stdlib_docstrings()  # parses, writes the cache
        corpora._stdlib_docstrings.cache_clear()
        cached = corpora._stdlib_docstrings()
    finally:
        corpora._stdlib_docstrings.cache_clear()
    assert cached == parsed and cached is not parsed and len(cached) > 1000


def test_the_sweep_plan_from_forked_measurements_equals_the_in_process_plan():
    """``experiments.sweep --dry_run`` measures each distinct model in a process forked from a server that imported
    torch once: the plan of every job is exactly the one measured here in-process (``plan_run_config``), for a
    plain job, a checkpointed one and a routed one, and the job sharing a model shares its measurement."""
    import multiprocessing

    from experiments import sweep
    from experiments.memory import plan_run_config

    if "forkserver" in multiprocessing.get_all_start_methods():
        assert sweep.measurement_context().get_start_method() == "forkserver"
    tiny = ["--size", "tiny", "--model.block_size", "32", "--data.batch_size", "2"]
    grid = [tiny, [*tiny, "--activation_checkpointing", "blocks"], [*tiny, "--variant", "mod"],
            [*tiny[:-1], "8", "--trainer.devices", "2"]]
    parsed = sweep.validate(grid)
    rows = sweep.memory_plans(parsed, 40.0)
    assert rows == [plan_run_config(cfg, 40.0).row() for cfg in parsed]
    assert rows[1]["activations_GiB"] < rows[1]["activations_plain_GiB"] and rows[3]["micro_batch"] == 8


def test_the_dry_run_measures_as_many_models_at_once_as_cpus_and_memory_allow(monkeypatch):
    """One measuring process per available CPU, never more than there are models, and only as many of the
    largest model as the host's available memory holds (8 bytes per parameter and 1 GiB each); at least one."""
    import os

    from architectures import ModelConfig, build_model
    from experiments import sweep

    small, large = ModelConfig(size="tiny").resolve(), ModelConfig(size="small").resolve()
    with torch.device("meta"):
        params = build_model(large).num_parameters()
    per_worker = sweep.MEASUREMENT_BYTES_PER_PARAMETER * params + sweep.MEASUREMENT_BASE_BYTES
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(16)), raising=False)
    monkeypatch.setattr(sweep, "available_memory_bytes", lambda: 100 * per_worker)
    assert sweep.measurement_workers([small, large, small]) == 3  # the models, not the 16 CPUs
    assert sweep.measurement_workers([small]) == 1
    monkeypatch.setattr(sweep, "available_memory_bytes", lambda: 2 * per_worker + 1)
    assert sweep.measurement_workers([small, large, small, large]) == 2  # memory for two of the largest
    monkeypatch.setattr(sweep, "available_memory_bytes", lambda: per_worker // 2)
    assert sweep.measurement_workers([small, large]) == 1  # too little for one: still one, as before
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0}, raising=False)
    monkeypatch.setattr(sweep, "available_memory_bytes", lambda: 100 * per_worker)
    assert sweep.measurement_workers([small, large, small]) == 1  # one CPU


def test_plan_workers_must_be_positive():
    from architectures.config import ConfigError
    from experiments import sweep

    with pytest.raises(ConfigError, match="--plan_workers"):
        sweep.main(["--grid", "variant=vanilla", "--dry_run", "--plan_workers", "0"])


#: the variants of the paper recipes (experiments/configs/paper/)
PAPER_VARIANTS = ("vanilla", "mod", "ffn_wider", "cea", "caa", "cea_moe", "mom_p", "mom_e", "mom_i")


@pytest.mark.parametrize("policy", ["none", "blocks"])
def test_one_bf16_cast_per_weight_gives_the_figures_of_a_cast_per_forward(policy):
    """The plan's measurement casts each weight to bf16 once for both of its forwards (``share_casts``): the
    activation figures equal those measured with autocast's casts made afresh in each forward, and a second
    measurement repeats the first exactly, for every variant (the saved storages are read after the forward:
    keyed by address as they were saved, a storage freed within the forward and its address reused made
    depth_gate_skip, mot, mode_integrated and recur_halt differ by up to 5.8% between two identical
    measurements). Checkpointing: the paper variants and MoE (the forwards are slower)."""
    import dataclasses

    from architectures import build_model, variant_names
    from architectures.registry import VARIANTS
    from model_tools.memory import measure_activations

    names = variant_names() if policy == "none" else [*PAPER_VARIANTS, "moe"]
    assert set(PAPER_VARIANTS) <= set(variant_names())
    for name in names:
        torch.manual_seed(0)
        model = build_model(VARIANTS[name].test_config(name)).train()
        shared, fresh, again = (dataclasses.asdict(_seeded(measure_activations, model, policy, True, share_casts=share))
                                for share in (True, False, False))
        assert shared["fixed"] > 0, name  # the bf16 weight copies are counted (per step), as before
        assert shared == fresh == again, name


def _seeded(measure, *args, **kwargs):
    torch.manual_seed(1)  # the same draws for both (stochastic gates and routing noise in training mode)
    return measure(*args, **kwargs)
