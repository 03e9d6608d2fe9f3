"""``experiments.repro.retrain``: a published report retrained from its own record (commit, command, CPU, kernel
variables, torch) and its records restored, in one command; refused before anything trains where the runs cannot
come back bit for bit."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
from importlib import metadata

import pytest

from analysis.provenance import cpu_id, cpu_model
from architectures.config import ConfigError
from experiments.repro import retrain
from tests.test_publish import CODE, _published_without_records, _retrained

COMMAND = ["probe", "--steps", "40", "--out", "/elsewhere/out", "--jobs", "2", "--", "--data", "probe-v5/bounce"]
KERNELS = {"MKL_CBWR": "AVX2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": None, "OMP_NUM_THREADS": "1"}


def _report(tmp_path, **provenance) -> pathlib.Path:
    """A report published without its records, trained on this machine's CPU and torch, with its command."""
    dest = _published_without_records(tmp_path)
    results = json.loads((dest / "results.json").read_text())
    recorded = {**CODE, "argv": ["/machine/experiments/repro/__main__.py", *COMMAND],
                "libraries": {"torch": metadata.version("torch")},
                "kernels": {"cpu": cpu_model(), "cpu_id": cpu_id(), "environment": KERNELS}}
    (dest / "results.json").write_text(json.dumps({**results, "provenance": {**recorded, **provenance}}))
    return dest


@pytest.mark.parametrize("change,message", [
    ({"commit": None}, "names no commit"),
    ({"dirty": True}, "uncommitted changes at aaaaaaaaaa"),
    ({"argv": ["/machine/experiments/repro/__main__.py"]}, "records no command line"),
    ({"argv": ["/venv/bin/pytest", "tests"]}, "records no command line of python -m experiments.repro"),
    ({"kernels": {"cpu": "AMD EPYC", "environment": KERNELS}}, "CPU 'AMD EPYC', this machine has"),
    ({"kernels": {"cpu": cpu_model(), "cpu_id": "AuthenticAMD 25/1/1", "environment": KERNELS}}, "CPU id"),
    ({"libraries": {"torch": "1.0.0"}}, "torch '1.0.0'"),
])
def test_a_report_that_cannot_come_back_bit_for_bit_is_refused_before_anything_trains(tmp_path, monkeypatch, change,
                                                                                        message):
    dest = _report(tmp_path, **change)
    monkeypatch.setattr(retrain, "code_at", lambda *a: pytest.fail("checked out code for a refused report"))
    with pytest.raises(ConfigError, match=message):
        retrain.retrain(dest, tmp_path / "work")
    assert not (tmp_path / "work").exists() and not (dest / "runs").exists()


def test_a_merged_report_is_refused_naming_the_folders_to_retrain(tmp_path):
    dest = _report(tmp_path)
    results = json.loads((dest / "results.json").read_text())
    results["runs"][0]["source"] = "docs/results/a/results.json"
    (dest / "results.json").write_text(json.dumps(results))
    with pytest.raises(ConfigError, match="retrain each folder its rows came from"):
        retrain.retrain(dest, tmp_path / "work")


@pytest.mark.parametrize("command,expected", [
    (["probe", "--out", "a", "--jobs", "2"], ["probe", "--out", "NEW", "--jobs", "2"]),
    (["probe", "--out=a", "--", "--out", "b"], ["probe", "--out=NEW", "--", "--out", "b"]),  # the runs' own: kept
    (["probe", "--steps", "4", "--", "--data", "x"], ["probe", "--steps", "4", "--out", "NEW", "--", "--data", "x"]),
    (["probe"], ["probe", "--out", "NEW"]),
])
def test_an_option_of_the_programme_is_replaced_or_added_before_the_runs_own_options(command, expected):
    assert retrain.with_option(command, "--out", "NEW") == expected


def test_the_recorded_kernel_variables_are_set_those_it_ran_without_unset_and_the_old_code_comes_first(monkeypatch):
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE")
    monkeypatch.setenv("MKL_CBWR", "AUTO")
    monkeypatch.setenv("PYTHONPATH", "/mine")
    env = retrain.run_environment(KERNELS, pathlib.Path("/code"))
    assert env["MKL_CBWR"] == "AVX2" and env["OMP_NUM_THREADS"] == "1" and "ONEDNN_MAX_CPU_ISA" not in env
    assert env["PYTHONPATH"] == os.pathsep.join(["/code", "/mine"]) and env["PATH"] == os.environ["PATH"]


