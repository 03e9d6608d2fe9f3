"""MHA-vs-FFN contribution ratios of a trained checkpoint (logit lens, linear probes, mutual information), the
run-folder readers they use, and a run's routing statistics first vs last step. The command line and the
methods in words: ``experiments/analyze.py`` (``python -m experiments.analyze``).
"""
from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any, Dict, List, Optional, Tuple

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

METHODS = ("logit_lens", "probe", "mi")
MI_RESTARTS = 5  # k-means seeds the mi method averages over (see mi_method)


# ---------------------------------------------------------------------------- loading
def run_folder(ckpt: pathlib.Path) -> pathlib.Path:
    return ckpt.parent.parent if ckpt.parent.name == "checkpoints" else ckpt.parent


def load_model(ckpt: pathlib.Path, device: str = "cpu"):
    from lightning_modules.lm import LanguageModelModule

    if not ckpt.is_file():
        raise FileNotFoundError(f"--ckpt: no checkpoint at {ckpt}")
    module = LanguageModelModule.load_from_checkpoint(str(ckpt), map_location=device)
    return module.model.to(device).eval()


def run_config(folder: pathlib.Path) -> Dict[str, Any]:
    import yaml

    path = folder / "config.yaml"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: the probe data are rebuilt from the run's config.yaml (written by experiments.run)"
        )
    return yaml.safe_load(path.read_text()) or {}


def probe_sequences(folder: pathlib.Path, block_size: int, vocab_size: int, count: int) -> torch.Tensor:
    """(N, block_size + 1) token ids: the first ``count`` blocks of the run's first validation set."""
    from callbacks.common import batch_tokens
    from datamodules.lm import DataConfig, LMDataModule

    config = run_config(folder)
    fields = {f.name for f in dataclasses.fields(DataConfig)}
    data = DataConfig(**{k: v for k, v in (config.get("data") or {}).items() if k in fields})
    datamodule = LMDataModule(data, block_size=block_size, seed=int(config.get("seed", 0)))
    if datamodule.vocab_size != vocab_size:
        raise ValueError(
            f"the run's tokenizer has {datamodule.vocab_size} tokens but the model {vocab_size}: "
            f"config.yaml in {folder} does not belong to this checkpoint"
        )
    datamodule.prepare_data()
    datamodule.setup("validate")
    dataset = next(iter(datamodule.val_sets.values()))
    n = min(count, len(dataset))
    return torch.stack([batch_tokens(dataset[i]) for i in range(n)])  # under a loss mask: (tokens, weights)


# ---------------------------------------------------------------------------- states
@torch.no_grad()
def collect_states(model, sequences: torch.Tensor, batch_size: int) -> Tuple[List[str], List[str], List[torch.Tensor], torch.Tensor]:
    """Labels, tags, per-state (N*T, d) fp32 CPU hidden states, and (N*T,) next-token targets."""
    from callbacks.contribution import state_labels

    device = next(model.parameters()).device
    per_state: List[List[torch.Tensor]] = []
    targets, labels, tags = [], [], []
    for start in range(0, sequences.shape[0], batch_size):
        batch = sequences[start : start + batch_size].to(device)
        states = model(batch[:, :-1], return_residuals=True).residuals
        if not per_state:
            per_state = [[] for _ in states]
            labels, tags = state_labels(states), [s.tag for s in states]
        for bucket, state in zip(per_state, states):
            bucket.append(state.hidden.reshape(-1, state.hidden.shape[-1]).float().cpu())
        targets.append(batch[:, 1:].reshape(-1).cpu())
    return labels, tags, [torch.cat(b) for b in per_state], torch.cat(targets)


def normalised(hidden: torch.Tensor, eps: float) -> torch.Tensor:
    return F.layer_norm(hidden, hidden.shape[-1:], eps=eps)


