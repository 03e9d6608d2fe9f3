"""The memory plan of a parsed ``experiments.run`` configuration (``experiments.sweep --dry_run``). What the
plan counts and how activations are measured: ``model_tools/memory.py``.
"""
from __future__ import annotations

from typing import Any, Tuple

from model_tools.memory import Plan, job_plan, measure


def measurement_inputs(cfg) -> Tuple[Any, str, str]:
    """What a job's measurement depends on: (resolved model config, precision, checkpointing policy). Jobs that
    differ only in steps, data, init, batch, accumulation or GPUs share one measurement."""
    from experiments.run import model_config

    return model_config(cfg).resolve(), str(cfg.trainer.precision or "bf16-mixed"), str(cfg.activation_checkpointing)


def plan_run_config(cfg, gpu_memory_gb: float = 80.0) -> Plan:
    """The plan of one parsed ``experiments.run`` configuration (the model built on the CPU)."""
    return job_plan(measure(*measurement_inputs(cfg)), cfg, gpu_memory_gb)
