"""Provenance: the code a process ran is read once, so a checkout that moves on while a long-lived worker
trains (``experiments.repro --jobs N``) does not relabel what that worker loaded; the kernel record."""
import torch

from analysis import provenance


def test_the_code_state_is_read_once_per_process(monkeypatch):
    provenance._code_state.cache_clear()
    monkeypatch.setattr(provenance, "_git", lambda *args: b"a" * 40 + b"\n" if args[0] == "rev-parse" else b"")
    first = provenance.code_state()
    monkeypatch.setattr(provenance, "_git", lambda *args: b"b" * 40 + b"\n" if args[0] == "rev-parse" else b"")
    assert first == provenance.code_state() == {"commit": "a" * 40, "dirty": False, "diff_sha256": None}
    provenance._code_state.cache_clear()
    assert provenance.code_state()["commit"] == "b" * 40  # a new process reads the checkout anew
    provenance._code_state.cache_clear()


def test_the_kernel_record_names_the_cpu_path_and_the_variables_that_choose_it(monkeypatch):
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    record = provenance.kernels()
    assert record["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert record["environment"]["MKL_CBWR"] == "AVX2" and record["environment"]["ATEN_CPU_CAPABILITY"] is None
    label = provenance.kernel_label({"provenance": {"kernels": record}})
    assert label == f"{record['cpu_capability']} (MKL_CBWR=AVX2)"
    assert provenance.kernel_label({}) == "unknown"
