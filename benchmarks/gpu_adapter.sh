#!/usr/bin/env bash
# The decode step after the engine adapter (issue 14), on a GPU host: does any policy regress?
#   PYTHONPATH=/tmp/site:/tmp/ext bash benchmarks/gpu_adapter.sh now
#       this checkout: vanilla on fa3, flashinfer and triton (ratios against the fastest), and
#       delta, tidal, lethe, art
#   KV=real POLICIES=vanilla@fa3,...,lethe ...: prefill computed (Lethe)
#   OLD_TREE=DIR OLD_SITE=DIR bash benchmarks/gpu_adapter.sh before
#       the same points from another checkout (DIR holds its benchmarks/, OLD_SITE its installed
#       wheel): vanilla (triton), delta, tidal, art; compare each run's ratios to its triton
# Rows and the RESULTS.md section go to ${OUT:-benchmarks/results}.
set -euo pipefail
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
# KV=synthetic (default): the prompts' slots are filled without prefill, fast but unlike real
# attention; KV=real: prefill computes them (Lethe needs it: its lists start at the prefill).
points=(--shape qwen1.5b --batch "${BATCH:-1,32,64}" --context "${CONTEXT:-16384,32768}"
        --output-len 16 --log-dir "${LOG_DIR:-/tmp/sglang_ext-bench-logs}"
        --out-dir "$out" --results-md "${OUT:+$OUT/}RESULTS.md" ${EXTRA:-})
[[ ${KV:-synthetic} == synthetic ]] && points+=(--skip-prefill-compute)
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
case "${1:?now or before}" in
  now)
    export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
    "$python" -c "from benchmarks.harness import require_plugin_entry_point as r; r()"
    # NOW_FLAGS="" gives the engine flags of `before` (which cannot take these), for an A/B
    "$python" -m benchmarks.decode_step "${points[@]}" ${NOW_FLAGS---max-running-requests 64 --cuda-graph-max-bs 64} \
      --policies "${POLICIES:-vanilla@fa3,vanilla@flashinfer,vanilla@triton,delta,tidal,lethe,art}" ;;
  before)
    cd "${OLD_TREE:?a checkout with benchmarks/}"
    export PYTHONPATH="/tmp/site:${OLD_SITE:?its installed wheel}:$PWD"
    # the older decode_step takes neither --max-running-requests nor --cuda-graph-max-bs
    "$python" -m benchmarks.decode_step "${points[@]}" --policies "${POLICIES:-vanilla,delta,tidal,art}" ;;
esac
echo "gpu_adapter $1: done in ${SECONDS}s"
