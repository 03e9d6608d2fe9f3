"""The invariant checks every registered variant must pass, as plain functions.

``tests/test_contract.py`` runs them over every registry entry; ``tests/test_invariant_mutations.py``
runs them on toy variants with one planted bug each and asserts that they fail, so a check that can no
longer catch its bug class is noticed. Each check raises ``AssertionError`` naming what broke.
"""
from __future__ import annotations

import contextlib
import re
from typing import Dict, Iterator, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from architectures.base import ForwardState
from architectures.experts import StackedLinear

#: a module whose attribute name matches is a router: it makes a routing decision (MoE/MoD ``router``,
#: MoM ``attn_router`` / ``ffn_router``, MoT / depth-gating ``gate``). MoD's ``predictor`` is not: it
#: only predicts the router's choice for causal decoding.
ROUTER_MODULE = re.compile(r"(^|\.)(\w*router|gate)$")


#: a parameter of a router module (its own, or of a part of it: MoM's ``attn_router.out``, MoT's ``gate.fc``)
ROUTER_PARAMETER = re.compile(r"(^|\.)(\w*router|gate)\.")


def router_modules(model: nn.Module) -> Dict[str, nn.Module]:
    """The routers (by attribute name, or a module class named ``*Router``), outermost only: a router's
    own parts (MoM's ``attn_router.out``) are not routers of their own."""
    found: Dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        is_router = bool(ROUTER_MODULE.search(name)) or (bool(name) and type(module).__name__.endswith("Router"))
        if is_router and not any(name.startswith(outer + ".") for outer in found):
            found[name] = module
    return found


def changed_after(idx: torch.Tensor, t: int, vocab_size: int) -> torch.Tensor:
    """``idx`` with every token from position ``t`` on replaced by a different one."""
    changed = idx.clone()
    changed[:, t:] = (idx[:, t:] + 1 + torch.arange(idx.shape[1] - t)) % vocab_size
    return changed


@contextlib.contextmanager
def mode(model: nn.Module, training: bool) -> Iterator[nn.Module]:
    was = model.training
    model.train(training)
    try:
        yield model
    finally:
        model.train(was)


# ---------------------------------------------------------------------------- causality
def check_causal(model, idx: torch.Tensor, t: int, training: bool, causal_routing: bool = False) -> None:
    """Logits and routing choices at positions < t do not depend on the tokens from t on.

    Run in training mode too (a look-ahead that only happens in training is a leak into the loss), with
    the same RNG state for both forwards so dropout and sampled routing draw alike. ``causal_routing``:
    inside ``model.causal_routing()`` (generation's routing); else the default routing, which must be
    causal unless the model declares ``routing_sees_future``.
    """
    other = changed_after(idx, t, model.config.vocab_size)
    outs = []
    context = model.causal_routing if causal_routing else contextlib.nullcontext
    with mode(model, training), torch.no_grad(), context():
        for tokens in (idx, other):
            torch.manual_seed(1234)
            outs.append(model(tokens))
    a, b = outs
    where = f"{'training' if training else 'eval'} mode{', causal_routing()' if causal_routing else ''}"
    if not causal_routing and model.routing_sees_future:
        # an honest flag: the default routing does look ahead somewhere (else the flag costs a causal pass)
        assert not torch.allclose(a.logits[:, :t], b.logits[:, :t], atol=1e-6), \
            f"routing_sees_future is declared but the logits ignore later tokens ({where})"
        return
    diff = (a.logits[:, :t] - b.logits[:, :t]).abs().max().item()
    assert diff <= 1e-5, f"positions < {t} change by {diff:.2e} when later tokens change ({where}): a look-ahead"
    for sa, sb in zip(a.trace, b.trace):
        assert torch.equal(sa.selected[:, :t], sb.selected[:, :t]), f"{sa.name}: routing looks ahead ({where})"
        if sa.dropped is not None:
            assert torch.equal(sa.dropped[:, :t], sb.dropped[:, :t]), f"{sa.name}: dropping looks ahead ({where})"


# ---------------------------------------------------------------------------- fp32 router values
_CASTS = {torch.Tensor.to, torch.Tensor.bfloat16, torch.Tensor.half, torch.Tensor.float, torch.Tensor.type}


