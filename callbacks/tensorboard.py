"""TensorBoard plumbing shared by the measurement callbacks, and the layout / hparams callback.

* ``log_scalars`` / ``log_figure`` / ``log_histogram`` write through every logger (scalars) or the
  TensorBoard logger's ``SummaryWriter`` (images, histograms); callers invoke them on rank 0 only.
* ``TensorBoardExtras`` writes a custom-scalars layout (one category per routing site, plus FLOPs,
  throughput and contribution) once the sites are known, and at the end of fit the run's hparams
  with its final metrics (tags ``hparams/<metric>``) for the HParams dashboard.
"""
from __future__ import annotations

import math
import re
from typing import Any, Dict, Iterable, List, Optional

import lightning as L
import torch


def tb_writer(trainer) -> Optional[Any]:
    """The ``SummaryWriter`` of the trainer's TensorBoard logger, if it has one."""
    from lightning.pytorch.loggers import TensorBoardLogger

    for logger in getattr(trainer, "loggers", []) or []:
        if isinstance(logger, TensorBoardLogger):
            return logger.experiment
    return None


def log_scalars(trainer, metrics: Dict[str, float], step: int) -> None:
    clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
    if not clean:
        return
    for logger in getattr(trainer, "loggers", []) or []:
        logger.log_metrics(clean, step=step)


def log_figure(trainer, tag: str, figure, step: int) -> None:
    """Write a matplotlib figure as an image (and close it)."""
    import matplotlib.pyplot as plt

    writer = tb_writer(trainer)
    try:
        if writer is not None:
            writer.add_figure(tag, figure, global_step=step, close=False)
    finally:
        plt.close(figure)


def log_histogram(trainer, tag: str, values: torch.Tensor, step: int) -> None:
    writer = tb_writer(trainer)
    if writer is not None and values.numel() > 0:
        writer.add_histogram(tag, values.detach().float().cpu(), global_step=step)


