#!/bin/bash
# The pre-registered 16,000-step necessity check on probe-v8/induct (probe_induct_necessity_16k.md beside it):
# 1/2/4-layer vanilla x seeds 1357-1361, two runs at a time, one thread each, AVX2 kernels.
#   bash docs/results/preregistered/probe_induct_necessity_16k.sh [OUT]     (from the repository root, venv active)
# Rerun the same command to go on: a finished run is skipped, a run cut off resumes from its checkpoints/last.ckpt
# (validation every 1,000 steps), one cut off before its first checkpoint starts again.
set -u
OUT=${1:-out/probe_induct_necessity_16k}
mkdir -p "$OUT/logs"
export OMP_NUM_THREADS=1 MKL_CBWR=AVX2 ATEN_CPU_CAPABILITY=avx2

one() {  # LAYERS SEED
  local name=L$1-s$2 dir=$OUT/vanilla-tiny/L$1-s$2 resume=()
  [ -f "$dir/summary.json" ] && return 0
  if [ -f "$dir/checkpoints/last.ckpt" ]; then resume=(--ckpt_path "$dir/checkpoints/last.ckpt")
  elif [ -d "$dir" ]; then rm -rf "$dir"; fi  # cut off before its first checkpoint: nothing to resume
  echo "start $name ${resume[*]} $(date -u +%FT%TZ)" >> "$OUT/logs/events.txt"
  nice python -m experiments.run --data probe-v8/induct --data.max_tokens 16777216 \
    --model.d_model 64 --model.n_layer "$1" --model.n_head 4 --model.block_size 128 --data.batch_size 32 \
    --data.loss_mask labelled --optim.lr 1e-3 --optim.warmup_steps 100 --val_blocks 32 --callbacks.probe_blocks 128 \
    --callbacks.contribution false --callbacks.throughput false --trainer.enable_progress_bar false \
    --max_steps 16000 --val_every 1000 --seed "$2" --log_dir "$OUT" --version "$name" "${resume[@]}" \
    >> "$OUT/logs/$name.log" 2>&1
  echo "end $name rc=$? $(date -u +%FT%TZ)" >> "$OUT/logs/events.txt"
}

if [ $# -ge 3 ]; then one "$2" "$3"; exit; fi
# per seed 4, 2, 1 layers (longest first), from one queue, two at a time
for seed in 1357 1358 1359 1360 1361; do for layers in 4 2 1; do echo "$layers $seed"; done; done |
  xargs -P 2 -L 1 bash "$0" "$OUT"
echo "queue done $(date -u +%FT%TZ)" >> "$OUT/logs/events.txt"