class _RouterCalls(TorchFunctionMode):
    """Records every ``F.linear`` whose weight is a router parameter, or a copy of one cast to another
    dtype: (name, input, the parameter itself, bias, output)."""

    def __init__(self, params: Dict[int, tuple]):
        super().__init__()
        self.params, self.calls = dict(params), []  # id -> (name, parameter): casts are added as seen

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in _CASTS and args and id(args[0]) in self.params and isinstance(out, torch.Tensor):
            self.params[id(out)] = (*self.params[id(args[0])], out)  # keep the copy alive: ids stay unique
        elif func is F.linear:
            x, weight = args[0], args[1] if len(args) > 1 else kwargs["weight"]
            bias = args[2] if len(args) > 2 else kwargs.get("bias")
            if id(weight) in self.params:
                name, param = self.params[id(weight)][:2]
                self.calls.append((name, x.detach(), param.detach(), None if bias is None else bias.detach(),
                                   out.detach()))
        return out


def _rounded_to(tensor: torch.Tensor, dtype: torch.dtype) -> float:
    """Share of the nonzero values that are exactly representable in ``dtype`` (an fp32 matmul leaves
    almost none so; a bf16 one cast to float leaves all)."""
    values = tensor.detach().float().flatten()
    values = values[values != 0]
    if values.numel() == 0:
        return 0.0
    return float((values.to(dtype).float() == values).float().mean())


def check_router_fp32(model, idx: torch.Tensor) -> None:
    """Under bf16 autocast the router projections are those of an fp32 computation, value for value.

    Each site's logits must not be bf16 / fp16 values cast to float; every ``F.linear`` on a router
    parameter (or on a copy of it cast to another dtype) is recomputed in fp32 (autocast off) from its
    recorded input and the parameter itself, and must match exactly. (An input cast down by hand before
    an fp32 projection is not seen: its fp32 original is not recorded.)
    """
    routers = router_modules(model)
    params = {id(p): (name, p) for name, p in model.named_parameters()
              if ROUTER_PARAMETER.search(name) or any(name.startswith(r + ".") for r in routers)}
    recorder = _RouterCalls(params)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), recorder:
        torch.manual_seed(1234)
        out = model(idx)
    for site in out.trace:
        for what in ("logits", "weights", "probs"):
            tensor = getattr(site, what)
            assert tensor is None or tensor.dtype == torch.float32, f"{site.name}.{what} is {tensor.dtype}"
        if site.logits is not None and site.logits.numel() >= 16:
            for low in (torch.bfloat16, torch.float16):
                share = _rounded_to(site.logits, low)
                assert share < 0.5, f"{site.name}: {100 * share:.0f}% of the router logits are {low} values cast to float"
    assert recorder.calls or not params, \
        f"no F.linear on the router parameters {sorted(n for n, _ in params.values())[:4]} was seen: " \
        "compute routers with architectures.routing.fp32_linear"
    for name, x, weight, bias, result in recorder.calls:
        with torch.autocast("cpu", enabled=False):
            exact = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        assert result.dtype == torch.float32, f"{name}: router projection ran in {result.dtype} under autocast"
        assert torch.equal(result, exact), \
            f"{name}: router projection differs from its fp32 recomputation by {(result - exact).abs().max():.2e}"


