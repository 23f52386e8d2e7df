#!/usr/bin/env bash
# The default-pair benchmark grid the SSD and compiler issues check: batch 1 and 4, temperature 0
# and 1, 128 new tokens, 8 held-out prompts; plus eager vs inductor at batch 1, greedy.
# Each run prints its table and writes JSON under ${OUT:-bench_results}/. Takes about 15 minutes on
# a 2-core CPU. Usage: bash benchmarks/checks/default_pair_checks.sh
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
cd "$(dirname "$0")/../.."
out=${OUT:-bench_results}
mkdir -p "$out"
saguaro=${SAGUARO:-.venv/bin/saguaro}
for batch in 1 4; do
  for temperature in 0 1; do
    echo "== batch $batch, temperature $temperature =="
    "$saguaro" bench --batch "$batch" --temperature "$temperature" --max-new-tokens 128 --prompts 8 \
      --json "$out/b${batch}_t${temperature}.json"
  done
done
echo "== eager vs inductor, batch 1, greedy =="
"$saguaro" bench --backend both --modes ar,sd,ssd,ssd-process --max-new-tokens 128 --prompts 8 --threads 1 \
  --json "$out/backends.json"
