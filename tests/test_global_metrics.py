"""Global metrics under DDP: 2 gloo processes log what 1 process logs on the same global batches."""
from __future__ import annotations

import json
import os
import pathlib
import socket

import lightning as L
import pytest
import torch
import torch.multiprocessing as mp
from lightning.pytorch.loggers import Logger

GLOBAL_BATCH, T, STEPS = 8, 16, 3
MODEL = dict(variant="mod", vocab_size=64, d_model=32, n_layer=2, n_head=2, block_size=T)


class MemoryLogger(Logger):
    """Records every (step, metrics) pair Lightning or a callback writes."""

    def __init__(self) -> None:
        super().__init__()
        self.records = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> str:
        return "0"

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.records.append((step, {k: float(v) for k, v in metrics.items()}))


def global_batches() -> torch.Tensor:
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, MODEL["vocab_size"], (STEPS, GLOBAL_BATCH, T + 1), generator=generator)


def fit(rank: int, world: int, strategy="auto"):
    """Train on this rank's share of each global batch; returns the logged metrics and the summary parts."""
    from callbacks.flops import FlopsCallback
    from callbacks.routing import RoutingStatistics
    from callbacks.run_summary import StepRecorder, measured_summary
    from lightning_modules.lm import LanguageModelModule

    share = GLOBAL_BATCH // world
    rows = [batch[rank * share:(rank + 1) * share] for batch in global_batches()]
    L.seed_everything(0, verbose=False)
    module = LanguageModelModule(model=MODEL, optim={"warmup_steps": 0}, max_steps=STEPS)
    logger, recorder = MemoryLogger(), StepRecorder(skip_first=0)
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=world, strategy=strategy, logger=logger,
                        callbacks=[recorder, RoutingStatistics(every=1), FlopsCallback(every=1)],
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=1, use_distributed_sampler=False)
    loader = torch.utils.data.DataLoader(torch.cat(rows), batch_size=share, shuffle=False)
    trainer.fit(module, train_dataloaders=loader)
    summary = measured_summary(trainer, module, recorder)
    return logger.records, {k: summary[k] for k in ("routing", "flops_per_token", "train_loss_curve", "final_train_loss")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, out: str) -> None:
    from lightning.pytorch.strategies import DDPStrategy

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), WORLD_SIZE=str(world), RANK=str(rank),
                      LOCAL_RANK=str(rank), NODE_RANK="0")
    records, summary = fit(rank, world, DDPStrategy(process_group_backend="gloo"))
    if rank == 0:
        pathlib.Path(out).write_text(json.dumps({"records": records, "summary": summary}))


def _series(records, prefix):
    return {(step, k): v for step, metrics in records for k, v in metrics.items() if k.startswith(prefix)}


@pytest.mark.slow
def test_two_gloo_ranks_log_the_global_batch_loss_routing_and_flops(tmp_path, one_thread):
    from lightning.fabric.utilities.rank_zero import rank_zero_only

    out = tmp_path / "ddp.json"
    # spawn, not fork: forked children inherit the parent's thread pools and can deadlock on their locks
    mp.start_processes(_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True, start_method="spawn")
    ddp = json.loads(out.read_text())
    rank = getattr(rank_zero_only, "rank", 0)
    try:
        records, summary = fit(0, 1)
    finally:
        rank_zero_only.rank = rank
    for prefix in ("train/loss", "train/ppl", "train/aux_loss", "aux/", "routing/", "flops/"):
        single, distributed = _series(records, prefix), _series(ddp["records"], prefix)
        assert single and single.keys() == distributed.keys(), prefix
        for key, value in single.items():
            assert distributed[key] == pytest.approx(value, abs=1e-6, rel=1e-6), (prefix, key)
    assert ddp["summary"]["routing"].keys() == summary["routing"].keys()
    for site, fractions in summary["routing"].items():
        assert ddp["summary"]["routing"][site] == pytest.approx(fractions)
    assert ddp["summary"]["flops_per_token"]["forward"] == pytest.approx(summary["flops_per_token"]["forward"])
    for (s1, l1), (s2, l2) in zip(summary["train_loss_curve"], ddp["summary"]["train_loss_curve"]):
        assert s1 == s2 and l2 == pytest.approx(l1, abs=1e-6)
    assert len(summary["train_loss_curve"]) == STEPS