# ---------------------------------------------------------------------------- routing sites
def _sites_per_block(model, idx: torch.Tensor, attention_mask: Optional[torch.Tensor]):
    """Forward once; returns (output, {block name: sites it reported}, sites reported outside any block,
    {module name: times it was called}).

    A block is a module called with the ``ForwardState`` (the block protocol) that is not a router (a
    ``Router`` is called with the state to report for its block); a site counts for the innermost block
    that was running when it was appended to the trace.
    """
    names = {module: name for name, module in model.named_modules()}
    routers = set(router_modules(model).values())
    stack: List[list] = []
    per_block: Dict[str, List[str]] = {}
    calls: Dict[str, int] = {}

    def find_state(module, args, kwargs):
        if module in routers:
            return None
        return next((a for a in (*args, *kwargs.values()) if isinstance(a, ForwardState)), None)

    def before(module, args, kwargs):
        calls[names[module]] = calls.get(names[module], 0) + 1
        state = find_state(module, args, kwargs)
        if state is not None:
            stack.append([module, len(state.trace)])

    def after(module, args, kwargs, output):
        state = find_state(module, args, kwargs)
        if state is None or not stack or stack[-1][0] is not module:
            return
        _, start = stack.pop()
        new = [s.name for s in state.trace[start:]]
        per_block.setdefault(names[module], []).extend(new)
        for frame in stack:  # the enclosing blocks do not count these again
            frame[1] += len(new)

    handles = []
    for module in model.modules():
        if module is not model:
            handles.append(module.register_forward_pre_hook(before, with_kwargs=True))
            handles.append(module.register_forward_hook(after, with_kwargs=True))
    try:
        out = model(idx, attention_mask=attention_mask)
    finally:
        for handle in handles:
            handle.remove()
    in_blocks = {n for sites in per_block.values() for n in sites}
    outside = [s.name for s in out.trace if s.name not in in_blocks]
    return out, per_block, outside, calls


def check_routing_sites(model, idx: torch.Tensor, attention_mask: torch.Tensor) -> None:
    """One site per router per routed block, unique names, and the valid mask present and honoured.

    * a block (called with the ``ForwardState``) reports exactly as many sites per forward as it owns
      routers (MoDE staged: the MoD router and the MoE router); routers outside the blocks (MoM's GRU
      routers, depth gating's gate) report at least one site; in training and in eval mode;
    * site names are unique within a forward;
    * with ``attention_mask`` (right padding) every site carries ``valid``, never marking a padding token,
      and its statistics (``counts()``) do not change when the padding tokens do.
    """
    routers = router_modules(model)
    for training in (True, False):
        with mode(model, training), torch.no_grad():
            torch.manual_seed(1234)
            out, per_block, outside, calls = _sites_per_block(model, idx, attention_mask)
        where = "training" if training else "eval"
        names = [s.name for s in out.trace]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        assert not duplicates, f"site names reported more than once in one forward ({where}): {duplicates}"
        routed = {s.name for s in out.trace if s.logits is not None or s.probs is not None}  # not a fixed choice
        blocks = sorted(per_block, key=len, reverse=True)
        owner = {r: next((b for b in blocks if b and r.startswith(b + ".")), None) for r in routers}
        for block, sites in per_block.items():
            own = [r for r, b in owner.items() if b == block]
            # a router module called h times (MoM's GRU router, once per step) decides h times; one read
            # through its weight (fp32_linear(x, router.weight)) decides once
            expected = sum(max(1, calls.get(r, 0)) for r in own)
            decided = [n for n in sites if n in routed]
            assert len(decided) == expected, (
                f"{block} reported {len(decided)} routed sites {decided} in one forward ({where}) for its routers "
                f"{own} that decided {expected} times: each routing decision reports exactly one site")
        unowned = [r for r, b in owner.items() if b is None]
        assert not unowned or any(n in routed for n in outside), \
            f"routers {unowned} outside the blocks reported no routing site ({where})"
    pad = ~attention_mask.bool()
    junk = idx.clone()
    junk[pad] = (idx[pad] + 7) % model.config.vocab_size
    with mode(model, False), torch.no_grad():
        first, second = model(idx, attention_mask=attention_mask), model(junk, attention_mask=attention_mask)
    for a, b in zip(first.trace, second.trace):
        assert a.valid is not None, f"{a.name}: no valid mask under padding (padding would count in its statistics)"
        assert not (a.valid.bool() & pad).any(), f"{a.name}: its valid mask marks padding tokens as real"
        assert torch.equal(a.counts(), b.counts()), f"{a.name}: routing statistics change with the padding tokens"


