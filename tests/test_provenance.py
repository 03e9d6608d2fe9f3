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


def test_the_kernel_record_tells_apart_cpus_a_hypervisor_names_alike(tmp_path, monkeypatch):
    """Two Intel CPUs under KVM both say "Intel(R) Xeon(R) Processor"; family/model/stepping differ (the first
    processor's fields are read), and without /proc/cpuinfo there is no id rather than a wrong one."""
    cpuinfo = tmp_path / "cpuinfo"
    block = "processor\t: {n}\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: {model}\nmodel name\t: " \
            "Intel(R) Xeon(R) Processor\nstepping\t: 2\n\n"
    monkeypatch.setattr(provenance, "CPUINFO", cpuinfo)
    cpuinfo.write_text(block.format(n=0, model=207) + block.format(n=1, model=143))
    assert provenance.cpu_id() == "GenuineIntel 6/207/2" and provenance.kernels()["cpu_id"] == "GenuineIntel 6/207/2"
    assert provenance.cpu_model() == "Intel(R) Xeon(R) Processor"
    cpuinfo.write_text(block.format(n=0, model=143))
    assert provenance.cpu_id() == "GenuineIntel 6/143/2"
    monkeypatch.setattr(provenance, "CPUINFO", tmp_path / "absent")
    assert provenance.cpu_id() is None


def test_a_run_resumed_on_another_cpu_names_both(tmp_path, monkeypatch):
    import json

    (tmp_path / provenance.FILE).write_text(json.dumps([{"commit": "a" * 40, "kernels": {"cpu": "AMD EPYC"}},
                                                        {"commit": "a" * 40, "kernels": {"cpu": "AMD EPYC"}}]))
    monkeypatch.setattr(provenance, "cpu_model", lambda: "Intel(R) Xeon(R)")
    record = provenance.summary_provenance(tmp_path)
    assert record["cpus"] == ["AMD EPYC", "Intel(R) Xeon(R)"] and record["kernels"]["cpu"] == "Intel(R) Xeon(R)"
    assert provenance.cpu_label({"provenance": record}) == "AMD EPYC>Intel(R) Xeon(R)"
    # summaries written before "cpus" existed: the finishing process's CPU; none recorded: None
    assert provenance.cpu_label({"provenance": {"kernels": {"cpu": "AMD EPYC"}}}) == "AMD EPYC"
    assert provenance.cpu_label({}) is None and provenance.cpu_label({"provenance": {"kernels": {}}}) is None
