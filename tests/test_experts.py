"""Stacked MoE experts (``architectures.experts``): old checkpoints load, the GPT-2 init, no weight decay on
biases, and a dispatch whose work does not grow with the number of idle experts."""
from __future__ import annotations

import copy
import math
import re
import time
from collections import Counter

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from architectures import ModelConfig, build_model
from architectures.experts import GroupedExperts, StackedLinear
from model_tools.weights import load_initial_weights
from lightning_modules.lm import LanguageModelModule, make_adamw, parameter_groups

SHAPE = dict(vocab_size=101, d_model=32, n_layer=4, n_head=4, block_size=32)
#: every user of MoELayer, with the prefix its experts sit under
USERS = {"moe": r"blocks\.\d+\.moe\.experts\.", "moe_dense_ffn": r"blocks\.\d+\.moe\.experts\.",
         "mode_staged": r"blocks\.\d+\.(moe|mlp)\.experts\.", "mode_integrated": r"blocks\.\d+\.(moe|mlp)\.experts\.",
         "cea_moe": r"blocks\.\d+\.attn\.inner\.ffn\.experts\."}


def unstacked(state):
    """The state dict in the layout before the experts were stacked: ``...experts.{i}.c_fc.weight`` etc."""
    old = {}
    for name, value in state.items():
        match = re.fullmatch(r"(.*\.experts\.)(c_fc|c_proj)\.(weight|bias)", name)
        if match is None:
            old[name] = value
            continue
        for i, row in enumerate(value.unbind(0)):
            old[f"{match[1]}{i}.{match[2]}.{match[3]}"] = row.clone()
    return old


def model(variant, seed=0):
    torch.manual_seed(seed)
    return build_model(ModelConfig(variant=variant, **SHAPE)).eval()


@pytest.mark.parametrize("variant", sorted(USERS))
def test_an_old_layout_state_dict_loads_into_the_stacked_experts(variant):
    source, target = model(variant, 0), model(variant, 1)
    old = unstacked(source.state_dict())
    assert any(re.match(USERS[variant] + r"\d+\.c_fc\.weight$", k) for k in old)
    target.load_state_dict(old)  # strict: every old key stacked, nothing missing
    idx = torch.randint(0, SHAPE["vocab_size"], (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(target(idx).logits, source(idx).logits, rtol=0, atol=0)


def test_init_from_an_old_run_of_the_same_variant_loads_every_expert(tmp_path, capsys):
    source = model("moe", 0)
    path = tmp_path / "old.ckpt"  # a Lightning checkpoint of the old layout
    torch.save({"state_dict": {f"model.{k}": v for k, v in unstacked(source.state_dict()).items()},
                "hyper_parameters": {"model": {"variant": "moe"}}}, path)
    target = model("moe", 1)
    report = load_initial_weights(target, str(path), strict=True)
    assert not report.new and report.initialised_share == pytest.approx(1.0)
    for name, value in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], value), name


def test_the_stacked_experts_get_the_mlps_gpt2_init():
    m = build_model(ModelConfig(variant="moe", **{**SHAPE, "d_model": 64}))
    std, L = m.config.init_std, m.config.n_layer
    experts = m.blocks[0].moe.experts
    assert experts.c_fc.weight.std().item() == pytest.approx(std, rel=0.05)
    assert experts.c_proj.weight.std().item() == pytest.approx(std / math.sqrt(2 * L), rel=0.05)
    assert not experts.c_fc.bias.any() and not experts.c_proj.bias.any()
    assert abs(experts.c_fc.weight.mean().item()) < 0.1 * std


def test_stacked_expert_biases_get_no_weight_decay():
    m = model("moe")
    decay, no_decay = parameter_groups(m, 0.1)
    decayed = {id(p) for p in decay["params"]}
    for module in m.modules():
        if isinstance(module, StackedLinear):
            assert id(module.weight) in decayed and id(module.bias) not in decayed
    assert sum(p.numel() for g in (decay, no_decay) for p in g["params"]) == m.num_parameters()


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def dispatch_ops(num_experts, selected, weights, x):
    """aten ops of one forward, and of its backward, of the loop over ``num_experts`` experts."""
    torch.manual_seed(0)
    experts = GroupedExperts(num_experts, x.shape[1], 48)
    x = x.detach().requires_grad_(True)
    with OpCounter() as forward:
        loss = experts.loop(x, selected, weights).pow(2).sum()
    with OpCounter() as backward:
        loss.backward()
    assert all(p.grad is not None for p in experts.parameters())
    idle = torch.ones(num_experts, dtype=torch.bool)
    idle[selected.unique()] = False
    assert not experts.c_fc.weight.grad[idle].any()  # idle experts: zero gradient rows
    return forward.ops, backward.ops