# ---------------------------------------------------------------------------- methods
@torch.no_grad()
def logit_lens(model, sequences: torch.Tensor, batch_size: int) -> Dict[str, Any]:
    from callbacks.contribution import BOOTSTRAP_SAMPLES, bootstrap_ratio_se, measure_contribution

    results = [measure_contribution(model, sequences[s : s + batch_size]) for s in range(0, len(sequences), batch_size)]
    weights = np.array([min(batch_size, len(sequences) - s) for s in range(0, len(sequences), batch_size)], float)
    weights /= weights.sum()
    accuracy = np.average([r.accuracy for r in results], axis=0, weights=weights).tolist()
    dla = np.average([r.dla for r in results], axis=0, weights=weights).tolist()
    se = bootstrap_ratio_se(results[0].tags, torch.cat([r.correct for r in results], dim=1))
    return {"labels": results[0].labels, "tags": results[0].tags, "values": accuracy, "value_name": "top1_accuracy",
            "dla": dict(zip(results[0].labels, dla)), "ratio_mha_se": se["mha"], "ratio_ffn_se": se["ffn"],
            "se_method": f"bootstrap over sequences ({BOOTSTRAP_SAMPLES} resamples)"}


def linear_probe_accuracy(model, features: torch.Tensor, targets: torch.Tensor, train: torch.Tensor,
                          steps: int, lr: float, seed: int) -> float:
    """Held-out top-1 of a linear probe initialised at the logit lens and trained with Adam."""
    ln, head = model.ln_f, model.lm_head
    weight = head.weight.detach().float().cpu()
    gamma = ln.weight.detach().float().cpu() if ln.weight is not None else torch.ones(weight.shape[1])
    beta = ln.bias.detach().float().cpu() if ln.bias is not None else torch.zeros(weight.shape[1])
    probe = torch.nn.Linear(weight.shape[1], weight.shape[0])
    with torch.no_grad():
        probe.weight.copy_(weight * gamma)
        probe.bias.copy_(weight @ beta)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(probe.parameters(), lr=lr)
    x_train, y_train = features[train], targets[train]
    for _ in range(steps):
        rows = torch.randint(0, x_train.shape[0], (min(1024, x_train.shape[0]),), generator=generator)
        loss = F.cross_entropy(probe(x_train[rows]), y_train[rows])
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        test = ~train
        return float((probe(features[test]).argmax(-1) == targets[test]).float().mean())


def probe_method(model, sequences: torch.Tensor, batch_size: int, steps: int, lr: float, seed: int) -> Dict[str, Any]:
    labels, tags, states, targets = collect_states(model, sequences, batch_size)
    per_sequence = sequences.shape[1] - 1
    n_train = max(1, int(0.8 * sequences.shape[0]))
    if n_train >= sequences.shape[0]:
        raise ValueError(f"--method probe needs at least 2 probe sequences, got {sequences.shape[0]}")
    train = torch.arange(targets.numel()) < n_train * per_sequence  # split by sequence: no shared context
    eps = model.ln_f.eps
    values = [linear_probe_accuracy(model, normalised(h, eps), targets, train, steps, lr, seed) for h in states]
    return {"labels": labels, "tags": tags, "values": values, "value_name": "probe_top1_accuracy"}


def entropy_bits(labels: np.ndarray) -> float:
    _, counts = np.unique(labels, return_counts=True)
    p = counts / counts.sum()
    return float(-(p * np.log2(p)).sum())


def mutual_information(clusters: np.ndarray, tokens: np.ndarray) -> float:
    """Plug-in I(cluster; token) in bits."""
    joint = clusters.astype(np.int64) * (int(tokens.max()) + 1) + tokens.astype(np.int64)
    return entropy_bits(clusters) + entropy_bits(tokens) - entropy_bits(joint)


def mi_method(model, sequences: torch.Tensor, batch_size: int, clusters: int, seed: int,
              restarts: int = MI_RESTARTS) -> Dict[str, Any]:
    """I(cluster; next token) per site, averaged over ``restarts`` k-means seeds (seed, seed + 1, ...). The ratios
    divide differences of ~0.1 bit between sites whose information is ~3 bits, so one clustering's noise can move a
    ratio by more than a model change (0.28-0.99 over eight seeds on one small model); with several restarts the
    ratios' SE is a bootstrap over them."""
    from sklearn.cluster import MiniBatchKMeans

    from callbacks.contribution import BOOTSTRAP_SAMPLES, bootstrap_ratio_se

    labels, tags, states, targets = collect_states(model, sequences, batch_size)
    if clusters > targets.numel():
        raise ValueError(f"--clusters {clusters} exceeds the {targets.numel()} probe tokens")
    y = targets.numpy()
    per_restart = []  # (states, restarts)
    for hidden in states:
        x = normalised(hidden, model.ln_f.eps).numpy().astype(np.float32)
        per_restart.append([mutual_information(MiniBatchKMeans(n_clusters=clusters, random_state=seed + r,
                                                               batch_size=1024, n_init=3).fit_predict(x), y)
                            for r in range(restarts)])
    se = bootstrap_ratio_se(tags, torch.tensor(per_restart, dtype=torch.float64))
    return {"labels": labels, "tags": tags, "values": [float(np.mean(v)) for v in per_restart],
            "value_name": "mutual_information_bits", "token_entropy_bits": entropy_bits(y), "restarts": restarts,
            "values_per_restart": per_restart, "ratio_mha_se": se["mha"], "ratio_ffn_se": se["ffn"],
            "se_method": f"bootstrap over the {restarts} k-means seeds ({BOOTSTRAP_SAMPLES} resamples)"}


