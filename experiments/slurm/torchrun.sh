#!/bin/bash
# Multi-GPU / multi-node DDP with torchrun instead of srun: run this once per node.
#
#   single node, all GPUs:  RUN_ID=mod-small experiments/slurm/torchrun.sh --variant mod --size small
#   two nodes (on each):    NNODES=2 NODE_RANK=<0|1> MASTER_ADDR=<node 0> RUN_ID=mod-small \
#                               experiments/slurm/torchrun.sh --variant mod --size small
#   inside a SLURM job:     srun --ntasks-per-node=1 experiments/slurm/torchrun.sh ...  (nodes, rank and
#                               master address come from SLURM; RUN_ID defaults to torchrun-<job id>)
#
# Lightning detects TorchElasticEnvironment (it wins over SLURM's) and takes ranks from torchrun.
# Every node must use the same RUN_ID: it is the run folder name (--version), which the ranks cannot
# agree on by themselves across processes that torchrun started independently.
# Preemption: torchrun forwards SIGTERM to its workers; callbacks/preemption.py saves
# checkpoints/last.ckpt after the current step. Resume with the same command plus --ckpt_path last.
set -euo pipefail
cd "$(dirname "$0")/../.."
export TOKENIZERS_PARALLELISM=false

if [ -n "${SLURM_JOB_ID:-}" ]; then
    NNODES="${NNODES:-${SLURM_JOB_NUM_NODES:-1}}"
    NODE_RANK="${NODE_RANK:-${SLURM_NODEID:-0}}"
    MASTER_ADDR="${MASTER_ADDR:-$(scontrol show hostnames "${SLURM_JOB_NODELIST}" | head -n 1)}"
    RUN_ID="${RUN_ID:-torchrun-${SLURM_JOB_ID}}"
fi
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"
if [ -z "${NPROC_PER_NODE:-}" ]; then
    NPROC_PER_NODE="$(nvidia-smi -L 2>/dev/null | wc -l || true)"
    if [ "${NPROC_PER_NODE:-0}" -lt 1 ]; then NPROC_PER_NODE=1; fi
fi
if [ -z "${RUN_ID:-}" ]; then
    if [ "$NNODES" -gt 1 ]; then echo "error: set RUN_ID (the same on every node)" >&2; exit 2; fi
    RUN_ID="torchrun-$(date +%Y%m%d-%H%M%S)"
fi

# Tokenise first on this node's CPUs (a no-op once the cache exists; on a shared disk one node builds and the
# others wait for it): inside the training processes the other ranks would wait at a 30-minute barrier.
python -m experiments.prepare "$@"

exec torchrun --nnodes "$NNODES" --nproc_per_node "$NPROC_PER_NODE" --node_rank "$NODE_RANK" \
    --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT" \
    -m experiments.run --trainer.num_nodes "$NNODES" --trainer.devices "$NPROC_PER_NODE" \
    "$@" --version "$RUN_ID"
