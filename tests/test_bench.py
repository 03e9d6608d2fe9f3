"""The benchmark command and --init_from."""
from __future__ import annotations

import json

import pytest
import torch

from architectures import ModelConfig, build_model
from architectures.config import ConfigError
from experiments import bench
from model_tools import benchmark
from model_tools.weights import load_initial_weights


def test_bench_reports_every_variant_with_ratios(tmp_path):
    out = tmp_path / "bench.json"
    results = bench.main(["--variants", "vanilla", "--size", "tiny", "--steps", "2", "--warmup", "1",
                          "--batch_size", "2", "--seq_len", "32", "--vocab_size", "256",
                          "--set", "d_model=32", "--set", "n_layer=2", "--generate", "4", "--json", str(out)])
    assert set(results) == {"vanilla", "hf_gpt2", "min_gpt2"}
    van, hf, minimal = results["vanilla"], results["hf_gpt2"], results["min_gpt2"]
    assert van["params"] == minimal["params"] and van["flops_per_token"] == minimal["flops_per_token"]
    assert van["speed_vs_minimal"] == pytest.approx(minimal["median_step_s"] / van["median_step_s"])
    assert van["mfu"] is None  # CPU: no peak to compare with
    assert van["step_time_ratio"] == 1.0 and van["flops_ratio"] == 1.0
    assert van["params"] == hf["params"]  # the reference is the identical architecture
    assert van["flops_per_token"] == hf["flops_per_token"] > 0
    assert van["tokens_per_s"] == pytest.approx(2 * 32 / van["median_step_s"])
    assert van["memory_mb"] > van["params"] * 16 / 2**20  # weights + grads + Adam moments at least
    assert van["speed_vs_hf"] == pytest.approx(hf["median_step_s"] / van["median_step_s"])
    assert van["generate_tokens_per_s"] > 0
    saved = json.loads(out.read_text())
    assert saved["variants"] == ["vanilla", "hf_gpt2", "min_gpt2"] and saved["results"]["vanilla"]["params"] == van["params"]


def test_process_clock_times_steps_in_cpu_seconds(one_thread):
    results = bench.main(["--variants", "vanilla", "--no_hf", "--no_minimal", "--steps", "2", "--warmup", "0",
                          "--batch_size", "2", "--seq_len", "16", "--vocab_size", "64", "--set", "d_model=32",
                          "--set", "n_layer=1", "--clock", "process"])
    assert results["vanilla"]["median_step_s"] > 0


