"""The one-command GPU check: its CPU smoke path (--quick) produces the full report."""
from __future__ import annotations

import json

import pytest
import torch

from experiments import device_check


@pytest.mark.slow
def test_quick_device_check_writes_table_json_and_run(tmp_path, one_thread):
    report = device_check.main(["--out", str(tmp_path), "--quick", "--steps", "1", "--run_steps", "2"])
    saved = json.loads((tmp_path / "device_check.json").read_text())
    assert saved["phases"].keys() == {"eager", "compiled", "checkpointed"} and not saved["skipped"]
    checkpointed = saved["phases"]["checkpointed"]["vanilla"]  # the plan next to the measured figure
    assert checkpointed["checkpointing"] == "blocks" and checkpointed["planned_peak_mb"] > 0
    assert checkpointed["planned_peak_mb"] < checkpointed["planned_peak_no_checkpointing_mb"]
    assert "Memory plan vs measured" in (tmp_path / "device_check.md").read_text()
    assert set(saved["phases"]["eager"]) == set(device_check.VARIANTS)
    compiled = saved["phases"]["compiled"]
    assert set(compiled) == {"vanilla", "mod"}  # --quick compiles the static-shape variants only
    for name in ("vanilla", "mod"):
        assert (compiled[name]["graphs"], compiled[name]["graph_breaks"], compiled[name]["recompiles"]) == (1, 0, 0)
    assert saved["goals"]["vanilla compiled MFU >= 0.45"] == {"value": None, "met": None}  # no GPU peak on CPU
    assert saved["goals"]["mod step-time ratio / FLOPs ratio <= 1.10"]["met"] in (True, False)
    assert saved["goals"]["moe step time <= 1.3x vanilla"] == {"value": None, "met": None}  # not compiled here
    assert "error" not in report["run"] and report["run"]["steps"] == 2, report["run"]
    table = (tmp_path / "device_check.md").read_text()
    assert "| compiled | mod |" in table and "50-step run" in table


def test_budget_skips_phases_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(device_check, "run_phase", lambda *a: pytest.fail("no phase may start"))
    monkeypatch.setattr(device_check, "training_run", lambda *a: pytest.fail("no run may start"))
    report = device_check.main(["--out", str(tmp_path), "--quick", "--budget_s", "-1"])
    assert len(report["skipped"]) == len(device_check.QUICK_PHASES) and report["phases"] == {}
    assert "50-step run" in report["skipped"]
    assert "skipped" in (tmp_path / "device_check.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_without_a_gpu_the_full_check_is_a_usage_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        device_check.main(["--out", str(tmp_path)])
    assert exit_info.value.code == 2 and "--quick" in capsys.readouterr().err


def test_every_option_has_help(capsys):
    actions = [a for a in device_check.build_parser()._actions if a.dest != "help"]
    assert actions and all(a.help for a in actions), [a.dest for a in actions if not a.help]
    with pytest.raises(SystemExit):
        device_check.parse_args(["--help"])
    out = capsys.readouterr().out
    assert "closing MoD training run" in out and "GPU benchmark phases" in out
