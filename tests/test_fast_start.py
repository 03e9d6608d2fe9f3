"""Start-up costs that are the suite's own (issue 29): the embedded corpus's stdlib docstrings are parsed once and
then read from the cache folder, exactly as parsed, and parsed again when the stdlib changes."""
from __future__ import annotations

import ast
import pathlib

import pytest

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


def test_the_real_stdlib_docstrings_equal_a_fresh_parse(tmp_path, monkeypatch):
    """On the running Python: what the cache gives back is what parsing every file gives (the corpus and so its
    fingerprint are unchanged by the cache)."""
    monkeypatch.setenv("DYNCOMP_CACHE", str(tmp_path))
    corpora._stdlib_docstrings.cache_clear()
    try:
        corpora._stdlib_docstrings()  # writes the cache
        corpora._stdlib_docstrings.cache_clear()
        cached = corpora._stdlib_docstrings()
    finally:
        corpora._stdlib_docstrings.cache_clear()
    root = pathlib.Path(corpora.sysconfig.get_paths()["stdlib"])
    assert cached == corpora._parse_docstrings(corpora._stdlib_files(root)) and len(cached) > 1000


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
