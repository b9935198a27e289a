#!/usr/bin/env bash
# Policies on two GPUs (issue 19): end-to-end throughput under SGLang's tensor parallelism
# (--tp-size 2) and its data-parallel controller (--dp-size 2) against vanilla on each backend in
# the same phase, and each policy's greedy tokens against its own run on one GPU (the same
# prompts; vanilla's own match is the floor: two ranks sum a layer's output in another order).
# From the repo root of a 2-GPU host, one phase per device call, in this order:
#   PYTHONPATH=/tmp/site:/tmp/ext bash benchmarks/gpu_parallel.sh one|tp2|dp2
# Each policy's measurement is kept in PARTIAL_DIR (carry it from call to call); the tp2 and dp2
# phases report against the one-GPU runs found there. POLICIES, REQUESTS, INPUT_LEN and
# OUTPUT_LEN override. Outputs as benchmarks/gpu_lethe.sh.
set -euo pipefail
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
results_md=${OUT:+$OUT/RESULTS.md}
partial=${PARTIAL_DIR:-.gpu/parallel-partial}
logs=${LOG_DIR:-/tmp/sglang_ext-bench-logs/${1:-}}
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
case "${1:-}" in
  one) sizes=() default=vanilla@fa3,lethe,delta,tidal,art ;;
  tp2) sizes=(--tp 2) default=vanilla@fa3,vanilla@flashinfer,lethe,delta,tidal,art ;;
  dp2) sizes=(--dp 2) default=vanilla@fa3,vanilla@flashinfer,lethe,delta,tidal ;;
  *) echo "usage: $0 one|tp2|dp2" >&2; exit 2 ;;
esac
input_len=${INPUT_LEN:-8192} output_len=${OUTPUT_LEN:-1024}

"$python" -c "from benchmarks.harness import require_plugin_entry_point as r; r()"
"$python" -m benchmarks.e2e --shape qwen1.5b "${sizes[@]}" --policies "${POLICIES:-$default}" \
  --partial-dir "$partial" --out-dir "$out" --results-md "${results_md:-benchmarks/RESULTS.md}" \
  --log-dir "$logs" --requests "${REQUESTS:-32}" --input-len "$input_len" \
  --output-len "$output_len" --context-length $((input_len + output_len + 1024)) \
  --cuda-graph-max-bs "${REQUESTS:-32}"
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT/partial"
  [[ "$partial" -ef "$OUT/partial" ]] || cp "$partial"/*.json "$OUT/partial/"
  cp "$logs"/e2e-qwen1.5b-*.log "$OUT/" 2>/dev/null || true
fi
echo "gpu_parallel: $1 done in ${SECONDS}s"
