"""Language-model pre-training LightningModule for every registered architecture.

Reads only the model contract (``ModelOutput``): LM loss + the model's auxiliary loss, logged with
its named parts; the latest routing trace is kept on ``self.last_output`` for callbacks.
"""
from __future__ import annotations

import math
import pathlib
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.text import Perplexity

from architectures import ModelConfig, build_model
from architectures.config import ConfigError
from architectures.contract import ModelOutput, first_nonfinite_site


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
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optim.{name}: must be in [0, 1), got {getattr(self, name)}")


def warmup_cosine(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """LR multiplier: linear warmup to 1, cosine decay to ``min_ratio`` at ``total`` steps."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """Decay matrices (linear / embedding weights); never biases, LayerNorm or scalar gates."""
    decay, no_decay, seen = [], [], set()
    for param in model.parameters():
        if not param.requires_grad or id(param) in seen:
            continue
        seen.add(id(param))
        (decay if param.dim() >= 2 else no_decay).append(param)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_adamw(params, **kwargs) -> torch.optim.AdamW:
    """AdamW with the fused kernel (CPU and CUDA): one pass over all parameters instead of many small ops."""
    try:
        return torch.optim.AdamW(params, fused=True, **kwargs)
    except (RuntimeError, TypeError):  # a device/dtype without a fused kernel
        return torch.optim.AdamW(params, **kwargs)


class NonFiniteLossError(FloatingPointError):
    pass


class LanguageModelModule(L.LightningModule):
    def __init__(self, model: Dict[str, Any], optim: Optional[Dict[str, Any]] = None, max_steps: int = 1000,
                 val_names: Optional[List[str]] = None):
        super().__init__()
        self.save_hyperparameters()
        self.model_config = ModelConfig.from_dict(model)
        self.model = build_model(self.model_config)
        self.model_config = self.model.config
        self.optim = OptimConfig(**(optim or {}))
        self.optim.validate()
        self.max_steps = self.optim.schedule_steps or max_steps
        self.val_names = val_names or ["val"]
        self.val_loss = torch.nn.ModuleList([MeanMetric() for _ in self.val_names])
        self.val_ppl = torch.nn.ModuleList([Perplexity() for _ in self.val_names])
        self.tokens_seen = 0  # global (all ranks): every rank sees the same batch shape
        self.last_output: Optional[ModelOutput] = None
        self.last_lm_loss: Optional[torch.Tensor] = None

    # ------------------------------------------------------------------ core
    def forward(self, idx: torch.Tensor, **kwargs) -> ModelOutput:
        return self.model(idx, **kwargs)

    @staticmethod
    def split(batch: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        return batch[:, :-1], batch[:, 1:]

    def lm_loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        idx, targets = self.split(batch)
        out = self.model(idx)
        lm_loss = self.lm_loss(out.logits, targets)
        loss = lm_loss + out.aux_loss
        self._stop_if_nonfinite(loss, out, batch)
        self.last_output = out
        self.last_lm_loss = lm_loss.detach()
        self.tokens_seen += targets.numel() * self.trainer.world_size
        self.log("train/loss", lm_loss, prog_bar=True)
        self.log("train/ppl", torch.exp(lm_loss.detach()))
        self.log("train/aux_loss", out.aux_loss)
        self.log("train/total_loss", loss)
        for name, value in out.aux_losses.items():
            self.log(f"aux/{name}", value)
        self.log("train/tokens_seen", float(self.tokens_seen), reduce_fx="max")
        return loss

    def validation_step(self, batch: torch.Tensor, batch_idx: int, dataloader_idx: int = 0) -> None:
        idx, targets = self.split(batch)
        out = self.model(idx)
        loss = self.lm_loss(out.logits, targets)
        self.val_loss[dataloader_idx].update(loss, weight=targets.numel())
        self.val_ppl[dataloader_idx].update(out.logits.float(), targets)

    def on_validation_epoch_end(self) -> None:
        for i, name in enumerate(self.val_names):
            if self.val_loss[i].update_count == 0 and self.trainer.world_size == 1:
                continue
            # The first validation set is the headline "val/loss"; extra named sets (e.g. SlimPajama's
            # out-of-distribution subsets) log under their own names.
            prefix = "val" if i == 0 else f"val/{name}"
            self.log(f"{prefix}/loss", self.val_loss[i].compute(), add_dataloader_idx=False, sync_dist=False)
            self.log(f"{prefix}/ppl", self.val_ppl[i].compute(), add_dataloader_idx=False, sync_dist=False)
            self.val_loss[i].reset()
            self.val_ppl[i].reset()

    def on_save_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        checkpoint["tokens_seen"] = self.tokens_seen

    def on_load_checkpoint(self, checkpoint: Dict[str, Any]) -> None:
        self.tokens_seen = checkpoint.get("tokens_seen", 0)

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        groups = parameter_groups(self.model, self.optim.weight_decay)
        optimizer = make_adamw(groups, lr=self.optim.lr, betas=(self.optim.beta1, self.optim.beta2), eps=self.optim.eps)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer,
            lambda step: warmup_cosine(step, self.optim.warmup_steps, self.max_steps, self.optim.min_lr_ratio),
        )
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    # ------------------------------------------------------------------ NaN / Inf guard
    def _stop_if_nonfinite(self, loss: torch.Tensor, out: ModelOutput, batch: torch.Tensor) -> None:
        finite = torch.isfinite(loss.detach()).float()
        if self.trainer.world_size > 1:
            # every rank must stop together, or the healthy ones hang in the next all-reduce
            finite = self.trainer.strategy.reduce(finite, reduce_op="min")
        if bool(finite > 0):
            return
        step = self.global_step
        site = first_nonfinite_site(out.trace)
        dump = self._dump_nonfinite(step, batch, site)
        where = f" at routing site {site!r} (its router logits are non-finite)" if site else ""
        raise NonFiniteLossError(
            f"non-finite loss ({loss.item()}) at step {step}{where}. Model weights and the batch were saved "
            f"to {dump} for inspection; lower optim.lr or check the data."
        )

    def _dump_nonfinite(self, step: int, batch: torch.Tensor, site: Optional[str]) -> pathlib.Path:
        folder = pathlib.Path(self.trainer.log_dir or ".")
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"nonfinite-step{step}-rank{self.global_rank}.pt"
        torch.save({"step": step, "site": site, "batch": batch.cpu(), "model": self.model.state_dict(),
                    "config": asdict(self.model_config)}, path)
        return path
