#!/usr/bin/env bash
# Lethe's memory and speed on a GPU host (issue 4, "Memory and speed"): a fixed KV pool, 64 requests
# generating 16k tokens each, vanilla SGLang, `--policy full` and `--policy lethe` in one run:
# completed throughput, retractions, peak and mean KV in use, the most requests running at once,
# and KV in use over time (the plot). From the repo root, with SGLang and this project installed as
# README's "GPU" section says:
#   PYTHONPATH=/tmp/site:/tmp/ext bash benchmarks/gpu_lethe.sh
# Outputs as benchmarks/gpu_foundation.sh. MAX_TOTAL_TOKENS, OUTPUT_LEN and REQUESTS override;
# lethe runs at its defaults (evict_threshold 1024, max_kv_ratio 0.3).
set -euo pipefail
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
results_md=${OUT:+$OUT/RESULTS.md}
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
output_len=${OUTPUT_LEN:-16384}

"$python" -c "from benchmarks.harness import require_plugin_entry_point as r; r()"
"$python" -m benchmarks.e2e --shape qwen1.5b --policies vanilla,full,lethe \
  --out-dir "$out" --results-md "${results_md:-benchmarks/RESULTS.md}" \
  --log-dir "${LOG_DIR:-/tmp/sglang_ext-bench-logs}" \
  --requests "${REQUESTS:-64}" --input-len 1024 --output-len "$output_len" \
  --context-length $((output_len + 2048)) --max-total-tokens "${MAX_TOTAL_TOKENS:-262144}"
echo "gpu_lethe: done in ${SECONDS}s"
