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
    ({"libraries": {}}, "records no torch its runs trained with"),
    ({"kernels": {"cpu": cpu_model()}}, "records no kernel variables"),
    ({"kernels": {}, "libraries": {}}, "records no CPU or torch"),
    ({"argv": ["/m/experiments/repro/__main__.py", "probe", "--tables_from", "a.json"]}, "has --tables_from: it did"),
    ({"argv": ["/m/experiments/repro/__main__.py", "mom_removal", "--run=/runs/x"]}, "has --run: it did not train"),
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


def test_the_plan_leaves_out_no_reuse_so_that_running_it_again_resumes_and_warns_of_other_libraries(tmp_path):
    dest = _report(tmp_path, argv=["/m/experiments/repro/__main__.py", "probe", "--no_reuse", "--", "--no_reuse"],
                   libraries={"torch": metadata.version("torch"), "lightning": "0.0.1", "numpy": metadata.version("numpy")})
    plan = retrain.retraining_plan(json.loads((dest / "results.json").read_text()), dest)
    assert plan["command"] == ["probe", "--", "--no_reuse"]  # a run option of that name is the runs' own
    assert plan["libraries"] == [f"lightning 0.0.1 -> {metadata.version('lightning')}"]


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
    monkeypatch.setenv("DYNCOMP_GROUPED_MM", "1")  # another MoE code path, recorded nowhere
    monkeypatch.setenv("DYNCOMP_CACHE", "/caches")
    env = retrain.run_environment(KERNELS, pathlib.Path("/code"))
    assert env["MKL_CBWR"] == "AVX2" and env["OMP_NUM_THREADS"] == "1" and "ONEDNN_MAX_CPU_ISA" not in env
    assert "DYNCOMP_GROUPED_MM" not in env and env["DYNCOMP_CACHE"] == "/caches"
    assert env["PYTHONPATH"] == os.pathsep.join(["/code", "/mine"]) and env["PATH"] == os.environ["PATH"]


def _git(*args, cwd):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd, check=True,
                          capture_output=True, text=True).stdout.strip()


def _repo(tmp_path, *versions):
    """A git repository whose ``model.py`` is each of ``versions`` in turn, one commit each; (its folder, the
    commits)."""
    repo = tmp_path / "repo"
    repo.mkdir()
    _git("init", "-q", cwd=repo)
    commits = []
    for version in versions:
        (repo / "model.py").write_text(version)
        _git("add", ".", cwd=repo)
        _git("commit", "-qm", version.strip(), cwd=repo)
        commits.append(_git("rev-parse", "HEAD", cwd=repo))
    return repo, commits


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git (a checkout of the project has it)")
def test_the_code_is_the_commits_in_a_clean_clone_kept_for_a_resume_and_other_code_is_refused(tmp_path):
    repo, (first, second) = _repo(tmp_path, "first\n", "second\n")

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
    with pytest.raises(ConfigError, match="is not in .* history; fetch the branch that holds it"):
        retrain.code_at("f" * 40, tmp_path / "other", repo)
    _git("checkout", "-q", first, cwd=repo)
    (repo / "code").mkdir()  # a folder inside a clean checkout at that commit is no clone of it
    with pytest.raises(ConfigError, match="holds other code than"):
        retrain.code_at(first, repo / "code", repo)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git (a checkout of the project has it)")
def test_an_interrupted_checkout_leaves_nothing_and_the_same_call_then_makes_the_clone(tmp_path, monkeypatch):
    repo, (commit,) = _repo(tmp_path, "first\n")
    real = retrain.git

    def killed_at_checkout(*args, cwd=retrain.REPO):
        if "checkout" in args:
            raise KeyboardInterrupt
        return real(*args, cwd=cwd)

    monkeypatch.setattr(retrain, "git", killed_at_checkout)
    with pytest.raises(KeyboardInterrupt):
        retrain.code_at(commit, tmp_path / "work" / "code", repo)
    assert list((tmp_path / "work").iterdir()) == []
    monkeypatch.setattr(retrain, "git", real)
    assert (retrain.code_at(commit, tmp_path / "work" / "code", repo) / "model.py").read_text() == "first\n"