def test_bench_rejects_unknown_variants():
    with pytest.raises(SystemExit):
        bench.main(["--variants", "vanilla,nope"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_bench_cuda_without_a_gpu_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--device", "cuda"])
    assert exit_info.value.code == 2 and "no CUDA device" in capsys.readouterr().err


def test_peak_flops_lookup_by_gpu_name():
    assert benchmark.peak_bf16_flops("NVIDIA H100 80GB HBM3") == 989.5e12
    assert benchmark.peak_bf16_flops("NVIDIA H200") == 989.5e12
    assert benchmark.peak_bf16_flops("NVIDIA H100 PCIe") == 756e12
    assert benchmark.peak_bf16_flops("NVIDIA A100-SXM4-80GB") == 312e12
    assert benchmark.peak_bf16_flops("NVIDIA GeForce GTX 1080") is None


def test_mfu_uses_training_flops_over_the_peak():
    args = bench.argparse.Namespace(device="cuda", precision="bf16-mixed", peak_tflops=100.0)
    assert benchmark.mfu({"flops_per_token": 1e9}, 10_000, args) == pytest.approx(3 * 1e9 * 1e4 / 100e12)
    args.precision = "32-true"
    assert benchmark.mfu({"flops_per_token": 1e9}, 10_000, args) is None


def test_bench_compile_reports_breaks_and_recompiles(monkeypatch, one_thread):
    from model_tools import compiling

    monkeypatch.setattr(compiling, "DEFAULT_BACKEND", "aot_eager")  # inductor's C++ build: ~30 s per model
    results = bench.main(["--variants", "vanilla,mod", "--no_hf", "--no_minimal", "--size", "tiny", "--steps", "2",
                          "--warmup", "1", "--batch_size", "2", "--seq_len", "32", "--vocab_size", "256",
                          "--set", "d_model=32", "--set", "n_layer=2", "--compile", "--recompile_steps", "4",
                          "--precision", "bf16-mixed"])
    for name in ("vanilla", "mod"):  # static shapes: one graph, and fresh routing recompiles nothing
        assert (results[name]["graphs"], results[name]["graph_breaks"], results[name]["recompiles"]) == (1, 0, 0)

def test_bench_override_parsing():
    config = benchmark.apply_overrides(ModelConfig(variant="mode_staged"), ["d_model=64", "mod.capacity=0.25",
                                       "mod.routed_blocks=[1, 2]", "moe.dropless=false", "mod.routed_blocks=odd"])
    assert config.d_model == 64 and config.mod.capacity == 0.25 and config.moe.dropless is False
    assert config.mod.routed_blocks == "odd"
    vanilla = benchmark.apply_overrides(ModelConfig(), ["d_model=64", "mod.capacity=0.25"])  # reads no group: skipped
    assert vanilla.d_model == 64 and vanilla.groups == {}
    with pytest.raises(ConfigError, match="no such"):
        benchmark.apply_overrides(ModelConfig(), ["mod.nope=1"])


def test_init_from_hugging_face_folder_and_own_checkpoint(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    hf_config = GPT2Config(vocab_size=97, n_positions=32, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    hf = GPT2LMHeadModel(hf_config).eval()
    hf.save_pretrained(tmp_path / "hf")
    config = ModelConfig(vocab_size=97, d_model=32, n_layer=2, n_head=2, block_size=32)
    model = build_model(config).eval()
    load_initial_weights(model, str(tmp_path / "hf"))
    idx = torch.randint(0, 97, (2, 32))
    with torch.no_grad():
        torch.testing.assert_close(model(idx).logits, hf(idx).logits, atol=1e-5, rtol=1e-5)
    torch.save({"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}, tmp_path / "x.ckpt")
    other = build_model(config).eval()
    load_initial_weights(other, str(tmp_path / "x.ckpt"))
    torch.testing.assert_close(other(idx).logits, model(idx).logits)
    wrong = build_model(ModelConfig(vocab_size=97, d_model=64, n_layer=2, n_head=2, block_size=32))
    with pytest.raises(ConfigError, match="wte.weight"):
        load_initial_weights(wrong, str(tmp_path / "x.ckpt"))


def test_vanilla_training_step_dispatches_the_minimal_models_ops():
    """CPU speed parity with min_gpt2 by construction: the same aten ops per forward + backward (the one
    extra is the zero auxiliary loss), so any step-time gap could only be Python overhead."""
    import collections

    from torch.utils._python_dispatch import TorchDispatchMode

    class CountOps(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[func.overloadpacket.__name__] += 1
            return func(*args, **(kwargs or {}))

    args = bench.parse_args(["--variants", "vanilla", "--no_hf", "--vocab_size", "256", "--batch_size", "2",
                             "--seq_len", "32", "--set", "d_model=32", "--set", "n_layer=2"])
    batch = torch.randint(0, 256, (2, 33))
    counts = {}
    for name in args.variant_list:
        contender = benchmark.Contender(name, args)
        with CountOps() as mode:
            contender.forward_loss(batch).backward()
        counts[name] = mode.ops
    extra = counts["vanilla"] - counts["min_gpt2"]
    assert sum(extra.values()) <= 1 and set(extra) <= {"new_zeros"}, extra


def test_training_mfu_uses_the_same_peak_table_as_the_bench():
    """One table: a board Lightning's own table misses (H100 NVL, GH200, L40S) still gets a training MFU."""
    from callbacks.flops import peak_flops

    for name in ("NVIDIA H100 NVL", "NVIDIA GH200 480GB", "NVIDIA L40S", "NVIDIA H200"):
        assert peak_flops(name, torch.bfloat16) == benchmark.peak_bf16_flops(name) is not None
    assert peak_flops("NVIDIA H200", torch.float32) == 66.9e12 and peak_flops("NVIDIA L40S", torch.float32) is None


def test_bench_runs_8_and_64_experts_side_by_side_and_times_their_dispatch(one_thread):
    """``VARIANT@GROUP.FIELD=VALUE`` gives each contender its own options; ``--dispatch`` times every MoE layer's
    experts on its routing and on the first MoE contender's (the 56 extra experts idle)."""
    results = bench.main(["--variants", "moe@moe.num_experts=8,moe@moe.num_experts=64@moe.layers=[1]", "--no_hf",
                          "--no_minimal", "--size", "tiny", "--steps", "2", "--warmup", "0", "--batch_size", "2",
                          "--seq_len", "16", "--vocab_size", "128", "--set", "d_model=32", "--set", "n_layer=2",
                          "--dispatch"])
    eight, many = results["moe@moe.num_experts=8"], results["moe@moe.num_experts=64@moe.layers=[1]"]
    assert (eight["dispatch_experts"], eight["dispatch_layers"]) == (8, 2)
    assert (many["dispatch_experts"], many["dispatch_layers"]) == (64, 1)
    assert many["params"] > eight["params"] and "dispatch_forward_ms_first_routing" not in many  # 1 layer vs 2
    assert eight["dispatch_forward_ms_first_routing"] > 0 and eight["dispatch_routing_of"] == "moe@moe.num_experts=8"
    for r in (eight, many, results["vanilla"]):
        assert r["forward_backward_s"] + r["optimizer_s"] == pytest.approx(r["median_step_s"], rel=0.5)
    with pytest.raises(ConfigError, match="moe@mod.capacity=0.5: moe does not use model.mod.capacity"):
        bench.main(["--variants", "moe@mod.capacity=0.5", "--no_hf", "--no_minimal"])
    with pytest.raises(SystemExit):
        bench.main(["--variants", "vanilla", "--dispatch"])


def test_hf_mixtral_references_have_our_moe_s_experts_and_one(one_thread):
    """``hf_mixtral`` (E experts, our top-k) and ``hf_mixtral_1`` (one expert) at our shape; its MoE cost ratio."""
    results = bench.main(["--variants", "vanilla,moe,hf_mixtral,hf_mixtral_1", "--no_hf", "--no_minimal", "--steps",
                          "1", "--warmup", "0", "--batch_size", "2", "--seq_len", "16", "--vocab_size", "64",
                          "--set", "d_model=32", "--set", "n_layer=1", "--set", "moe.num_experts=4"])
    mixtral, one = results["hf_mixtral"], results["hf_mixtral_1"]
    assert mixtral["time_x_one_expert"] == pytest.approx(mixtral["median_step_s"] / one["median_step_s"])
    config = build_model(ModelConfig(variant="vanilla", size="tiny", vocab_size=64, d_model=32, n_layer=1)).config
    model = benchmark.mixtral_model(config, 4, 1)
    assert model.config.num_local_experts == 4 and model.config.num_experts_per_tok == 1
    assert model.config.hidden_size == 32 and model.config.intermediate_size == config.ffn_hidden
    # four experts' gate/up/down stacks, one expert's, and the rest of the two models alike
    expert_params = 3 * config.d_model * config.ffn_hidden
    assert mixtral["params"] - one["params"] == 3 * expert_params + 3 * config.d_model  # + 3 router rows
