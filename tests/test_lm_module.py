"""Optimiser set-up and schedule of the pre-training LightningModule."""
from __future__ import annotations

import math

import pytest
import torch

from architectures.config import ConfigError
from lightning_modules.lm import LanguageModelModule, OptimConfig, parameter_groups, warmup_cosine

TINY = dict(variant="vanilla", vocab_size=64, d_model=16, n_layer=2, n_head=2, block_size=16)


def test_warmup_then_cosine_to_min_ratio():
    values = [warmup_cosine(s, 10, 110, 0.1) for s in range(0, 121)]
    assert values[0] == pytest.approx(0.1) and values[9] == pytest.approx(1.0)
    assert all(a <= b for a, b in zip(values[:10], values[1:10]))  # rising
    assert values[60] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert values[110] == pytest.approx(0.1) and values[120] == pytest.approx(0.1)  # holds after the end


def test_weight_decay_only_on_matrices_and_tied_weight_once():
    module = LanguageModelModule(model=TINY, optim={"weight_decay": 0.1})
    decay, no_decay = parameter_groups(module.model, 0.1)
    assert all(p.dim() >= 2 for p in decay["params"]) and all(p.dim() < 2 for p in no_decay["params"])
    total = sum(p.numel() for g in (decay, no_decay) for p in g["params"])
    assert total == module.model.num_parameters()  # the tied embedding / head counted once
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0


def test_optimizer_and_schedule_are_wired():
    module = LanguageModelModule(model=TINY, optim={"lr": 2e-3, "warmup_steps": 4}, max_steps=20)
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    assert isinstance(optimizer, torch.optim.AdamW) and config["lr_scheduler"]["interval"] == "step"
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3 / 4)  # first warmup step
    for _ in range(3):
        optimizer.step()
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(2e-3)


def test_hyperparameters_rebuild_the_same_model():
    module = LanguageModelModule(model=TINY, optim={"lr": 1e-3}, max_steps=7)
    again = LanguageModelModule(**module.hparams)
    assert again.model.config == module.model.config and again.max_steps == 7


@pytest.mark.parametrize("field,value", [("lr", 0.0), ("min_lr_ratio", 2.0), ("beta2", 1.0), ("warmup_steps", -1),
                                         ("schedule_steps", 0), ("weight_decay", -0.1)])
def test_bad_optimizer_values_name_the_field(field, value):
    with pytest.raises(ConfigError, match=f"optim.{field}"):
        OptimConfig(**{field: value}).validate()