def _git(*args, cwd):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git (a checkout of the project has it)")
def test_the_code_is_the_commits_in_a_clean_clone_kept_for_a_resume_and_other_code_is_refused(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _git("init", "-q", cwd=repo)
    (repo / "model.py").write_text("first\n")
    _git("add", ".", cwd=repo)
    _git("commit", "-qm", "first", cwd=repo)
    first = _git("rev-parse", "HEAD", cwd=repo)
    (repo / "model.py").write_text("second\n")
    _git("commit", "-qam", "second", cwd=repo)
    second = _git("rev-parse", "HEAD", cwd=repo)

    code = retrain.code_at(first, tmp_path / "work" / "code", repo)
    assert (code / "model.py").read_text() == "first\n" and _git("rev-parse", "HEAD", cwd=code) == first
    assert (repo / "model.py").read_text() == "second\n"  # the checkout itself is untouched
    (code / "runs.txt").write_text("an untracked output\n")
    assert retrain.code_at(first, code, repo) == code  # a resume: kept as it is
    with pytest.raises(ConfigError, match="holds other code than"):
        retrain.code_at(second, code, repo)
    (code / "model.py").write_text("edited\n")
    with pytest.raises(ConfigError, match="or changed code"):
        retrain.code_at(first, code, repo)
    with pytest.raises(ConfigError, match="is not in .* history; fetch it"):
        retrain.code_at("f" * 40, tmp_path / "other", repo)
    _git("checkout", "-q", first, cwd=repo)
    (repo / "code").mkdir()  # a folder inside a clean checkout at that commit is no clone of it
    with pytest.raises(ConfigError, match="holds other code than"):
        retrain.code_at(first, repo / "code", repo)


def _moved(out: pathlib.Path, to: pathlib.Path) -> None:
    """A programme's ``out/prog`` (rows' run_dir relative to where it ran) as if it had run with ``--out`` ``to``."""
    shutil.copytree(out, to)
    for path in [to / "results.json", *to.glob("runs/*/*/summary.json")]:
        path.write_text(path.read_text().replace('"out/prog/runs/', '"out/runs/'))


def test_retrain_runs_the_recorded_command_at_its_code_and_restores_the_records(tmp_path, monkeypatch, capsys):
    """The command runs at the report's code, with --out in WORK and --jobs as given, under the recorded kernel
    variables; then every published row is checked against its retraining and gets its record."""
    dest = _report(tmp_path)
    code = tmp_path / "work" / "code"
    monkeypatch.setattr(retrain, "code_at", lambda commit, target: code if commit == "a" * 40 else None)
    calls = []

    def programme(argv, cwd, env, preexec_fn):
        calls.append((argv, cwd, env))
        _moved(_retrained(tmp_path / "trained"), tmp_path / "work" / "out")
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(retrain.subprocess, "run", programme)
    records = retrain.main([str(dest), "--work", str(tmp_path / "work"), "--jobs", "1"])
    (argv, cwd, env), = calls
    assert argv[1:] == ["-m", "experiments.repro", "probe", "--steps", "40", "--out", str(tmp_path / "work" / "out"),
                        "--jobs", "1", "--", "--data", "probe-v5/bounce"]
    assert cwd == code and env["MKL_CBWR"] == "AVX2" and env["PYTHONPATH"].split(os.pathsep)[0] == str(code)
    rows = json.loads((dest / "results.json").read_text())["runs"]
    assert records == [str(dest / row["run_dir"]) for row in rows]
    assert all("retrained at " + "a" * 40 in json.loads((dest / r["run_dir"] / "summary.json").read_text())
               ["published"]["restored"] for r in rows)
    assert "2 runs of" in capsys.readouterr().out.split("(their wall time not recorded)")[0]


def test_a_failed_programme_is_one_line_saying_the_same_command_resumes(tmp_path, monkeypatch):
    dest = _report(tmp_path)
    monkeypatch.setattr(retrain, "code_at", lambda commit, target: target)
    monkeypatch.setattr(retrain.subprocess, "run", lambda argv, **kw: subprocess.CompletedProcess(argv, 3))
    with pytest.raises(ConfigError, match="exited with status 3 .* run this again: finished runs are reused"):
        retrain.retrain(dest, tmp_path / "work")
    assert not (dest / "runs").exists()
    with pytest.raises(ConfigError, match="--jobs: 0 is not a positive number"):
        retrain.main([str(dest), "--jobs", "0"])
