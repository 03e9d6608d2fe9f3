"""Language-model pre-training LightningModule for every registered architecture.

Reads only the model contract (``ModelOutput``): LM loss + the model's auxiliary loss, logged with
its named parts; the latest routing trace (no logits) is kept on ``self.last_output`` for callbacks.
"""
from __future__ import annotations

import math
import re
import pathlib
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Optional, Tuple

import lightning as L
import torch
import torch.distributed
import torch.nn.functional as F
from torchmetrics import MeanMetric

from architectures import ModelConfig, build_model
from architectures.config import ConfigError
from architectures.contract import ModelOutput, first_nonfinite_site
from architectures.experts import legacy_order, legacy_parameter_names
from lightning_modules.flops_budget import FlopsBudget, require_counted_flops
from lightning_modules.rng_state import rank_rng_states, restore_rank_rng_states
from lightning_modules.steps import batch_step, completes_step, is_logging_step, log_step, may_be_last_step  # noqa: F401


@dataclass
class OptimConfig:
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    warmup_steps: int = 50
    # Length of the cosine schedule; None: trainer.max_steps. Set it to stop early and resume later
    # on the same schedule.
    schedule_steps: Optional[int] = None
    # Steps between NaN/Inf checks of the training loss (each check is a host sync); None: every
    # logging step (trainer.log_every_n_steps) and the last step. A failure names the first bad step.
    nonfinite_check_every: Optional[int] = None

    def validate(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"optim.lr: must be > 0, got {self.lr}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio: must be in [0, 1], got {self.min_lr_ratio}")
        if self.weight_decay < 0:
            raise ConfigError(f"optim.weight_decay: must be >= 0, got {self.weight_decay}")
        if self.schedule_steps is not None and self.schedule_steps <= 0:
            raise ConfigError(f"optim.schedule_steps: must be a positive integer, got {self.schedule_steps}")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps: must be >= 0, got {self.warmup_steps}")
        every = self.nonfinite_check_every
        if every is not None and (not isinstance(every, int) or every <= 0):
            raise ConfigError(f"optim.nonfinite_check_every: must be a positive integer or null, got {every!r}")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optim.{name}: must be in [0, 1), got {getattr(self, name)}")


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, cosine decay to ``min_ratio`` at ``total`` steps."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    return cosine_decay(min(1.0, (step - warmup) / max(1, total - warmup)), min_ratio)


def cosine_decay(progress: float, min_ratio: float) -> float:
    """LR multiplier after the warmup: 1 at ``progress`` 0, ``min_ratio`` at 1."""
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """Decay matrices (linear / embedding weights); never biases (stacked experts' (E, out) biases included),
    LayerNorm or scalar gates."""
    params = dict(model.named_parameters())  # tied parameters once
    decay, no_decay = group_names(model)
    return [
        {"params": [params[n] for n in decay], "weight_decay": weight_decay},
        {"params": [params[n] for n in no_decay], "weight_decay": 0.0},
    ]


