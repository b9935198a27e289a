#!/usr/bin/env bash
# Lethe's memory and speed on a GPU host (issues 4 and 15): a fixed KV pool, 64 requests each
# generating OUTPUT_LEN tokens, vanilla SGLang on fa3, flashinfer and triton, and `--policy lethe`:
# completed throughput, retractions, peak and steady KV per request, the most requests running at
# once, and KV in use against generated tokens (the plot). From the repo root, with SGLang and
# this project installed as README's "GPU" section says:
#   PYTHONPATH=/tmp/site:/tmp/ext bash benchmarks/gpu_lethe.sh
# The servers may not fit one sitting (the device tool's 10-minute calls): POLICIES=vanilla@fa3,
# then vanilla@flashinfer, …, lethe, in calls one after another; each policy's measurement is kept
# in PARTIAL_DIR and every call reports all policies kept there, against the fastest vanilla.
# Measured 2026-11-24 (H100, OUTPUT_LEN=8192 MAX_TOTAL_TOKENS=131072): about 3 min a server.
# Outputs as benchmarks/gpu_foundation.sh (PARTIAL_DIR copied under $OUT when OUT is set).
# OUTPUT_LEN, MAX_TOTAL_TOKENS and REQUESTS override; the pool defaults to 16 tokens per generated
# one (262144 for 16k) and lethe runs at its defaults (evict_threshold 1024, max_kv_ratio 0.3).
set -euo pipefail
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
results_md=${OUT:+$OUT/RESULTS.md}
partial=${PARTIAL_DIR:-.gpu/e2e-partial}
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
output_len=${OUTPUT_LEN:-16384}

"$python" -c "from benchmarks.harness import require_plugin_entry_point as r; r()"
"$python" -m benchmarks.e2e --shape qwen1.5b --policies "${POLICIES:-vanilla@fa3,vanilla@flashinfer,vanilla@triton,lethe}" \
  --partial-dir "$partial" --out-dir "$out" --results-md "${results_md:-benchmarks/RESULTS.md}" \
  --log-dir "${LOG_DIR:-/tmp/sglang_ext-bench-logs}" \
  --requests "${REQUESTS:-64}" --input-len 1024 --output-len "$output_len" \
  --context-length $((output_len + 2048)) --max-total-tokens "${MAX_TOTAL_TOKENS:-$((output_len * 16))}"
if [[ -n "${OUT:-}" ]]; then
  mkdir -p "$OUT/partial" && cp "$partial"/*.json "$OUT/partial/"
  cp "${LOG_DIR:-/tmp/sglang_ext-bench-logs}"/e2e-qwen1.5b-*.log "$OUT/" 2>/dev/null || true
fi
echo "gpu_lethe: done in ${SECONDS}s"
