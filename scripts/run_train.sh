#!/usr/bin/env bash
# Local launcher: torchrun (through outlier_titan.launch, which lets the ranks checkpoint on SIGTERM/SIGUSR1)
# on one machine. Extra arguments are config overrides.
#   scripts/run_train.sh [CONFIG] [--section.key value ...]
#   NGPU=4 scripts/run_train.sh train_configs/llama_1b_8gpu.toml --parallelism.tp 2
# NGPU defaults to the number of visible GPUs (or 1 on a CPU-only machine; set NGPU for more gloo ranks).
# LOG_RANK picks which ranks' output is shown (default 0).
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-train_configs/debug.toml}
[ $# -gt 0 ] && shift
if [ -z "${NGPU:-}" ]; then
  NGPU=$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
LOG_RANK=${LOG_RANK:-0}
export PYTORCH_ALLOC_CONF=${PYTORCH_ALLOC_CONF:-expandable_segments:True}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec python3 -m outlier_titan.launch --standalone --nproc_per_node="$NGPU" --local-ranks-filter "$LOG_RANK" --role rank --tee 3 \
  -m outlier_titan.train --config "$CONFIG" "$@"
