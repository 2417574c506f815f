#!/usr/bin/env bash
# The accelerator path in one short run on a machine with an NVIDIA GPU and PyTorch + Triton
# installed (pip install -e ".[dev]"): kernel tests natively on CUDA, greedy parity with HF
# transformers, batch-1 decode against the bandwidth floor (eager and CUDA graphs), throughput at
# batch 64 and 256 against HF generate. No downloads; under 8 minutes; a table at the end.
#
#   bash scripts/gpu_check.sh [--sections kernels,parity,decode,throughput] [--batches 64,256]
#
# Record the table in docs/benchmarks.md. Exit status: 0 when nothing failed.
set -uo pipefail
cd "$(dirname "$0")/.."
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
    echo "gpu_check: torch sees no CUDA GPU" >&2
    exit 2
fi
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
unset TRITON_INTERPRET
# The script keeps its own 450 s budget per section; the outer limit is the hard stop.
timeout --signal=INT 470 python3 scripts/gpu_check.py --device cuda "$@"