def test_the_command_runs_the_code_it_is_given_not_the_installed_one_under_the_given_environment(tmp_path):
    """The project is installed editable from this checkout: the retraining's ``experiments`` must be the old
    commit's, which ``WORK/code`` (the working folder and first on PYTHONPATH) holds."""
    code = tmp_path / "code"
    (code / "experiments" / "repro").mkdir(parents=True)
    (code / "experiments" / "__init__.py").write_text("")
    (code / "experiments" / "repro" / "__init__.py").write_text("")
    (code / "experiments" / "repro" / "__main__.py").write_text(
        "import os, pathlib, sys, experiments\n"
        "pathlib.Path(sys.argv[-1]).write_text(experiments.__file__ + ' ' + os.environ['MKL_CBWR'] + ' ' + "
        "str(os.nice(0)))\n")
    seen = tmp_path / "seen.txt"
    retrain.train(["probe", str(seen)], code, retrain.run_environment(KERNELS, code))
    module, cbwr, niceness = seen.read_text().split()
    assert pathlib.Path(module) == code / "experiments" / "__init__.py" and cbwr == "AVX2"
    assert int(niceness) >= min(19, os.nice(0) + 10)


def _moved(out: pathlib.Path, argv) -> None:
    """A programme's ``out/prog`` (rows' run_dir relative to where it ran) as if it had run with argv's ``--out``:
    the rows and summaries then name their run folders in full, as the programme stores them under an absolute one."""
    to = pathlib.Path(argv[argv.index("--out") + 1])
    shutil.copytree(out, to)
    for path in [to / "results.json", *to.glob("runs/*/*/summary.json")]:
        path.write_text(path.read_text().replace('"out/prog/runs/', f'"{to}/runs/'))


def test_retrain_runs_the_recorded_command_at_its_code_and_restores_the_records(tmp_path, monkeypatch, capsys):
    """The command runs at the report's code, with --out in WORK and --jobs as given, under the recorded kernel
    variables; then every published row is checked against its retraining and gets its record."""
    dest = _report(tmp_path, libraries={"torch": metadata.version("torch"), "lightning": "0.0.1"})
    code = tmp_path / "work" / "code"
    monkeypatch.setattr(retrain, "code_at", lambda commit, target: code if commit == "a" * 40 else None)
    calls = []

    def programme(argv, cwd, env, preexec_fn):
        calls.append((argv, cwd, env))
        _moved(_retrained(tmp_path / "trained"), argv)
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(retrain.subprocess, "run", programme)
    monkeypatch.chdir(tmp_path)  # a relative --work: the command runs in WORK/code, so its --out is absolute
    records = retrain.main([str(dest), "--work", "work", "--jobs", "1"])
    (argv, cwd, env), = calls
    out = str((tmp_path / "work" / "out").resolve())
    assert argv[1:] == ["-m", "experiments.repro", "probe", "--steps", "40", "--out", out, "--jobs", "1", "--", "--data",
                        "probe-v5/bounce"]
    assert cwd == code and env["MKL_CBWR"] == "AVX2" and env["PYTHONPATH"].split(os.pathsep)[0] == str(code)
    rows = json.loads((dest / "results.json").read_text())["runs"]
    assert records == [str(dest / row["run_dir"]) for row in rows]
    assert all("retrained at " + "a" * 40 in json.loads((dest / r["run_dir"] / "summary.json").read_text())
               ["published"]["restored"] for r in rows)
    said = capsys.readouterr()
    assert "2 runs of" in said.out and "(their wall time not recorded)" in said.out
    assert "lightning 0.0.1 ->" in said.err and "the restore at the end refuses" in said.err


def test_a_failed_programme_is_one_line_saying_the_same_command_resumes(tmp_path, monkeypatch):
    dest = _report(tmp_path)
    monkeypatch.setattr(retrain, "code_at", lambda commit, target: target)
    monkeypatch.setattr(retrain.subprocess, "run", lambda argv, **kw: subprocess.CompletedProcess(argv, 3))
    with pytest.raises(ConfigError, match="exited with status 3 .* run this again: finished runs are reused"):
        retrain.retrain(dest, tmp_path / "work")
    assert not (dest / "runs").exists()
    with pytest.raises(ConfigError, match="--jobs: 0 is not a positive number"):
        retrain.main([str(dest), "--jobs", "0"])
