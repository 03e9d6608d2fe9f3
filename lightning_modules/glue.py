"""GLUE fine-tuning on any variant's backbone: last-real-token pooling + a linear head.

The backbone is read only through the model contract: ``model(idx, attention_mask=mask,
compute_logits=False).hidden`` is the stream the LM head reads (the LM head is not computed), ``model.ln_f`` its
LayerNorm; the feature of a sequence is that vector at its last real token (right padding, causal
attention: the last token has seen the whole input). Loss: cross-entropy (STS-B: mean squared error
on the score) plus the backbone's auxiliary routing loss, so routers stay balanced while fine-tuning.

Metrics (torchmetrics, per validation split): CoLA Matthews correlation (+ accuracy), STS-B Pearson
and Spearman, MRPC/QQP accuracy and F1 (positive class 1), the others accuracy. Correlations that are
undefined (constant predictions or labels) are 0, as sklearn / the GLUE scorer report them. ``glue_score`` is the
GLUE-leaderboard number of a task: the mean of its two metrics where it has two (CoLA: Matthews).
"""
from __future__ import annotations

import json
import pathlib
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


class MatthewsCorrCoef(BinaryMatthewsCorrCoef):
    """Matthews correlation that is 0 when it is undefined (a row or column of the confusion matrix is empty).

    That is what sklearn, scipy and the GLUE scorer report for constant predictions (or constant labels);
    torchmetrics' own fallback returns values such as +-1 or 0.80 there.
    """

    def compute(self) -> torch.Tensor:
        (tn, fp), (fn, tp) = self.confmat.double().tolist()
        denominator = (tp + fp) * (tp + fn) * (tn + fp) * (tn + fn)
        if denominator == 0:
            return torch.tensor(0.0)
        return torch.tensor((tp * tn - fp * fn) / denominator ** 0.5)


class PearsonOrZero(PearsonCorrCoef):
    """Pearson correlation, 0 when undefined (constant predictions or labels) instead of NaN."""

    def compute(self) -> torch.Tensor:
        value = super().compute()
        return torch.nan_to_num(value, nan=0.0)


def glue_metrics(task: GlueTask) -> MetricCollection:
    makers = {
        "matthews": MatthewsCorrCoef,
        "f1": BinaryF1Score,
        "pearson": PearsonOrZero,
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


def backbone_hidden(model: nn.Module, idx: torch.Tensor, attention_mask: torch.Tensor):
    """(B, T, d) stream the LM head reads (before ``ln_f``) and the ModelOutput, without computing the LM head.

    The (T x vocab) logits a classifier discards cost most of a small model's forward (9.6x at tiny).
    """
    out = model(idx, attention_mask=attention_mask, compute_logits=False)
    return out.hidden, out


def last_token_features(model: nn.Module, idx: torch.Tensor, attention_mask: torch.Tensor):
    """(B, d) final-LayerNorm features at each row's last real token, and the ModelOutput."""
    hidden, out = backbone_hidden(model, idx, attention_mask)
    last = attention_mask.long().sum(dim=1) - 1
    rows = torch.arange(idx.shape[0], device=idx.device)
    return model.ln_f(hidden[rows, last]), out


#: how ``predictions.jsonl`` shows the end-of-text token after each text of an example
SEPARATOR = " <|endoftext|> "


def decode_input(ids: List[int], decode, eot_id: Optional[int]) -> str:
    """An example's model input (``a EOT`` or ``a EOT b EOT``) as text, each EOT shown as ``SEPARATOR`` between
    the texts (the trailing one dropped): decoded whole, a pair's two texts run together."""
    if eot_id is None:
        return decode(ids)
    parts, current = [], []
    for token in ids:
        if token == eot_id:
            parts.append(decode(current))
            current = []
        else:
            current.append(token)
    if current:
        parts.append(decode(current))
    return SEPARATOR.join(parts)


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
        # per split: (example index, label, prediction) of the latest validation, all ranks on rank 0
        self.predictions_by_split: Dict[str, List[Dict[str, Any]]] = {}

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
        predictions = self.predictions(logits)
        self.val_metrics[dataloader_idx].update(predictions, labels)
        self._keep_predictions(dataloader_idx, batch_idx, labels.shape[0], labels, predictions)

    def _keep_predictions(self, split_idx: int, batch_idx: int, size: int, labels, predictions) -> None:
        """Example index in the split: sequential loader per rank; under DDP Lightning's sampler deals
        index i to rank i % world_size (padding repeats the first ones, dropped when gathered)."""
        batch_size = self.trainer.val_dataloaders[split_idx].batch_size if isinstance(
            self.trainer.val_dataloaders, (list, tuple)) else self.trainer.val_dataloaders.batch_size
        world, rank = self.trainer.world_size, self.global_rank
        rows = self.predictions_by_split.setdefault(self.val_names[split_idx], [])
        for j, (label, prediction) in enumerate(zip(labels.tolist(), predictions.tolist())):
            local = batch_idx * batch_size + j
            rows.append({"id": local * world + rank, "label": label, "prediction": prediction})

    def on_validation_epoch_start(self) -> None:
        self.predictions_by_split = {}

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
        self._gather_predictions()

    def _gather_predictions(self) -> None:
        if self.trainer.world_size <= 1:
            return
        import torch.distributed as dist

        gathered: List[Any] = [None] * self.trainer.world_size
        dist.all_gather_object(gathered, self.predictions_by_split)
        merged: Dict[str, Dict[int, Dict[str, Any]]] = {}
        for part in gathered:
            for split, rows in part.items():
                for row in rows:
                    merged.setdefault(split, {}).setdefault(row["id"], row)
        self.predictions_by_split = {split: [rows[i] for i in sorted(rows)] for split, rows in merged.items()}

    def write_predictions(self, folder: pathlib.Path, datasets: Dict[str, Any], decode,
                          eot_id: Optional[int] = None) -> List[pathlib.Path]:
        """``predictions.jsonl`` per validation split: id, inputs (the decoded model input; with ``eot_id`` its
        end-of-text separators shown as ``SEPARATOR``, which decoding alone drops), label, prediction."""
        paths = []
        names = self.task.labels
        for split, rows in self.predictions_by_split.items():
            dataset = datasets[split]
            path = folder / (f"predictions-{split}.jsonl" if len(self.val_names) > 1 else "predictions.jsonl")
            with path.open("w", encoding="utf-8") as handle:
                for row in rows:
                    if row["id"] >= len(dataset):
                        continue  # the distributed sampler's padding
                    out = {"id": row["id"], "inputs": decode_input(dataset.ids[row["id"]].tolist(), decode, eot_id),
                           "label": names[int(row["label"])] if names else row["label"],
                           "prediction": names[int(row["prediction"])] if names else row["prediction"]}
                    handle.write(json.dumps(out, ensure_ascii=False) + "\n")
            paths.append(path)
        return paths

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        groups = parameter_groups(self, self.optim.weight_decay)
        optimizer = torch.optim.AdamW(groups, lr=self.optim.lr, betas=(self.optim.beta1, self.optim.beta2),
                                      eps=self.optim.eps)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, self.optim.warmup_steps, self.max_steps, self.optim.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
