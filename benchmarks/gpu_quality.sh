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
gguf=${GGUF:-/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf}
export SGLANG_EXT_MODEL_CACHE=${SGLANG_EXT_MODEL_CACHE:-/tmp/sglang_ext-models}
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"

"$python" - "$gguf" <<'PY'
import sys
from pathlib import Path
from sglang_ext import model
target = model.cache_dir() / model.MODEL_NAME
if not (target / "sglang_ext_converted.json").is_file():
    model.convert_gguf(Path(sys.argv[1]), target)
print("model:", model.default_model_path())
PY
"$python" -m benchmarks.quality --out-dir "$out" --results-md "${results_md:-benchmarks/RESULTS.md}" \
  --log-dir "$logs" --dtype bfloat16 --server-args=--disable-prefill-cuda-graph \
  --policies ${POLICIES:-full,delta,tidal} --budgets ${BUDGETS:-256,512,1024} \
  ${corrections:+--correction-intervals $corrections} ${QUALITY_ARGS:-}
echo "gpu_quality: done in ${SECONDS}s"
