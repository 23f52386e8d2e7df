#!/usr/bin/env bash
# GPU check of the compiler issue: random-weight Llama-3.1-8B-shaped target and Llama-3.2-1B-shaped
# draft in bf16; reports verify / glue / tree-per-depth / step ms, SD and SSD round ms and the Triton
# kernels Inductor generated, as JSON in ${OUT:-bench_results}/gpu_check.json (rewritten after each
# phase, so a run cut short keeps what it measured). Stops itself after 8 minutes.
# Usage: bash benchmarks/gpu_check.sh [extra gpu_check.py options, e.g. --attention flex]
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-bench_results}
mkdir -p "$out"
python=${PYTHON:-python3}
"$python" -c "import torch, transformers; assert torch.cuda.is_available(), 'no CUDA device'" \
  || { echo "gpu_check: needs torch with CUDA and transformers under $python" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
timeout --signal=INT 470 "$python" benchmarks/gpu_check.py --json "$out/gpu_check.json" \
  --kernel-dir "$out/inductor_cache" "$@"