def figure(nrows: int = 1, ncols: int = 1, width: float = 4.0, height: float = 3.5):
    """A matplotlib figure on the Agg backend (no display needed, safe in worker processes)."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    return plt.subplots(nrows, ncols, figsize=(width * ncols, height * nrows), squeeze=False)


def tag_part(name: str) -> str:
    """A site / option name made safe for a TensorBoard tag component."""
    return re.sub(r"[^A-Za-z0-9_.\-]", "_", name)


# ---------------------------------------------------------------------------- layout and hparams
def custom_scalars_layout(site_names: Iterable[str]) -> Dict[str, Dict[str, List[Any]]]:
    """Custom-scalars layout: one category per routing site, then FLOPs, throughput, contribution."""
    layout: Dict[str, Dict[str, List[Any]]] = {
        "loss": {"train / val loss": ["Multiline", [r"train/loss$", r"val/loss$", r"val/loss_causal$"]]},
    }
    for name in sorted(site_names):
        site = re.escape(f"routing/{tag_part(name)}/")
        layout[f"routing/{name}"] = {
            "token fraction per option": ["Multiline", [site + r"frac/.*"]],
            "router entropy": ["Multiline", [site + r"entropy$"]],
            "load imbalance (CV)": ["Multiline", [site + r"load_cv$"]],
            "processed / dropped fraction": ["Multiline", [site + r"(processed|dropped)_fraction$"]],
        }
    layout["flops"] = {
        "forward FLOPs per token by component": ["Multiline", [r"flops/forward/.*"]],
        "FLOPs per token (forward, training)": ["Multiline", [r"flops/(forward|training)$"]],
        "ratio to vanilla": ["Multiline", [r"flops/ratio_to_vanilla$"]],
        "throughput (FLOP/s, MFU)": ["Multiline", [r"train/(device/)?(flops_per_sec|mfu)$"]],
    }
    layout["contribution"] = {
        "MHA vs FFN ratio": ["Multiline", [r"contribution/ratio_(mha|ffn)$"]],
        "logit-lens accuracy per sub-layer state": ["Multiline", [r"contribution/acc/.*"]],
        "direct logit attribution per update": ["Multiline", [r"contribution/dla/.*"]],
    }
    return layout


def _flatten(prefix: str, value: Any, out: Dict[str, Any]) -> None:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}/{key}" if prefix else str(key), inner, out)
    elif isinstance(value, (bool, int, float, str)):
        out[prefix] = value
    elif value is None:
        out[prefix] = "None"
    else:
        out[prefix] = str(value)


def hparams_of(pl_module) -> Dict[str, Any]:
    flat: Dict[str, Any] = {}
    _flatten("", dict(getattr(pl_module, "hparams", {}) or {}), flat)
    return flat


class TensorBoardExtras(L.Callback):
    """Custom-scalars layout (after the first step, when the routing sites are known) and final hparams.

    ``after_final_validation=True`` (what ``experiments.run`` uses: it validates once more after fit)
    writes the hparams when that ``trainer.validate()`` ends, so ``hparams/val/*`` are the final
    numbers; otherwise they are written at the end of fit. They include the trainer's current
    ``max_steps`` and the step reached (after a resume: this run's, not the first run's).
    """

    def __init__(self, after_final_validation: bool = False) -> None:
        self.after_final_validation = after_final_validation
        self._layout_written = False
        self._train_final: Dict[str, float] = {}

    def on_train_end(self, trainer, pl_module) -> None:
        # trainer.validate() after fit starts with empty callback metrics: keep the training figures now
        self._train_final = {k: float(v) for k, v in trainer.callback_metrics.items()
                             if k in TRAIN_FINAL and isinstance(v, (torch.Tensor, int, float))}
        tokens = getattr(pl_module, "tokens_seen", None)
        if tokens is not None:
            self._train_final["train/tokens_seen"] = float(tokens)  # global, also when the last step logged none

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._layout_written or not trainer.is_global_zero:
            return
        self._layout_written = True
        writer = tb_writer(trainer)
        out = getattr(pl_module, "last_output", None)
        if writer is not None:
            writer.add_custom_scalars(custom_scalars_layout(site.name for site in (out.trace if out else [])))

    def on_fit_end(self, trainer, pl_module) -> None:
        if not self.after_final_validation:
            self.write_hparams(trainer, pl_module)

    def on_validation_end(self, trainer, pl_module) -> None:
        if self.after_final_validation and trainer.state.fn == "validate":
            self.write_hparams(trainer, pl_module)

    def write_hparams(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        writer = tb_writer(trainer)
        if writer is None:
            return
        metrics = {**self._train_final, **final_metrics(trainer)}
        if not metrics:
            return
        from torch.utils.tensorboard.summary import hparams

        tagged = {f"hparams/{k}": v for k, v in metrics.items()}
        params = {**hparams_of(pl_module), "trainer/max_steps": int(trainer.max_steps),
                  "trainer/global_step": int(trainer.global_step)}
        exp, ssi, sei = hparams(params, tagged)
        file_writer = writer._get_file_writer()
        step = max(0, trainer.global_step - 1)  # the last batch's x value, like every other scalar
        for summary in (exp, ssi, sei):
            file_writer.add_summary(summary, step)
        for tag, value in tagged.items():
            writer.add_scalar(tag, value, step)
        writer.flush()


TRAIN_FINAL = ("train/loss", "train/tokens_seen")
FINAL_PREFIXES = ("val/", *TRAIN_FINAL)


def final_metrics(trainer) -> Dict[str, float]:
    """Scalar callback metrics plus each measurement callback's latest headline figures."""
    out: Dict[str, float] = {}
    for key, value in trainer.callback_metrics.items():
        if not key.startswith(FINAL_PREFIXES):
            continue
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            out[key] = float(value)
        elif isinstance(value, (int, float)):
            out[key] = float(value)
    for callback in trainer.callbacks:
        getter = getattr(callback, "final_metrics", None)
        if callable(getter):
            out.update(getter())
    return {k: v for k, v in out.items() if math.isfinite(v)}
