#!/usr/bin/env bash
# DELTA and TidalDecode speed on a GPU host, against vanilla SGLang and `--policy full` in the same
# run (issue 3, "Speed"). From the repo root, with SGLang and this project installed as README's
# "GPU" section says:
#   PYTHONPATH=/tmp/site:/tmp/ext bash benchmarks/gpu_selection.sh kernels|decode|e2e|correction
# Outputs as benchmarks/gpu_foundation.sh: rows and plots in ${OUT:-benchmarks/results}, the
# RESULTS.md section in $OUT/RESULTS.md on the device machine.
set -euo pipefail
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
results_md=${OUT:+$OUT/RESULTS.md}
logs=${LOG_DIR:-/tmp/sglang_ext-bench-logs}
common=(--out-dir "$out" --results-md "${results_md:-benchmarks/RESULTS.md}" --log-dir "$logs")
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"

case "${1:?kernels, decode, e2e or correction}" in
  kernels)
    for shape in qwen1.5b llama8b; do
      "$python" -m benchmarks.kernel_bench --shape $shape "${common[@]}" \
        --batch 1,16,32,64 --context 4096,16384,32768
    done ;;
  decode)
    "$python" -c "from benchmarks.harness import require_plugin_entry_point as r; r()"
    "$python" -m benchmarks.decode_step --shape "${SHAPE:-qwen1.5b}" "${common[@]}" \
      --policies vanilla,full,delta,tidal --batch ${BATCH:-1,16,32,64} \
      --context ${CONTEXT:-4096,16384,32768} --output-len 16 --skip-prefill-compute ;;
  e2e)
    "$python" -c "from benchmarks.harness import require_plugin_entry_point as r; r()"
    "$python" -m benchmarks.e2e --shape qwen1.5b "${common[@]}" \
      --policies "${POLICIES:-vanilla,full,delta,tidal}" --requests 64 --input-len 1024 \
      --output-len "${OUTPUT_LEN:-16384}" ${CONTEXT_LENGTH:+--context-length $CONTEXT_LENGTH} ;;
  correction)
    # the cost of TidalDecode's cache correction: tidal with and without it, each against vanilla
    "$python" -c "from benchmarks.harness import require_plugin_entry_point as r; r()"
    for config in '{}' "{\"correction_interval\": ${INTERVAL:-8}}"; do
      "$python" -m benchmarks.e2e --shape qwen1.5b "${common[@]}" --policies vanilla,tidal \
        --policy-config "$config" --requests 64 --input-len 1024 --output-len "${OUTPUT_LEN:-4096}"
    done ;;
esac
echo "gpu_selection $1: done in ${SECONDS}s"
