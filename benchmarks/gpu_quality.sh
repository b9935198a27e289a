#!/usr/bin/env bash
# Quality of DELTA and TidalDecode (with and without cache correction) against full attention on a
# GPU host with SmolLM2-135M-Instruct's real weights (issue 3, "Quality"); the CPU route takes hours.
# From the repo root, after the .gpu/smolA and .gpu/smolB parts put the GGUF into /tmp/models:
#   PYTHONPATH=/tmp/site:/tmp/ext bash benchmarks/gpu_quality.sh
# Outputs as benchmarks/gpu_selection.sh.
set -euo pipefail
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
results_md=${OUT:+$OUT/RESULTS.md}
logs=${LOG_DIR:-/tmp/sglang_ext-bench-logs}
corrections=${CORRECTION_INTERVALS-8}  # empty: no cache-correction runs
source benchmarks/gpu_smol_model.sh
"$python" -m benchmarks.quality --out-dir "$out" --results-md "${results_md:-benchmarks/RESULTS.md}" \
  --log-dir "$logs" --dtype bfloat16 --server-args=--disable-prefill-cuda-graph \
  --policies ${POLICIES:-full,delta,tidal} --budgets ${BUDGETS:-256,512,1024} \
  ${corrections:+--correction-intervals $corrections} ${QUALITY_ARGS:-}
echo "gpu_quality: done in ${SECONDS}s"
