"""MHA-vs-FFN contribution on a fixed probe batch (logit lens and direct logit attribution).

``model(idx, return_residuals=True).residuals`` lists the residual stream at every sub-layer
boundary: the embeddings, then one state after each MHA and each FFN update as they happened.

* Logit lens: next-token top-1 accuracy of ``model.head(h)`` (final LayerNorm + unembedding) at each
  state. The gain of an update is acc(after) - acc(before), "before" being the previous state;
  ratio_MHA = sum of the gains of the MHA updates / total gain (acc(last) - acc(embed)), likewise
  FFN, so the two ratios sum to 1 (either may be negative or exceed 1 when some updates hurt).
  With no total gain the ratios are undefined and not logged. Their standard errors
  (``contribution/ratio_{mha,ffn}_se``) come from a bootstrap over the probe's sequences
  (1000 resamples); the default probe is 32 sequences (4 gave ratio_mha anywhere from 0.40 to 2.0).
* Direct logit attribution: the update u = h_after - h_before pushed through the final LayerNorm
  linearised at the last state (centred, divided by the last state's scale, times its gain) and
  dotted with the unembedding of the correct next token, averaged over tokens. The embeddings' term,
  the updates' terms and the LayerNorm bias term add up exactly to the correct token's final logit.

Tags: ``contribution/ratio_mha``, ``contribution/ratio_ffn``, ``contribution/acc/<i>.<tag><layer>``,
``contribution/dla/<i>.<tag><layer>`` (i = position in the residual list), an image
``contribution/by_state``. Runs on rank 0 only, without gradients, in eval mode.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import lightning as L
import torch

from architectures.config import ConfigError
from architectures.contract import SubLayerState
from callbacks.common import batch_tokens, eager_measurement, require_positive
from callbacks.tensorboard import figure, log_figure, log_scalars
from lightning_modules.steps import log_step

# Tokens per logit-lens chunk: bounds the (tokens x vocab) logits held at once to ~256 MB in fp32.
_LENS_ELEMENTS = 1 << 26


def state_labels(states: Sequence[SubLayerState]) -> List[str]:
    return [f"{i:02d}.{s.tag}" + ("" if s.tag == "embed" else str(s.layer)) for i, s in enumerate(states)]


def ratios_from_values(tags: Sequence[str], values: Sequence[float]) -> Dict[str, Optional[float]]:
    """{"mha": r, "ffn": r} from a per-state measure (accuracy, MI, ...): gains of each update over its predecessor."""
    gains = {"mha": 0.0, "ffn": 0.0}
    for i in range(1, len(values)):
        if tags[i] in gains:
            gains[tags[i]] += values[i] - values[i - 1]
    total = gains["mha"] + gains["ffn"]  # = values[-1] - values[0]: every update is an MHA or an FFN one
    if abs(total) < 1e-12:
        return {"mha": None, "ffn": None}
    return {k: v / total for k, v in gains.items()}


@torch.no_grad()
def lens_correct(model, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """(B,): correct top-1 next-token predictions of the logit lens per sequence at one residual state (B, T, d)."""
    B = hidden.shape[0]
    h = hidden.reshape(-1, hidden.shape[-1])
    y = targets.reshape(-1)
    chunk = max(1, _LENS_ELEMENTS // model.lm_head.weight.shape[0])
    hits = []
    for start in range(0, h.shape[0], chunk):
        logits = model.head(h[start : start + chunk])
        hits.append(logits.argmax(-1) == y[start : start + chunk])
    return torch.cat(hits).view(B, -1).sum(1).double().cpu()


BOOTSTRAP_SAMPLES = 1000


def bootstrap_ratio_se(tags: Sequence[str], correct: torch.Tensor, samples: int = BOOTSTRAP_SAMPLES,
                       seed: int = 0) -> Dict[str, Optional[float]]:
    """Standard error of ratio_MHA / ratio_FFN by bootstrap over the columns of ``correct``.

    ``correct``: (states, B) a measure per state and column: correct predictions per sequence (logit lens), or
    one k-means seed's mutual information per column (``analysis.contribution.mi_method``). Each bootstrap sample
    redraws B columns with replacement and recomputes the ratios from their sums (the ratios are scale-free, so sums
    rank as means); the SE is the std of the defined ratios (None with fewer than 2 columns or when the total gain
    is mostly zero). With few columns (five k-means seeds) it understates the spread (about sqrt((B - 1) / B)).
    """
    B = correct.shape[1]
    if B < 2:
        return {"mha": None, "ffn": None}
    generator = torch.Generator().manual_seed(seed)
    draws = torch.randint(0, B, (samples, B), generator=generator)
    pooled = correct[:, draws].sum(-1).T  # (samples, states): tokens per sequence are equal, so sums rank as means
    values: Dict[str, List[float]] = {"mha": [], "ffn": []}
    for row in pooled.tolist():
        ratios = ratios_from_values(tags, row)
        if ratios["mha"] is not None:
            values["mha"].append(ratios["mha"])
            values["ffn"].append(ratios["ffn"])
    if len(values["mha"]) < samples // 2:
        return {"mha": None, "ffn": None}
    return {k: float(torch.tensor(v, dtype=torch.float64).std()) for k, v in values.items()}


@torch.no_grad()
def direct_logit_attribution(model, states: Sequence[SubLayerState], targets: torch.Tensor) -> torch.Tensor:
    """(S + 1,): mean DLA to the correct token of the embeddings, each update, and the ln_f bias term (last)."""
    ln = model.ln_f
    final = states[-1].hidden.float()
    scale = (final.var(-1, unbiased=False, keepdim=True) + ln.eps).sqrt()
    gamma = ln.weight.float() if ln.weight is not None else torch.ones_like(final[0, 0])
    direction = model.lm_head.weight.float()[targets] * gamma  # (B, T, d)
    out, previous = [], None
    for state in states:
        h = state.hidden.float()
        update = h if previous is None else h - previous
        centred = update - update.mean(-1, keepdim=True)
        out.append(((centred / scale) * direction).sum(-1).mean())
        previous = h
    bias = ln.bias.float() if ln.bias is not None else torch.zeros_like(gamma)
    bias_term = (model.lm_head.weight.float()[targets] * bias).sum(-1)
    if getattr(model.lm_head, "bias", None) is not None:
        bias_term = bias_term + model.lm_head.bias.float()[targets]
    out.append(bias_term.mean())
    return torch.stack(out).cpu()


@dataclass
class Contribution:
    labels: List[str]
    tags: List[str]
    accuracy: List[float]
    dla: List[float]  # per state (embeddings, then each update)
    dla_bias: float
    ratio_mha: Optional[float]
    ratio_ffn: Optional[float]
    ratio_mha_se: Optional[float] = None  # bootstrap over the probe's sequences
    ratio_ffn_se: Optional[float] = None
    sequences: int = 0
    correct: Optional[torch.Tensor] = None  # (states, sequences) logit-lens hits, for pooled bootstraps

    def scalars(self) -> Dict[str, float]:
        out: Dict[str, float] = {"contribution/acc_embed": self.accuracy[0], "contribution/acc_final": self.accuracy[-1]}
        if self.ratio_mha is not None:
            out["contribution/ratio_mha"] = self.ratio_mha
            out["contribution/ratio_ffn"] = self.ratio_ffn
            if self.ratio_mha_se is not None:
                out["contribution/ratio_mha_se"] = self.ratio_mha_se
                out["contribution/ratio_ffn_se"] = self.ratio_ffn_se
        for label, acc, dla in zip(self.labels, self.accuracy, self.dla):
            out[f"contribution/acc/{label}"] = acc
            out[f"contribution/dla/{label}"] = dla
        return out


def check_probe(model, probe: torch.Tensor, seq_len: Optional[int]) -> int:
    """Probe sequences' length (tokens fed to the model); errors name the field."""
    if probe.dim() != 2:
        raise ConfigError(f"callbacks.contribution: the probe batch must be (B, T+1) token ids, got shape {tuple(probe.shape)}")
    available = probe.shape[1] - 1
    length = available if seq_len is None else seq_len
    context = model.config.block_size
    if length > context:
        raise ConfigError(
            f"callbacks.contribution_seq_len: probe batch of {length} tokens per sequence exceeds the model "
            f"context (model.block_size={context})"
        )
    if length > available or length <= 0:
        raise ConfigError(
            f"callbacks.contribution_seq_len: {length} tokens asked, the probe data has {available} per sequence"
        )
    return length