def test_the_loop_runs_one_matmul_pair_per_expert_with_tokens_whatever_the_idle_ones():
    """64 experts of which 3 get tokens do the same aten work as 8 experts with the same routing, forward AND
    backward: the matmuls of the 3 busy experts, nothing per idle expert (their zero gradient rows are one
    ``index_fill`` per stacked weight, one ``index_add`` per bias, whatever their number)."""
    torch.manual_seed(0)
    x = torch.randn(40, 16, requires_grad=True)
    selected = torch.tensor([1, 4, 6]).repeat(14)[:40].view(40, 1)
    weights = torch.rand(40, 1)
    (few, few_back), (many, many_back) = dispatch_ops(8, selected, weights, x), dispatch_ops(64, selected, weights, x)
    assert many == few  # the forward: not one op more for 56 more idle experts
    assert many["addmm"] == 2 * 3 and "mm" not in many  # 2 linears x 3 busy experts
    assert many_back == few_back  # the backward: not one op more either
    # the input and the weight gradient of each linear of each busy expert; one zero-fill per stacked weight
    assert many_back["mm"] == 2 * 2 * 3 and many_back["index_fill_"] == 2 and "stack" not in many_back


def backward_seconds(experts: GroupedExperts, x: torch.Tensor, selected: torch.Tensor, weights: torch.Tensor) -> float:
    """CPU seconds of one backward of the loop (the forward outside the clock), fresh gradients as in training."""
    experts.zero_grad(set_to_none=True)
    loss = experts.loop(x, selected, weights).pow(2).sum()
    start = time.process_time()
    loss.backward()
    return time.process_time() - start