def group_names(model: torch.nn.Module) -> Tuple[List[str], List[str]]:
    """(decayed, not decayed) parameter names, in ``parameter_groups``' order."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (decay if param.dim() >= 2 and not name.endswith("bias") else no_decay).append(name)
    return decay, no_decay


def stack_legacy_optimizer_state(model: torch.nn.Module, state: Dict[str, Any]) -> Dict[str, Any]:
    """An optimizer state dict saved when the MoE experts were an ``nn.ModuleList`` of MLPs (two groups of
    ``parameter_groups``: 2-D tensors decayed, in that layout's parameter order), re-indexed to the stacked
    parameters, each one's per-expert moments stacked along dim 0 (its step: the largest). Returned as it is
    when its parameter count is not that of the old layout."""
    stacked, params = legacy_parameter_names(model), dict(model.named_parameters())
    per_expert = {old: new for new, olds in stacked.items() for old in olds}
    old = legacy_order(model)
    if not stacked or sum(len(g["params"]) for g in state["param_groups"]) != len(old):
        return state
    two_d = [n for n in old if (params[per_expert[n]].dim() - 1 if n in per_expert else params[n].dim()) >= 2]
    old_index = {n: i for i, n in enumerate(two_d + [n for n in old if n not in set(two_d)])}
    new_names = [n for names in group_names(model) for n in names]
    moments = {}
    for i, name in enumerate(new_names):
        saved = [state["state"].get(old_index[n]) for n in stacked.get(name, [name])]
        if name in stacked and any(saved):
            moments[i] = _stack_moments(saved)
        elif saved[0] is not None:
            moments[i] = saved[0]
    groups, start = [], 0
    for group, names in zip(state["param_groups"], group_names(model)):
        groups.append({**group, "params": list(range(start, start + len(names)))})
        start += len(names)
    return {"state": moments, "param_groups": groups}


def _stack_moments(saved: List[Optional[Dict[str, torch.Tensor]]]) -> Dict[str, torch.Tensor]:
    """Per-expert AdamW state -> the stacked parameter's: moments stacked (zeros for an expert never stepped)."""
    first = next(s for s in saved if s)
    out = {}
    for key, value in first.items():
        if key == "step":
            out[key] = max((s[key] for s in saved if s), key=float)
        else:
            out[key] = torch.stack([s[key] if s else torch.zeros_like(value) for s in saved])
    return out


def make_adamw(params, **kwargs) -> torch.optim.AdamW:
    """AdamW with the fused kernel (CPU and CUDA): one pass over all parameters instead of many small ops."""
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # a device/dtype without a fused kernel
        return torch.optim.AdamW(params, **kwargs)


class NonFiniteLossError(FloatingPointError):
    pass


def detached_trace(trace):
    """The routing trace without autograd history (callbacks read it after the step's backward)."""
    out = []
    for site in trace or []:
        changes = {f: getattr(site, f).detach() for f in ("weights", "probs", "logits")
                   if isinstance(getattr(site, f, None), torch.Tensor)}
        out.append(replace(site, **changes))
    return out


class NonFiniteGuard:
    """Checks the training losses for NaN/Inf every ``every`` steps, not on every step (a host sync).

    The losses and batches of the unchecked steps stay on the device; a check stacks them and reads one
    flag (under DDP the maximum over ranks, so every rank stops together). On failure the first bad step
    and its batch are known from the kept losses.
    """

    def __init__(self, every: Optional[int]):
        self.every = every
        self.pending: List[Tuple[int, torch.Tensor, torch.Tensor]] = []  # (step, loss, batch)

    def add(self, step: int, loss: torch.Tensor, batch: torch.Tensor) -> None:
        self.pending.append((step, loss.detach().float().reshape(()), batch))

    def due(self, trainer, completed_steps: int) -> bool:
        if self.every is None:
            return is_logging_step(trainer, completed_steps)
        return completed_steps % self.every == 0 or may_be_last_step(trainer, completed_steps)

    def first_bad(self, trainer) -> Optional[Tuple[int, float, torch.Tensor]]:
        """(step, loss, batch) of the first non-finite loss here (or on another rank: step -1); clears the record."""
        if not self.pending:
            return None
        losses = torch.stack([loss for _, loss, _ in self.pending])
        bad = ~torch.isfinite(losses)
        flag = bad.any().float()
        if trainer.world_size > 1:
            flag = trainer.strategy.reduce(flag, reduce_op="max")
        pending, self.pending = self.pending, []
        if not bool(flag > 0):
            return None
        if not bool(bad.any()):
            return -1, float("nan"), pending[-1][2]
        first = int(bad.long().argmax())
        step, loss, batch = pending[first]
        return step, float(loss), batch


class LanguageModelModule(L.LightningModule):
    """Pre-training module. What it keeps between steps for the callbacks is lean (issue 12): the detached
    routing trace, the aux-loss parts, the batch shape and the LM loss, never the logits.

    Logged metrics (reduced over DDP ranks on logging steps only, one all-reduce):
    ``train/loss``, ``train/ppl``, ``train/aux_loss``, ``train/total_loss``, ``aux/<part>`` are global-batch
    means; ``val/loss``, ``val/ppl`` (and ``val/loss_causal``, ``val/ppl_causal`` for models whose routing
    sees the future) are token-weighted means over every rank's validation batches. Under a loss mask
    (``data.loss_mask``; a batch is then ``(tokens, weights)``) the LM losses are weighted means, sum(w * ce) / sum(w),
    and the validation means are weighted by sum(w).
    """

    def __init__(self, model: Dict[str, Any], optim: Optional[Dict[str, Any]] = None, max_steps: int = 1000,
                 val_names: Optional[List[str]] = None, max_train_flops: Optional[float] = None):
        super().__init__()
        self.save_hyperparameters()
        self.model_config = ModelConfig.from_dict(model)
        self.model = build_model(self.model_config)
        self.model_config = self.model.config
        self.optim = OptimConfig(**(optim or {}))
        self.optim.validate()
        self.max_steps = self.optim.schedule_steps or max_steps
        # with a FLOPs budget the run stops when the measured count reaches it, and the cosine follows the count
        self.flops_budget = FlopsBudget(max_train_flops) if max_train_flops is not None else None
        if self.flops_budget is not None and self.optim.schedule_steps is not None:
            raise ConfigError("optim.schedule_steps: cannot be combined with max_train_flops (the cosine then ends "
                              "where the FLOPs budget is spent); drop one of them")
        self.val_names = val_names or ["val"]
        self.val_loss = torch.nn.ModuleList([MeanMetric() for _ in self.val_names])
        # a model without a trained causal decision has no causal loss to report (only an untrained rule's)
        self.causal_eval = self.model.routing_sees_future and self.model.has_causal_routing
        self.val_loss_causal = torch.nn.ModuleList([MeanMetric() for _ in self.val_names]) if self.causal_eval else None
        # forward FLOPs per token of the causal evaluation: a trained MoD's causal decision processes its own
        # share of the tokens, not the capacity the training-time FLOPs figure assumes
        self.val_flops_causal = torch.nn.ModuleList([MeanMetric() for _ in self.val_names]) if self.causal_eval else None
        self.predictor_counts: Dict[str, torch.Tensor] = {}  # site -> [tp, fp, fn, tn] of causal vs top-k
        self.tokens_seen = 0  # global (all ranks): every rank sees the same batch shape
        self.last_output: Optional[ModelOutput] = None  # trace + aux parts only (logits=None)
        self.last_lm_loss: Optional[torch.Tensor] = None
        self.last_batch_shape: Optional[Tuple[int, int]] = None  # (B, T) trained on this rank
        self.nonfinite = NonFiniteGuard(self.optim.nonfinite_check_every)
        self._step_sums: Optional[Tuple[torch.Tensor, int]] = None  # training scalars summed over micro-batches
        self.resumed_rng_states: Optional[List[Dict[str, torch.Tensor]]] = None  # a resumed checkpoint's generators

    # ------------------------------------------------------------------ core
    def forward(self, idx: torch.Tensor, **kwargs) -> ModelOutput:
        return self.model(idx, **kwargs)

    @staticmethod
    def split(batch: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return batch[:, :-1], batch[:, 1:]

    @staticmethod
    def unpack(batch) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(tokens (B, T+1), loss weights (B, T) or None): a batch under a loss mask is a (tokens, weights) pair."""
        if isinstance(batch, (list, tuple)):
            return batch[0], batch[1]
        return batch, None

    def lm_loss(self, logits: torch.Tensor, targets: torch.Tensor, weights: Optional[torch.Tensor] = None,
                total_weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Mean next-token cross-entropy; with ``weights`` (a loss mask, ``data.loss_mask``) the weighted mean
        sum(w * ce) / sum(w), so a target of weight 0 cannot change it (0 when every weight is 0).
        ``total_weight`` replaces sum(w) as the divisor (training: ``rank_mean_weight``)."""
        flat = logits.float().reshape(-1, logits.shape[-1])
        if weights is None:
            return F.cross_entropy(flat, targets.reshape(-1))
        ce = F.cross_entropy(flat, targets.reshape(-1), reduction="none")
        w = weights.reshape(-1).to(ce.dtype)
        total = w.sum() if total_weight is None else total_weight.to(ce.dtype)
        return (ce * w).sum() / total.clamp_min(torch.finfo(ce.dtype).tiny)

    def rank_mean_weight(self, weights: torch.Tensor) -> torch.Tensor:
        """sum(w) of this micro-batch, averaged over the DDP ranks (a scalar all-reduce, no host sync): divided by
        it, each rank's weighted sum makes DDP's gradient mean, and the logged mean over ranks, the weighted mean
        over the global batch, although the ranks hold different numbers of labelled targets."""
        total = weights.sum().float()
        if self.trainer.world_size > 1:  # not strategy.reduce: its barrier would wait for the host
            torch.distributed.all_reduce(total)
            total = total / self.trainer.world_size
        return total

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        batch, weights = self.unpack(batch)
        idx, targets = self.split(batch)
        total = None if weights is None else self.rank_mean_weight(weights)
        # the model's own losses over the targets (early exit's) weigh them as the LM loss does
        scaled = None if weights is None else weights / total.clamp_min(torch.finfo(total.dtype).tiny)
        out = self.model(idx) if scaled is None else self.model(idx, loss_weights=scaled)
        lm_loss = self.lm_loss(out.logits, targets, weights, total)
        loss = lm_loss + out.aux_loss
        completed = self.global_step + 1
        done = completes_step(self.trainer)  # with gradient accumulation: the step's last micro-batch
        if self.flops_budget is not None:  # before the step's logging decisions: they must know if it is the last
            self.flops_budget.add(self.model, out.trace, targets.shape)
            if done:
                self.flops_budget.close_step(self.trainer, completed, self.optim.warmup_steps)
        self.nonfinite.add(self.global_step, loss, batch)
        if done and self.nonfinite.due(self.trainer, completed):
            self._stop_if_nonfinite(out)
        self._keep_for_callbacks(out, tuple(targets.shape))
        self.tokens_seen += targets.numel() * self.trainer.world_size
        self._sum_step_scalars(lm_loss, out, loss)
        if done:
            self._finish_step(log=is_logging_step(self.trainer, completed))
        return loss

    def _keep_for_callbacks(self, out: ModelOutput, shape: Tuple[int, int]) -> None:
        """This micro-batch's trace and aux parts (the routing and FLOPs callbacks add up every micro-batch
        of the step they measure)."""
        aux = {k: v.detach() if isinstance(v, torch.Tensor) else v for k, v in out.aux_losses.items()}
        aux_loss = out.aux_loss.detach() if isinstance(out.aux_loss, torch.Tensor) else out.aux_loss
        self.last_output = ModelOutput(logits=None, aux_loss=aux_loss, trace=detached_trace(out.trace), aux_losses=aux)
        self.last_batch_shape = shape

    def _sum_step_scalars(self, lm_loss: torch.Tensor, out: ModelOutput, loss: torch.Tensor) -> None:
        """Add this micro-batch's training scalars to the step's sums, on the device (no host sync)."""
        self._step_names = ["train/loss", "train/aux_loss", "train/total_loss",
                            *(f"aux/{name}" for name in out.aux_losses)]
        parts = [lm_loss, out.aux_loss, loss, *out.aux_losses.values()]
        values = torch.stack([torch.as_tensor(v, device=self.device).detach().float().reshape(()) for v in parts])
        total, count = self._step_sums or (torch.zeros_like(values), 0)
        self._step_sums = (total + values, count + 1)

    def _finish_step(self, log: bool) -> None:
        """At the step's last micro-batch: its mean LM loss for the loss curve and, on logging steps, the
        global-batch means of every training scalar (micro-batches and ranks: one all-reduce)."""
        total, count = self._step_sums
        self._step_sums = None
        values = total / count
        self.last_lm_loss = values[0]
        if log:
            self._log_train(values)

    def _log_train(self, values: torch.Tensor) -> None:
        """Global-batch means: one all-reduce of all the training scalars, on logging steps only."""
        if self.trainer.world_size > 1:
            values = self.trainer.strategy.reduce(values, reduce_op="mean")  # equal tokens per rank
        metrics = dict(zip(self._step_names, values))
        metrics["train/ppl"] = torch.exp(metrics["train/loss"])
        for name, value in metrics.items():
            self.log(name, value, prog_bar=name == "train/loss", sync_dist=False)
        self.log("train/tokens_seen", float(self.tokens_seen), reduce_fx="max")
        if self.flops_budget is not None:  # global already (every rank holds the same count)
            self.log("train/flops_spent", self.flops_budget.spent, reduce_fx="max")
            self.log("train/flops_budget_fraction", self.flops_budget.fraction(), reduce_fx="max")

    # ------------------------------------------------------------------ validation
    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        batch, weights = self.unpack(batch)
        idx, targets = self.split(batch)
        # under a loss mask, val/loss is the masked objective: weighted by the targets' loss weights
        count = targets.numel() if weights is None else weights.sum()
        hooks = self._watch_predictors() if self.causal_eval and dataloader_idx == 0 else None
        try:
            out = self.model(idx)
        finally:
            decisions = self._unwatch(hooks)
        self.val_loss[dataloader_idx].update(self.lm_loss(out.logits, targets, weights), weight=count)
        if decisions:
            self._count_predictor(decisions, out.trace)
        if self.causal_eval:
            with self.model.causal_routing():
                causal = self.model(idx)
            self.val_loss_causal[dataloader_idx].update(self.lm_loss(causal.logits, targets, weights), weight=count)
            flops = self.model.flops_per_token(causal.trace, idx.shape[1]).forward
            self.val_flops_causal[dataloader_idx].update(float(flops), weight=targets.numel())

    def _watch_predictors(self):
        """Forward pre-hooks that record each routed block's causal decision on the input top-k sees."""
        decisions: Dict[str, torch.Tensor] = {}
        hooks = []
        for module in self.model.modules():
            if callable(getattr(module, "causal_decision", None)) and callable(getattr(module, "router_logits", None)):
                def hook(mod, args, name=getattr(module, "name", None)):
                    x = args[0]
                    decisions[name] = mod.causal_decision(x, mod.router_logits(x)).detach()
                hooks.append(module.register_forward_pre_hook(hook))
        return hooks, decisions

    @staticmethod
    def _unwatch(watch) -> Dict[str, torch.Tensor]:
        if watch is None:
            return {}
        hooks, decisions = watch
        for hook in hooks:
            hook.remove()
        return decisions

    def _count_predictor(self, decisions: Dict[str, torch.Tensor], trace) -> None:
        """Confusion counts of the causal decision against top-k membership, per routed block (no sync)."""
        for site in trace:
            if site.name not in decisions or site.kind != "expert_choice":
                continue
            topk = site.selected[..., 0] > 0
            causal = decisions[site.name].reshape(topk.shape)
            valid = torch.ones_like(topk) if site.valid is None else site.valid
            counts = torch.stack([(causal & topk & valid).sum(), (causal & ~topk & valid).sum(),
                                  (~causal & topk & valid).sum(), (~causal & ~topk & valid).sum()]).double()
            previous = self.predictor_counts.get(site.name)
            self.predictor_counts[site.name] = counts if previous is None else previous + counts

    def on_validation_epoch_end(self) -> None:
        for i, name in enumerate(self.val_names):
            if self.val_loss[i].update_count == 0 and self.trainer.world_size == 1:
                continue
            # The first validation set is the headline "val/loss"; extra named sets (e.g. SlimPajama's
            # out-of-distribution subsets) log under their own names.
            prefix = "val" if i == 0 else f"val/{name}"
            metrics = {"loss": self.val_loss[i]}
            if self.causal_eval:
                metrics["loss_causal"] = self.val_loss_causal[i]
            for key, metric in metrics.items():
                value = metric.compute()  # token-weighted mean over every rank's batches
                suffix = key.replace("loss", "")
                self.log(f"{prefix}/{key}", value, add_dataloader_idx=False, sync_dist=False)
                self.log(f"{prefix}/ppl{suffix}", torch.exp(value), add_dataloader_idx=False, sync_dist=False)
                metric.reset()
            if self.causal_eval:
                self._log_causal_flops(prefix, self.val_flops_causal[i])
        self._log_predictor_quality()

    @property
    def selection_metric(self) -> str:
        """The validation loss that selects the best checkpoint and is the run's ``final_val_loss``: the causal
        one when the routing sees the future (the training-time top-k reads later tokens; generation cannot)."""
        return "val/loss_causal" if self.causal_eval else "val/loss"

    def _log_causal_flops(self, prefix: str, metric: MeanMetric) -> None:
        from architectures.flops import vanilla_flops

        value = metric.compute()  # token-weighted mean over every rank's batches
        metric.reset()
        vanilla = vanilla_flops(self.model.config, self.model.config.block_size).forward
        self.log(f"{prefix}/flops_causal", value, add_dataloader_idx=False, sync_dist=False)
        self.log(f"{prefix}/flops_causal_ratio_to_vanilla", value / vanilla, add_dataloader_idx=False, sync_dist=False)

    def setup(self, stage: str) -> None:
        # a compiled model's graphs guard on inference mode: trainer.validate()'s default (inference_mode)
        # would compile the evaluation graphs a second time (minutes for MoT on CPU); no_grad, as during fit
        if stage == "validate" and getattr(self.model, "_compiled_call_impl", None) is not None:
            self.trainer.validate_loop.inference_mode = False

    def on_validation_start(self) -> None:
        # trainer.validate() after fit: Lightning writes val/* at its batch counter, one past the last batch's
        # x value; put them at the last batch, as the validations during fit are (one x-axis).
        self._restore_batches = None
        loop = getattr(getattr(self.trainer, "fit_loop", None), "epoch_loop", None)
        if self.trainer.state.fn == "validate" and self.trainer.global_step > 0 and loop is not None:
            self._restore_batches = loop._batches_that_stepped
            loop._batches_that_stepped = log_step(self.trainer)

    def on_validation_end(self) -> None:
        if getattr(self, "_restore_batches", None) is not None:
            self.trainer.fit_loop.epoch_loop._batches_that_stepped = self._restore_batches
            self._restore_batches = None

    def _log_predictor_quality(self) -> None:
        if not self.predictor_counts:
            return
        names = sorted(self.predictor_counts)
        packed = torch.stack([self.predictor_counts[n] for n in names])
        if self.trainer.world_size > 1:
            packed = self.trainer.strategy.reduce(packed, reduce_op="sum")
        self.predictor_counts = {}
        for name, (tp, fp, fn, tn) in zip(names, packed.tolist()):
            for key, value in predictor_quality(tp, fp, fn, tn).items():
                self.log(f"val/predictor/{name}/{key}", value, add_dataloader_idx=False, sync_dist=False)

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen
        checkpoint["rng_states"] = rank_rng_states(self.trainer)
        if self.flops_budget is not None:
            checkpoint["flops_budget"] = self.flops_budget.state_dict()

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        self.tokens_seen = checkpoint.get("tokens_seen", 0)
        self.resumed_rng_states = checkpoint.get("rng_states")  # set when training starts (on_train_start)
        if any(re.search(r"\.experts\.\d+\.c_fc\.weight$", k) for k in checkpoint.get("state_dict", {})):
            # saved before the MoE experts were stacked: the weights stack on load (a pre-hook of the experts
            # module), the AdamW state is re-indexed here, before Lightning restores it
            checkpoint["optimizer_states"] = [stack_legacy_optimizer_state(self.model, state)
                                              for state in checkpoint.get("optimizer_states", [])]
        if self.flops_budget is None:
            return
        require_counted_flops(checkpoint)  # experiments.run refuses it before anything is written; other callers here
        self.flops_budget.load_state_dict(checkpoint["flops_budget"])

    def on_train_start(self) -> None:
        if self.flops_budget is not None and self.flops_budget.exhausted:  # a finished run resumed: nothing to train
            self.trainer.should_stop = True
        # after the sanity validation and model set-up, before the first step: a resumed run draws from here on what
        # the run it continues drew (experiments.run seeds afresh, which replayed the stream from step 0)
        restore_rank_rng_states(self.resumed_rng_states, self.trainer)
        self.resumed_rng_states = None

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        groups = parameter_groups(self.model, self.optim.weight_decay)
        optimizer = make_adamw(groups, lr=self.optim.lr, betas=(self.optim.beta1, self.optim.beta2), eps=self.optim.eps)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: self.lr_multiplier(step))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    def lr_multiplier(self, step: int) -> float:
        """Warmup over ``optim.warmup_steps`` steps, then a cosine to ``optim.min_lr_ratio`` whose progress is
        the steps done of ``max_steps`` or, with a FLOPs budget, the share of the budget spent since the warmup
        (the step count is not known in advance; the cosine ends where the budget does, whatever the router spends)."""
        warmup = self.optim.warmup_steps
        if self.flops_budget is None or (warmup > 0 and step < warmup):
            return warmup_cosine(step, warmup, self.max_steps, self.optim.min_lr_ratio)
        return cosine_decay(self.flops_budget.schedule_progress(step, warmup), self.optim.min_lr_ratio)

    # ------------------------------------------------------------------ NaN / Inf guard
    def _stop_if_nonfinite(self, out: ModelOutput) -> None:
        found = self.nonfinite.first_bad(self.trainer)
        if found is None:
            return
        step, value, batch = found
        if step < 0:
            raise NonFiniteLossError(f"non-finite loss on another rank by step {self.global_step}; see its error")
        site = first_nonfinite_site(out.trace)
        dump = self._dump_nonfinite(step, batch, site)
        where = f"; at step {self.global_step} routing site {site!r} has non-finite router logits" if site else ""
        raise NonFiniteLossError(
            f"non-finite loss ({value}) first at step {step} (checked at step {self.global_step}){where}. Model "
            f"weights (as of step {self.global_step}) and the step-{step} batch were saved to {dump} for inspection; "
            "lower optim.lr or check the data."
        )

    def _dump_nonfinite(self, step: int, batch: torch.Tensor, site: Optional[str]) -> pathlib.Path:
        # the logger's folder: trainer.log_dir is a broadcast under DDP, and only the ranks that saw a bad loss are here
        logger = self.trainer.logger
        folder = pathlib.Path(getattr(logger, "log_dir", None) or self.trainer.default_root_dir or ".")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"nonfinite-step{step}-rank{self.global_rank}.pt"
        torch.save({"step": step, "checked_at": self.global_step, "site": site, "batch": batch.cpu(),
                    "model": self.model.state_dict(), "config": self.model_config.to_dict()}, path)
        return path


def predictor_quality(tp: float, fp: float, fn: float, tn: float) -> Dict[str, float]:
    """Precision / recall / F1 of the causal "process" decisions against top-k membership (the positives).

    Accuracy is reported too but says little: with capacity 12.5% the "skip" majority alone scores 0.875.
    """
    precision = tp / (tp + fp) if tp + fp else 0.0
    recall = tp / (tp + fn) if tp + fn else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    total = tp + fp + fn + tn
    return {"precision": precision, "recall": recall, "f1": f1,
            "accuracy": (tp + tn) / total if total else 0.0}