@torch.no_grad()
def measure_contribution(model, probe: torch.Tensor, seq_len: Optional[int] = None) -> Contribution:
    """Logit-lens accuracies, ratios and DLA of ``model`` on a (B, T+1) batch of token ids."""
    length = check_probe(model, probe, seq_len)
    device = next(model.parameters()).device
    idx = probe[:, :length].to(device)
    targets = probe[:, 1 : length + 1].to(device)
    was_training = model.training
    model.eval()
    try:
        cuda = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=cuda), eager_measurement():
            states = model(idx, return_residuals=True).residuals
        if not states:
            raise RuntimeError(f"{type(model).__name__} returned no residual states (contract: return_residuals=True)")
        correct = torch.stack([lens_correct(model, s.hidden, targets) for s in states])  # (states, B)
        dla = direct_logit_attribution(model, states, targets).tolist()
    finally:
        model.train(was_training)
    accuracy = (correct.sum(1) / max(1, targets.numel())).tolist()
    tags = [s.tag for s in states]
    ratios = ratios_from_values(tags, accuracy)
    se = bootstrap_ratio_se(tags, correct) if ratios["mha"] is not None else {"mha": None, "ffn": None}
    return Contribution(state_labels(states), tags, accuracy, dla[:-1], dla[-1], ratios["mha"], ratios["ffn"],
                        se["mha"], se["ffn"], int(idx.shape[0]), correct)


