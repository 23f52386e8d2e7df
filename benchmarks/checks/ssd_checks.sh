#!/usr/bin/env bash
# The checks of the SSD-speed issue on the default pair: each row in a process of its own, every
# prompt warmed up before timing, torch's default threads, k=5, 128 new tokens, 8 prompts, inductor.
# Prints each table and writes JSON under ${OUT:-bench_results}/. Pass a check name to run only it:
#   bash benchmarks/checks/ssd_checks.sh [greedy|sampled|eager|batch4|batch16]
set -euo pipefail
if [[ "${1:-}" == "-h" || "${1:-}" == "--help" ]]; then sed -n '2,/^set /p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0; fi
cd "$(dirname "$0")/../.."
out=${OUT:-bench_results}
mkdir -p "$out"
saguaro=${SAGUARO:-.venv/bin/saguaro}
common=(--k 5 --max-new-tokens 128 --prompts 8)
run() {
  local name=$1; shift
  echo "== $name: saguaro bench $* =="
  "$saguaro" bench "${common[@]}" "$@" --json "$out/ssd_$name.json"
}
checks=${1:-greedy sampled eager batch4 batch16}
for check in $checks; do
  case $check in
    greedy) run greedy --modes ar,sd,ssd --backend inductor ;;
    sampled) run sampled --modes sd,ssd --backend inductor --temperature 1 ;;
    eager) run eager --modes sd,ssd,ssd-process --backend eager ;;
    batch4) run batch4 --modes sd,ssd --backend inductor --batch 4 ;;
    batch16) run batch16 --modes sd,ssd --backend inductor --batch 16 --prompts 16 ;;
    *) echo "unknown check $check: choose from greedy sampled eager batch4 batch16" >&2; exit 2 ;;
  esac
done
