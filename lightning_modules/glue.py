"""GLUE fine-tuning on any variant's backbone: last-real-token pooling + a linear head.

The backbone is read only through the model contract: ``model(idx, attention_mask=mask,
return_residuals=True).final_hidden()`` is the stream the LM head reads, ``model.ln_f`` its
LayerNorm; the feature of a sequence is that vector at its last real token (right padding, causal
attention: the last token has seen the whole input). Loss: cross-entropy (STS-B: mean squared error
on the score) plus the backbone's auxiliary routing loss, so routers stay balanced while fine-tuning.

Metrics (torchmetrics, per validation split): CoLA Matthews correlation (+ accuracy), STS-B Pearson
and Spearman, MRPC/QQP accuracy and F1 (positive class 1), the others accuracy. ``glue_score`` is the
GLUE-leaderboard number of a task: the mean of its two metrics where it has two (CoLA: Matthews).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import lightning as L
import torch
import torch.nn as nn
import torch.nn.functional as F
from torchmetrics import MeanMetric, MetricCollection
from torchmetrics.classification import BinaryAccuracy, BinaryF1Score, BinaryMatthewsCorrCoef, MulticlassAccuracy
from torchmetrics.regression import PearsonCorrCoef, SpearmanCorrCoef

from architectures import ModelConfig, build_model
from datamodules.glue import GlueTask, get_task
from lightning_modules.lm import OptimConfig, parameter_groups, warmup_cosine


def glue_metrics(task: GlueTask) -> MetricCollection:
    makers = {
        "matthews": BinaryMatthewsCorrCoef,
        "f1": BinaryF1Score,
        "pearson": PearsonCorrCoef,
        "spearman": SpearmanCorrCoef,
        "accuracy": (lambda: BinaryAccuracy()) if task.num_labels == 2 else
                    (lambda: MulticlassAccuracy(num_classes=task.num_labels, average="micro")),
    }
    return MetricCollection({name: makers[name]() for name in task.metrics})


def glue_score(task: GlueTask, metrics: Dict[str, float]) -> float:
    """The task's single GLUE number (x100 is the usual presentation)."""
    if task.name == "cola":
        return metrics["matthews"]
    return sum(metrics[m] for m in task.metrics) / len(task.metrics)


def split_prefix(split: str) -> str:
    return split.replace("validation", "val")


def last_token_features(model: nn.Module, idx: torch.Tensor, attention_mask: torch.Tensor):
    """(B, d) final-LayerNorm features at each row's last real token, and the ModelOutput."""
    out = model(idx, attention_mask=attention_mask, return_residuals=True)
    hidden = model.ln_f(out.final_hidden())
    last = attention_mask.long().sum(dim=1) - 1
    return hidden[torch.arange(idx.shape[0], device=idx.device), last], out


class GlueModule(L.LightningModule):
    def __init__(self, model: Dict[str, Any], task: str, optim: Optional[Dict[str, Any]] = None,
                 max_steps: int = 1000, head_dropout: float = 0.1):
        super().__init__()
        self.save_hyperparameters()
        self.task = get_task(task)
        self.model = build_model(ModelConfig.from_dict(model))
        self.model_config = self.model.config
        self.head_dropout = nn.Dropout(head_dropout)
        self.head = nn.Linear(self.model_config.d_model, self.task.num_labels)
        nn.init.normal_(self.head.weight, std=self.model_config.init_std)
        nn.init.zeros_(self.head.bias)
        self.optim = OptimConfig(**(optim or {}))
        self.optim.validate()
        self.max_steps = max_steps
        self.val_names: List[str] = list(self.task.val_splits)
        self.val_metrics = nn.ModuleList([glue_metrics(self.task) for _ in self.val_names])
        self.val_loss = nn.ModuleList([MeanMetric() for _ in self.val_names])

    # ------------------------------------------------------------------ core
    def forward(self, idx: torch.Tensor, attention_mask: torch.Tensor):
        """Class logits (B, C), or STS-B scores (B,), and the backbone's auxiliary loss."""
        features, out = last_token_features(self.model, idx, attention_mask)
        logits = self.head(self.head_dropout(features)).float()
        return (logits.squeeze(-1) if self.task.regression else logits), out.aux_loss

    def task_loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        if self.task.regression:
            return F.mse_loss(logits, labels.float())
        return F.cross_entropy(logits, labels)

    def predictions(self, logits: torch.Tensor) -> torch.Tensor:
        return logits if self.task.regression else logits.argmax(dim=-1)

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        logits, aux = self(batch["idx"], batch["attention_mask"])
        loss = self.task_loss(logits, batch["labels"])
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/aux_loss", aux)
        return loss + aux

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        logits, _ = self(batch["idx"], batch["attention_mask"])
        labels = batch["labels"]
        self.val_loss[dataloader_idx].update(self.task_loss(logits, labels), weight=labels.shape[0])
        self.val_metrics[dataloader_idx].update(self.predictions(logits), labels)

    def on_validation_epoch_end(self) -> None:
        for i, split in enumerate(self.val_names):
            if self.val_loss[i].update_count == 0 and self.trainer.world_size == 1:
                continue
            prefix = split_prefix(split)
            values = {name: float(v) for name, v in self.val_metrics[i].compute().items()}
            for name, value in values.items():
                self.log(f"{prefix}/{name}", value, add_dataloader_idx=False)
            self.log(f"{prefix}/loss", self.val_loss[i].compute(), add_dataloader_idx=False)
            self.log(f"{prefix}/score", glue_score(self.task, values), add_dataloader_idx=False)
            self.val_metrics[i].reset()
            self.val_loss[i].reset()

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        groups = parameter_groups(self, self.optim.weight_decay)
        optimizer = torch.optim.AdamW(groups, lr=self.optim.lr, betas=(self.optim.beta1, self.optim.beta2),
                                      eps=self.optim.eps)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, self.optim.warmup_steps, self.max_steps, self.optim.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