def idle_growth_ratio(d: int, hidden: int, tokens: int, reps: int = 14) -> float:
    """Backward CPU time of 64 experts of which 8 get tokens over that of 8 experts all busy, the same tokens
    (``tokens / 8`` each), interleaved, 1 thread; the ratio of the minima (the first two repetitions warm up)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        x = torch.randn(tokens, d)
        selected = (torch.arange(tokens) % 8).view(tokens, 1)  # experts 0..7 in both layers
        weights = torch.rand(tokens, 1)
        few, many = GroupedExperts(8, d, hidden), GroupedExperts(64, d, hidden)
        times = {8: [], 64: []}
        for rep in range(reps):
            for module in ((few, many) if rep % 2 == 0 else (many, few)):
                times[len(module)].append(backward_seconds(module, x, selected, weights))
        assert not many.c_fc.weight.grad[8:].any() and many.c_fc.weight.grad[:8].all()  # idle: zero, not None
        return min(times[64][2:]) / min(times[8][2:])
    finally:
        torch.set_num_threads(threads)


#: 1024 tokens per busy expert against (64, 128, 32) stacked gradients: the busy experts' matmuls are ~20x the
#: one zero-fill of the 56 idle experts' gradient rows (which the project's rule requires: zero, never None)
D, HIDDEN, TOKENS = 32, 128, 8192


def test_the_loop_s_backward_time_does_not_grow_with_idle_experts():
    """Issue 29: the same tokens through 8 busy experts of 64 (56 idle) and of 8 (none idle), in one process:
    the 64-expert backward is at most 1.35x the 8-expert one (measured 1.07-1.08x on the loaded 2-core
    machine). Work that scales with the idle experts' count beyond the one zero-fill (computing them, per
    expert Python or ops worth ~1/3 of the busy work) fails it; that no op at all is added per idle expert is
    ``test_the_loop_runs_one_matmul_pair_per_expert_with_tokens_whatever_the_idle_ones``. A ratio of minima
    over interleaved repetitions, not an absolute time, so a loaded machine slows both alike."""
    ratio = idle_growth_ratio(D, HIDDEN, TOKENS)
    assert ratio < 1.35, f"64 experts (56 idle) took {ratio:.2f}x the backward of 8 busy experts"


def test_the_loop_s_gradients_equal_autograd_s_per_expert_reference():
    """The loop's one-node backward (``ExpertMLPs``) against autograd through each expert's own MLP
    (``GroupedExperts.expert``, naive indexing), idle experts and a no-op id included, with and without biases."""
    for bias in (True, False):
        torch.manual_seed(1)
        experts = GroupedExperts(6, 16, 24, bias=bias).double()
        x = torch.randn(30, 16, dtype=torch.float64)
        selected = torch.tensor([0, 2, 2, 5, 6]).repeat(12)[:60].view(30, 2)  # 1, 3, 4 idle; 6 a no-op id
        weights = torch.rand(30, 2, dtype=torch.float64)
        grads = []
        for run in ("loop", "reference"):
            experts.zero_grad(set_to_none=True)
            xr = x.clone().requires_grad_(True)
            if run == "loop":
                out = experts.loop(xr, selected, weights)
            else:
                out = torch.zeros_like(xr)
                for e in range(6):
                    for slot in range(2):
                        rows = selected[:, slot] == e
                        out = out.index_add(0, rows.nonzero()[:, 0], weights[rows, slot, None] * experts.expert(e)(xr[rows]))
            out.pow(2).sum().backward()
            grads.append([out.detach(), xr.grad, *(p.grad for p in experts.parameters())])
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
        assert not experts.c_fc.weight.grad[[1, 3, 4]].any() and experts.c_fc.weight.grad[[0, 2, 5]].all()


def old_layout_optimizer_state(module, optimizer):
    """What the old code's AdamW state dict was: a model whose MoE experts are an ``nn.ModuleList`` of GPT-2
    MLPs (built here, for its parameter order and groups), each expert's moments its rows of the stacked ones."""
    from architectures.gpt2 import MLP

    old = copy.deepcopy(module.model)
    stacked = {}
    for layer in old.modules():
        if isinstance(getattr(layer, "experts", None), GroupedExperts):
            new = layer.experts
            d, hidden = new.c_fc.weight.shape[2], new.c_fc.weight.shape[1]
            layer.experts = torch.nn.ModuleList([MLP(d, hidden) for _ in range(len(new))])
            stacked[id(layer)] = new
    own = dict(module.model.named_parameters())
    old_optimizer = make_adamw(parameter_groups(old, 0.1), lr=1e-3)
    for name, param in old.named_parameters():
        match = re.fullmatch(r"(.*\.experts)\.(\d+)\.(c_fc|c_proj)\.(weight|bias)", name)
        source = optimizer.state[own[f"{match[1]}.{match[3]}.{match[4]}" if match else name]]
        old_optimizer.state[param] = {k: (v if k == "step" else v[int(match[2])].clone()) if match else v
                                      for k, v in source.items()}
    return old_optimizer.state_dict()


def test_adamw_state_of_an_old_checkpoint_is_restacked_for_resume():
    module = LanguageModelModule(model=dict(variant="moe", **SHAPE))
    optimizer = module.configure_optimizers()["optimizer"]
    idx = torch.randint(0, SHAPE["vocab_size"], (4, 17))
    out = module.model(idx[:, :-1])
    (F.cross_entropy(out.logits.reshape(-1, SHAPE["vocab_size"]), idx[:, 1:].reshape(-1)) + out.aux_loss).backward()
    optimizer.step()
    checkpoint = {"state_dict": {f"model.{k}": v for k, v in unstacked(module.model.state_dict()).items()},
                  "optimizer_states": [old_layout_optimizer_state(module, optimizer)]}
    assert len(checkpoint["optimizer_states"][0]["state"]) > len(optimizer.state_dict()["state"])
    fresh = LanguageModelModule(model=dict(variant="moe", **SHAPE))
    fresh.on_load_checkpoint(checkpoint)  # Lightning calls it before restoring the optimizer
    fresh.load_state_dict(checkpoint["state_dict"])
    restored = fresh.configure_optimizers()["optimizer"]
    restored.load_state_dict(checkpoint["optimizer_states"][0])
    want = optimizer.state_dict()
    got = restored.state_dict()
    assert [g["params"] for g in got["param_groups"]] == [g["params"] for g in want["param_groups"]]
    for index, moments in want["state"].items():
        for key, value in moments.items():
            torch.testing.assert_close(got["state"][index][key], value, rtol=0, atol=0)
    for name, value in module.model.state_dict().items():
        assert torch.equal(fresh.model.state_dict()[name], value), name