# ---------------------------------------------------------------------------- initialisation
def check_initialised(model) -> None:
    """``build_model``'s weights follow the suite's init (GPT-2: N(0, init_std), residual projections
    N(0, init_std / sqrt(2L)), zero biases), not PyTorch's defaults (N(0, 1) embeddings, uniform
    +-1/sqrt(fan_in) linear weights and biases). Weights set to a 0/1 pattern on purpose (MoT's W_c = [I .. I])
    and all-zero weights pass."""
    std = model.config.init_std
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding, StackedLinear)):
            weights = {"weight": module.weight}
        elif isinstance(module, nn.RNNCellBase):
            weights = {n: p for n, p in module.named_parameters(recurse=False) if not n.startswith("bias")}
        else:
            continue
        for pname, weight in weights.items():
            w = weight.detach().float()
            if bool(((w == 0) | (w == 1)).all()):
                continue
            observed = float(w.std())
            assert observed <= 1.5 * std, \
                f"{name}.{pname}: std {observed:.3g}, expected at most model.init_std={std} (PyTorch's default init?)"
        biases = [p for n, p in module.named_parameters(recurse=False) if n.startswith("bias")]
        if isinstance(module, (nn.Linear, nn.RNNCellBase, StackedLinear)):
            for bias in biases:
                if bias is not None:
                    assert not bias.detach().any(), f"{name}: biases not zero (PyTorch's default init?)"


# ---------------------------------------------------------------------------- routing health
def check_routing_healthy(trace, skip_budget: float = 0.9, collapse: float = 0.95) -> None:
    """After training: at most ``skip_budget`` of a site's slots go to no-op / SKIP choices, and no pool of
    real choices (a site's experts; the steps of a MoM router share one pool) sends ``collapse`` or more
    of its assignments to one member."""
    pools: Dict[str, torch.Tensor] = {}
    for site in trace:
        counts = site.counts().float()
        share = counts / counts.sum().clamp(min=1)
        skip = sum(float(share[i]) for i, c in enumerate(site.choice_names) if c == "skip")
        assert skip <= skip_budget + 1e-6, f"{site.name}: {skip:.2f} of the slots go to skip (budget {skip_budget})"
        real = torch.tensor([float(counts[i]) for i, c in enumerate(site.choice_names) if c != "skip"])
        key = site.group if site.name.startswith("mom.") else site.name
        pools[key] = pools.get(key, 0) + real
    for key, real in pools.items():
        if real.numel() > 1 and real.sum() > 0:
            assert float(real.max()) < collapse * float(real.sum()), \
                f"pool {key} collapsed onto one member: {real.tolist()}"


def train_briefly(model, batches, steps: int, vocab_size: int, lr: float = 3e-3) -> None:
    """``steps`` AdamW steps of LM loss + aux loss (the routing-health setting)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        batch = next(batches)
        out = model(batch[:, :-1])
        loss = F.cross_entropy(out.logits.reshape(-1, vocab_size), batch[:, 1:].reshape(-1)) + out.aux_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()


# ---------------------------------------------------------------------------- idle units
def idle_choices(trace) -> List[str]:
    """``site:choice`` for every real (not SKIP / no-op) choice of a learned site that no token took."""
    idle = []
    for site in trace:
        if site.logits is None and site.probs is None:
            continue  # a fixed choice: nothing is routed
        counts = site.counts()
        idle += [f"{site.name}:{c}" for i, c in enumerate(site.choice_names) if c != "skip" and int(counts[i]) == 0]
    return idle


def check_idle_units_get_zero_gradients(model, idx: torch.Tensor) -> List[str]:
    """After one training forward + backward (LM loss + aux loss), every parameter has a gradient: an expert,
    module or block that no token chose gets a zero one, never None, on every path (eager loop, grouped GEMM,
    compiled), so AdamW's weight decay and momentum treat it alike everywhere. Returns the idle choices (the
    caller checks that ``idx`` really left some unit idle)."""
    with mode(model, True):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1234)
        out = model(idx)
        V = out.logits.shape[-1]
        (F.cross_entropy(out.logits.reshape(-1, V), idx.reshape(-1)) + out.aux_loss).backward()
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    idle = idle_choices(out.trace)
    assert not missing, (f"{len(missing)} parameters got no gradient (None, not zero) after a step where "
                         f"{idle[:3] or 'no unit'} was idle: {missing[:4]}; run an idle unit on zero tokens "
                         "when gradients are recorded (architectures.dispatch.sorted_dispatch)")
    model.zero_grad(set_to_none=True)
    return idle
