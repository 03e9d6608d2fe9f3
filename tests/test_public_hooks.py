"""The public hooks that replaced reaching into internals (issue 21 §6): MoM's analysis hooks used by
experiments/repro/mom.py, and ``KVCache.state`` for a variant's per-row decoding state."""
from __future__ import annotations

import pytest
import torch

from architectures import KVCache, ModelConfig, build_model
from architectures.config import ConfigError
from architectures.registry import VARIANTS
from experiments.repro.mom import module_similarity, removal_order


def tiny_mom():
    torch.manual_seed(0)  # the registry's tiny MoM (d 32, 4 layers, T 32, vocab 97) with K = 2 over H = 3 steps
    return build_model(VARIANTS["mom"].test_config("mom", mom={"top_k": 2, "steps": 3})).eval()


def test_module_similarity_is_one_for_identical_modules_and_below_for_distinct_ones():
    model = tiny_mom()
    idx = torch.randint(0, 97, (2, 17))
    n_attn, n_ffn = model.pool_sizes()
    assert (n_attn, n_ffn) == (4, 4)
    outputs = model.pool_outputs(idx[:, :-1])
    assert [o.shape for o in outputs["attn"]] == [(2, 16, 96)] * n_attn
    assert [o.shape for o in outputs["ffn"]] == [(2, 16, 32)] * n_ffn
    distinct = module_similarity(model, idx)
    assert distinct["attn"] < 0.99 and distinct["ffn"] < 0.99
    chunk = model.chunks[0]
    with torch.no_grad():
        for module in [*chunk.attn_modules[1:]]:
            module.load_state_dict(chunk.attn_modules[0].state_dict())
    same = module_similarity(model, idx)
    assert same["attn"] == pytest.approx(1.0, abs=1e-5) and same["ffn"] == pytest.approx(distinct["ffn"])


def test_removal_order_by_index_reads_the_pool_sizes_and_non_mom_models_are_refused():
    assert removal_order(tiny_mom(), torch.zeros(1, 17, dtype=torch.long), "index") == ([3, 2, 1, 0], [3, 2, 1, 0])
    vanilla = build_model(ModelConfig(vocab_size=64, d_model=32, n_layer=2, n_head=2, block_size=16))
    with pytest.raises(ConfigError, match="not a Mixture-of-Modules model"):
        module_similarity(vanilla, torch.zeros(1, 17, dtype=torch.long))


def test_kv_cache_state_is_per_kind_and_follows_reorder():
    cache = KVCache()
    cache.state("budget")["site"] = torch.tensor([[1], [2], [3]])
    cache.state("prefix")["site"] = (torch.tensor([10.0, 20.0, 30.0]), torch.tensor([1.0, 2.0, 3.0]))
    assert cache.state("budget") is cache.state("budget") and "site" not in cache.state("other")
    cache.reorder(torch.tensor([2, 0]))
    assert cache.state("budget")["site"].tolist() == [[3], [1]]
    total, count = cache.state("prefix")["site"]
    assert total.tolist() == [30.0, 10.0] and count.tolist() == [3.0, 1.0]
    assert not [name for name in vars(cache) if name not in ("layers", "offset", "_states")]
