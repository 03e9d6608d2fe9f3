"""XSUM fine-tuning and evaluation for any variant: summary-only LM loss, generation, ROUGE.

Training: teacher forcing on ``document SEP summary EOT`` with the loss on the summary tokens (and the
final EOT) only, plus the backbone's auxiliary routing loss. Evaluation (``trainer.test``): summaries
are generated with the model's own ``generate()`` (greedy, KV cache; prompts of equal length are
batched) or with ``beam_search`` below (beams are rows of one batch; ``KVCache.reorder`` follows the
surviving beams), cut at EOT, and scored with torchmetrics' ROUGE-1/2/L F-measure. Without a stemmer
(the default, no nltk needed) scores run slightly below the stemmed numbers papers report.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics import MeanMetric
from torchmetrics.text.rouge import ROUGEScore

from architectures import ModelConfig, build_model
from architectures.config import ConfigError
from architectures.contract import KVCache
from datamodules.xsum import IGNORE
from lightning_modules.lm import OptimConfig, parameter_groups, warmup_cosine

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL")


@torch.no_grad()
def beam_search(model, prompt: torch.Tensor, num_beams: int, max_new_tokens: int,
                eos_token_id: Optional[int] = None, length_penalty: float = 1.0, use_cache: bool = True) -> List[int]:
    """The highest-scoring continuation of ``prompt`` (1-D ids), without the prompt and the EOS.

    Scores are summed log-probabilities divided by ``length ** length_penalty``. A beam that emits
    EOS among the top ``num_beams`` candidates is finished; the search stops when ``num_beams`` beams
    are finished and no running beam can still beat the worst of them, or at ``max_new_tokens``.
    """
    if num_beams < 1:
        raise ValueError(f"num_beams must be >= 1, got {num_beams}")
    if prompt.numel() + max_new_tokens > model.config.block_size:
        raise ValueError(f"prompt ({prompt.numel()}) + max_new_tokens ({max_new_tokens}) exceeds model.block_size="
                         f"{model.config.block_size}")
    model.prepare_generation()
    was_training = model.training
    model.eval()
    try:
        with model.causal_routing():
            return _beam_search(model, prompt.view(1, -1), num_beams, max_new_tokens, eos_token_id, length_penalty,
                                use_cache and model.supports_kv_cache)
    finally:
        model.train(was_training)


def _beam_search(model, prompt, num_beams, max_new_tokens, eos, length_penalty, use_cache) -> List[int]:
    cache = KVCache() if use_cache else None
    logits = model(prompt, cache=cache).logits[:, -1] if use_cache else model(prompt).logits[:, -1]
    seqs = prompt.new_zeros((1, 0))
    scores = torch.zeros(1, device=prompt.device)
    finished: List[tuple] = []  # (normalised score, tokens)
    for _ in range(max_new_tokens):
        candidates = scores[:, None] + F.log_softmax(logits.float(), dim=-1)
        vocab = candidates.shape[-1]
        top = candidates.view(-1).topk(min(2 * num_beams, candidates.numel()))
        rows, tokens, kept = [], [], []
        for rank, (score, pos) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
            row, token = divmod(pos, vocab)
            if eos is not None and token == eos:
                if rank < num_beams:
                    finished.append((score / (seqs.shape[1] + 1) ** length_penalty, seqs[row].tolist()))
                continue
            rows.append(row), tokens.append(token), kept.append(score)
            if len(rows) == num_beams:
                break
        finished = sorted(finished, key=lambda h: -h[0])[:num_beams]
        if not rows or _done(finished, max(kept, default=float("-inf")), seqs.shape[1] + 1, num_beams, length_penalty):
            rows = []
            break
        index = torch.tensor(rows, device=prompt.device)
        step = torch.tensor(tokens, device=prompt.device)[:, None]
        seqs = torch.cat([seqs.index_select(0, index), step], dim=1)
        scores = torch.tensor(kept, device=prompt.device)
        if cache is not None:
            cache.reorder(index)
            logits = model(step, cache=cache).logits[:, -1]
        else:
            logits = model(torch.cat([prompt.expand(len(rows), -1), seqs], dim=1)).logits[:, -1]
    if rows:  # ran out of steps: the running beams compete with the finished ones
        length = max(seqs.shape[1], 1)
        finished += [(s / length ** length_penalty, seq) for s, seq in zip(scores.tolist(), seqs.tolist())]
    return max(finished, key=lambda h: h[0])[1] if finished else []


def _done(finished, best_running: float, length: int, num_beams: int, length_penalty: float) -> bool:
    if len(finished) < num_beams:
        return False
    return best_running / length ** length_penalty <= finished[-1][0]


def greedy_summaries(model, prompts: List[torch.Tensor], max_new_tokens: int, eos: int) -> List[List[int]]:
    """``model.generate`` (greedy, KV cache) on groups of equal-length prompts; each cut at EOS."""
    out: List[Optional[List[int]]] = [None] * len(prompts)
    groups: Dict[int, List[int]] = {}
    for i, p in enumerate(prompts):
        groups.setdefault(p.numel(), []).append(i)
    for length, members in groups.items():
        batch = torch.stack([prompts[i] for i in members])
        generated = model.generate(batch, max_new_tokens, greedy=True, eos_token_id=eos)[:, length:]
        for i, row in zip(members, generated.tolist()):
            out[i] = row[: row.index(eos)] if eos in row else row
    return out


def make_rouge(stemmer: bool) -> ROUGEScore:
    try:
        return ROUGEScore(rouge_keys=ROUGE_KEYS, use_stemmer=stemmer)
    except ModuleNotFoundError as err:
        raise ConfigError(f"rouge_stemmer: the Porter stemmer needs nltk (pip install nltk): {err}") from err


class XSumModule(L.LightningModule):
    def __init__(self, model: Dict[str, Any], optim: Optional[Dict[str, Any]] = None, max_steps: int = 1000,
                 eot_id: int = 0, num_beams: int = 1, max_new_tokens: int = 64, length_penalty: float = 1.0,
                 rouge_stemmer: bool = False, tokenizer=None):
        super().__init__()
        self.save_hyperparameters(ignore=["tokenizer"])
        if num_beams < 1:
            raise ConfigError(f"num_beams: must be >= 1, got {num_beams}")
        if max_new_tokens < 1:
            raise ConfigError(f"max_new_tokens: must be >= 1, got {max_new_tokens}")
        self.model = build_model(ModelConfig.from_dict(model))
        self.model_config = self.model.config
        self.optim = OptimConfig(**(optim or {}))
        self.optim.validate()
        self.max_steps, self.eot_id = max_steps, eot_id
        self.num_beams, self.max_new_tokens, self.length_penalty = num_beams, max_new_tokens, length_penalty
        self.tokenizer = tokenizer
        self.val_loss = MeanMetric()
        self.rouge = make_rouge(rouge_stemmer)
        self.predictions: List[Dict[str, str]] = []

    # ------------------------------------------------------------------ teacher forcing
    def summary_loss(self, batch: Dict[str, torch.Tensor]):
        out = self.model(batch["idx"], attention_mask=batch["attention_mask"])
        logits = out.logits.float()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch["targets"].reshape(-1), ignore_index=IGNORE)
        return loss, out.aux_loss

    def training_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss, aux = self.summary_loss(batch)
        self.log("train/loss", loss, prog_bar=True)
        self.log("train/aux_loss", aux)
        return loss + aux

    def validation_step(self, batch: Dict[str, torch.Tensor], batch_idx: int) -> None:
        loss, _ = self.summary_loss(batch)
        self.val_loss.update(loss, weight=int((batch["targets"] != IGNORE).sum()))

    def on_validation_epoch_end(self) -> None:
        if self.val_loss.update_count:
            self.log("val/loss", self.val_loss.compute())
        self.val_loss.reset()

    # ------------------------------------------------------------------ generation + ROUGE
    def summarise(self, prompts: List[torch.Tensor]) -> List[str]:
        if self.num_beams == 1:
            ids = greedy_summaries(self.model, [p.to(self.device) for p in prompts], self.max_new_tokens, self.eot_id)
        else:
            ids = [beam_search(self.model, p.to(self.device), self.num_beams, self.max_new_tokens, self.eot_id,
                               self.length_penalty) for p in prompts]
        return [self.tokenizer.decode(x).strip() for x in ids]

    def test_step(self, batch: Dict[str, list], batch_idx: int) -> None:
        summaries = self.summarise(batch["prompts"])
        self.rouge.update(summaries, batch["references"])
        self.predictions.extend({"id": i, "prediction": p, "reference": r}
                                for i, p, r in zip(batch["ids"], summaries, batch["references"]))

    def on_test_epoch_start(self) -> None:
        self.predictions = []

    def on_test_epoch_end(self) -> None:
        self._gather_predictions()
        scores = self.rouge.compute()
        for key in ROUGE_KEYS:
            self.log(f"test/{key}", scores[f"{key}_fmeasure"])
        self.rouge.reset()

    def _gather_predictions(self) -> None:
        """Under DDP every rank summarised its share: rank 0 writes them all (the sampler's padding repeats
        some examples; each id is kept once, in id order when ids are sortable)."""
        if self.trainer.world_size <= 1:
            return
        import torch.distributed as dist

        gathered: List[Any] = [None] * self.trainer.world_size
        dist.all_gather_object(gathered, self.predictions)
        unique: Dict[Any, Dict[str, str]] = {}
        for part in gathered:
            for row in part:
                unique.setdefault(row["id"], row)
        try:
            self.predictions = [unique[k] for k in sorted(unique)]
        except TypeError:
            self.predictions = list(unique.values())

    # ------------------------------------------------------------------ optimisation
    def configure_optimizers(self):
        groups = parameter_groups(self.model, self.optim.weight_decay)
        optimizer = torch.optim.AdamW(groups, lr=self.optim.lr, betas=(self.optim.beta1, self.optim.beta2),
                                      eps=self.optim.eps)
        schedule = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda step: warmup_cosine(step, self.optim.warmup_steps, self.max_steps, self.optim.min_lr_ratio))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
