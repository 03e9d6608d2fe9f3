"""The ``Router`` modules (``architectures/routing.py``, issue 21 item 2): every routed family routes through
them, only the routing library builds routing sites, and the routers keep the parameter names of the layers
they replaced (old checkpoints load)."""
from __future__ import annotations

import ast

import pytest
import torch
import torch.nn.functional as F

from architectures import build_model, variant_names
from architectures.base import ForwardState
from architectures.registry import VARIANTS
from architectures.routing import Router
from tests import invariants
from tests.conftest import REPO

#: where a ``RoutingSite`` may be constructed: the routing library and the contract; MoDE staged re-lays its
#: MoE site (``_select_tokens``, ``expand_site``: transforms of a site the Router built)
SITE_BUILDERS = {("routing.py", "report_site"), ("mod.py", "_select_tokens"), ("mod.py", "expand_site")}


def site_constructions():
    """(file, enclosing function) of every ``RoutingSite(...)`` call and every ``.trace.append(...)`` in architectures/."""
    found = []
    for path in sorted((REPO / "architectures").glob("*.py")):
        tree = ast.parse(path.read_text())
        for func in ast.walk(tree):
            if not isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(func):
                if not isinstance(node, ast.Call):
                    continue
                target = node.func
                builds = isinstance(target, ast.Name) and target.id == "RoutingSite"
                appends = (isinstance(target, ast.Attribute) and target.attr == "append"
                           and isinstance(target.value, ast.Attribute) and target.value.attr == "trace")
                if builds or appends:
                    found.append((path.name, func.name, "RoutingSite" if builds else "trace.append"))
    return found


def test_only_the_routing_library_builds_and_reports_sites():
    found = site_constructions()
    assert ("routing.py", "report_site", "RoutingSite") in found  # the scan sees what it looks for
    stray = [f for f in found if (f[0], f[1]) not in SITE_BUILDERS and f != ("base.py", "report", "trace.append")]
    assert not stray, f"routing sites built or appended outside the Router: {stray}"


@pytest.mark.parametrize("name", variant_names())
def test_every_router_of_every_variant_is_a_router_module(name, one_thread):
    torch.manual_seed(0)
    model = build_model(VARIANTS[name].test_config(name))
    routers = invariants.router_modules(model)
    assert all(isinstance(module, Router) for module in routers.values()), \
        {n: type(m).__name__ for n, m in routers.items() if not isinstance(m, Router)}
    with torch.no_grad():
        trace = model(torch.randint(0, 97, (2, 8))).trace
    assert bool(routers) == any(site.logits is not None for site in trace), (name, sorted(routers))


@pytest.mark.parametrize("name,extra,keys", [
    ("moe", {}, ["blocks.0.moe.router.weight"]),
    ("mod", {}, ["blocks.1.router.weight", "blocks.1.predictor.0.weight"]),
    ("mot", {}, ["blocks.0.gate.weight"]),
    ("mot", {"mot": {"gate_hidden": 8}}, ["blocks.0.gate.fc.weight", "blocks.0.gate.fc.bias", "blocks.0.gate.out.weight"]),
    ("mom", {}, ["chunks.0.attn_router.cell.weight_ih", "chunks.0.ffn_router.out.weight"]),
    ("depth_gate", {}, ["gate.weight"]),
    ("cea_moe", {}, ["blocks.0.attn.inner.ffn.router.weight"]),
])
def test_routers_keep_the_parameter_names_of_old_checkpoints(name, extra, keys):
    """The routers are the linear / MLP / GRU layers they replaced, under the same names: old state dicts load."""
    model = build_model(VARIANTS[name].test_config(name, **extra))
    state = model.state_dict()
    assert set(keys) <= set(state), sorted(k for k in state if "router" in k or "gate" in k)
    model.load_state_dict(state)


def test_a_router_reports_with_the_state_valid_mask_and_fp32_logits_under_autocast():
    torch.manual_seed(0)
    model = build_model(VARIANTS["moe"].test_config("moe"))
    router = model.blocks[0].moe.router
    valid = torch.ones(2, 6, dtype=torch.bool)
    valid[1, 4:] = False
    state = ForwardState(cache=None, valid=valid, causal=False, residuals=None)
    x = torch.randn(2, 6, router.in_features)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        route = router(x, state)
    assert state.trace == [route.site] and torch.equal(route.site.valid, valid)
    assert route.site.logits.dtype == torch.float32 and torch.equal(route.site.logits, F.linear(x, router.weight))
    assert set(state.aux) == {"layer0.moe/balance", "layer0.moe/z_loss"}