#: the smallest font on the figure (points): tick labels at 5 pt were unreadable in TensorBoard
TICK_FONT = 7


def contribution_figure(result: Contribution):
    fig, axes = figure(1, 2, width=max(4.0, 0.3 * len(result.labels) + 2), height=4.0)
    colours = ["tab:gray" if t == "embed" else "tab:blue" if t == "mha" else "tab:orange" for t in result.tags]
    x = range(len(result.labels))
    axes[0, 0].plot(list(x), result.accuracy, color="black", linewidth=0.8)
    axes[0, 0].scatter(list(x), result.accuracy, c=colours, s=14)
    axes[0, 0].set_title("logit-lens top-1 accuracy (blue: after MHA, orange: after FFN)", fontsize=8)
    axes[0, 0].set_ylabel("top-1 accuracy (fraction of tokens)", fontsize=8)
    axes[0, 1].bar(list(x), result.dla, color=colours)
    axes[0, 1].set_title("direct logit attribution to the correct token", fontsize=8)
    axes[0, 1].set_ylabel("mean contribution to its logit (logits)", fontsize=8)
    for ax in axes.flat:
        ax.set_xticks(list(x), result.labels, rotation=90, fontsize=TICK_FONT)
        ax.tick_params(axis="y", labelsize=TICK_FONT)
        ax.set_xlabel("residual stream after", fontsize=8)
    fig.tight_layout()
    return fig


def first_rows(loader, rows: int) -> Optional[torch.Tensor]:
    """The first ``rows`` sequences of a loader of (B, T+1) token tensors, or None if it yields something else."""
    taken: List[torch.Tensor] = []
    count = 0
    for batch in loader:
        batch = batch_tokens(batch)
        if not isinstance(batch, torch.Tensor) or batch.dim() != 2:
            return None
        taken.append(batch)
        count += batch.shape[0]
        if count >= rows:
            break
    return torch.cat(taken)[:rows].clone() if taken else None


def validation_rows(trainer, rows: int) -> Optional[torch.Tensor]:
    """The first ``rows`` sequences of the datamodule's first validation loader (fixed across resumes), or None."""
    datamodule = getattr(trainer, "datamodule", None)
    if datamodule is None:
        return None
    try:
        loaders = datamodule.val_dataloader()
    except (NotImplementedError, AttributeError, TypeError):
        return None
    loader = loaders[0] if isinstance(loaders, (list, tuple)) else loaders
    if loader is None:
        return None
    with torch.random.fork_rng(devices=[]):  # iterating a loader draws a seed from the global RNG
        return first_rows(loader, rows)


class ContributionCallback(L.Callback):
    """Every ``every`` steps (and at the end of training), measure the contribution on a fixed probe batch.

    The probe is ``probe`` if given, else the first ``batch_size`` sequences of the datamodule's first
    validation loader, else of the first training batch.
    """

    def __init__(self, every: int = 250, batch_size: int = 32, seq_len: Optional[int] = None,
                 probe: Optional[torch.Tensor] = None, images: bool = True):
        require_positive("contribution_every", every)
        require_positive("contribution_batch_size", batch_size)
        self.every = every
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.probe = probe
        self.images = images
        self.latest: Optional[Contribution] = None
        self._last = -1

    def on_train_start(self, trainer, pl_module) -> None:
        if not trainer.is_global_zero:
            return
        if self.probe is None:
            self.probe = self._validation_probe(trainer)
        if self.probe is not None:
            check_probe(pl_module.model, self.probe, self.seq_len)

    def _validation_probe(self, trainer) -> Optional[torch.Tensor]:
        return validation_rows(trainer, self.batch_size)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.is_global_zero:
            return
        batch = batch_tokens(batch)
        if self.probe is None and isinstance(batch, torch.Tensor) and batch.dim() == 2:
            self.probe = batch[: self.batch_size].detach().clone()
            check_probe(pl_module.model, self.probe, self.seq_len)
        step = trainer.global_step
        if step > 0 and step % self.every == 0 and step != self._last:
            self._measure(trainer, pl_module, step)

    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.is_global_zero and self.probe is not None and trainer.global_step != self._last:
            self._measure(trainer, pl_module, trainer.global_step)

    def _measure(self, trainer, pl_module, step: int) -> None:
        self._last = step
        self.latest = measure_contribution(pl_module.model, self.probe, self.seq_len)
        x = log_step(trainer)
        log_scalars(trainer, self.latest.scalars(), x)
        if self.images:
            log_figure(trainer, "contribution/by_state", contribution_figure(self.latest), x)

    def final_metrics(self) -> Dict[str, float]:
        if self.latest is None:
            return {}
        keys = ("contribution/ratio_mha", "contribution/ratio_ffn", "contribution/ratio_mha_se",
                "contribution/ratio_ffn_se", "contribution/acc_final")
        return {k: v for k, v in self.latest.scalars().items() if k in keys}