# ---------------------------------------------------------------------------- command
def contribution(ckpt: str, method: str = "logit_lens", sequences: int = 64, batch_size: int = 8,
                 clusters: int = 64, probe_steps: int = 200, probe_lr: float = 1e-3, seed: int = 0,
                 device: str = "cpu", restarts: int = MI_RESTARTS) -> Dict[str, Any]:
    from callbacks.contribution import ratios_from_values

    if method not in METHODS:
        raise ValueError(f"--method: unknown method {method!r}; valid methods: {', '.join(METHODS)}")
    for name, value in (("sequences", sequences), ("batch_size", batch_size), ("clusters", clusters),
                        ("restarts", restarts)):
        if value <= 0:
            raise ValueError(f"--{name}: must be a positive integer, got {value}")
    path = pathlib.Path(ckpt)
    model = load_model(path, device)
    torch.manual_seed(seed)
    data = probe_sequences(run_folder(path), model.config.block_size, model.config.vocab_size, sequences)
    if method == "logit_lens":
        result = logit_lens(model, data, batch_size)
    elif method == "probe":
        result = probe_method(model, data, batch_size, probe_steps, probe_lr, seed)
    else:
        result = mi_method(model, data, batch_size, clusters, seed, restarts)
    ratios = ratios_from_values(result["tags"], result["values"])
    return {"method": method, "ckpt": str(path), "variant": model.config.variant, "sequences": int(data.shape[0]),
            "tokens": int(data.shape[0] * (data.shape[1] - 1)), "ratio_mha": ratios["mha"], "ratio_ffn": ratios["ffn"],
            **({"clusters": clusters} if method == "mi" else {}), **result}


def routing(run_dir: str, png: Optional[str] = None) -> Dict[str, Any]:
    """Option fractions per site and transition matrices of the first and last logged step (printed and plotted)."""
    from callbacks.routing import STATS_FILE, first_last_figure, load_stats

    folder = pathlib.Path(run_dir)
    if not (folder / STATS_FILE).is_file():
        raise FileNotFoundError(f"run_dir: no {STATS_FILE} in {folder} (routing statistics are saved by runs of "
                                "a routed variant with --callbacks.routing true)")
    records = load_stats(folder)
    if not records:
        raise FileNotFoundError(f"run_dir: {folder / STATS_FILE} holds no records")
    (_, first), (_, last) = records[0], records[-1]
    result: Dict[str, Any] = {"run_dir": str(folder), "steps": [s for s, _ in records], "sites": {}, "transitions": []}
    for name, site in last.sites.items():
        before = first.sites.get(name)
        result["sites"][name] = {
            "choices": list(site.layout.choices),
            "first": before.fractions.tolist() if before is not None else None,
            "last": site.fractions.tolist(),
        }
    for t in last.transitions:
        before = next((x for x in first.transitions if (x.source, x.target) == (t.source, t.target)), None)
        result["transitions"].append({"group": t.group, "source": t.source, "target": t.target,
                                      "first": before.matrix.tolist() if before is not None else None,
                                      "last": t.matrix.tolist(), "last_row_counts": t.counts.sum(1).tolist()})
    fig = first_last_figure(records)
    if fig is not None:
        import matplotlib.pyplot as plt

        out = pathlib.Path(png) if png else folder / "routing" / "first-vs-last.png"
        fig.savefig(out, dpi=120)
        plt.close(fig)
        result["png"] = str(out)
    return result
