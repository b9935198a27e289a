#!/usr/bin/env bash
# ART's decode kernel on a GPU host (issue 5, "Measurements"): against SGLang's triton decode
# kernel on qwen1.5b shapes (the detector's cost: patience 0 vs our kernel without it) and on
# SmolLM2's real attention inputs (tiles read, error, layer time). From the repo root, after the
# .gpu/smolA and .gpu/smolB parts put the GGUF into /tmp/models:
#   PYTHONPATH=/tmp/site:/tmp/ext bash benchmarks/gpu_art.sh
# Outputs as benchmarks/gpu_selection.sh.
set -euo pipefail
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
results_md=${OUT:+$OUT/RESULTS.md}
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
PY
"$python" -m benchmarks.art_kernel --shape qwen1.5b --batch 1,16,64 --context 4096,16384,32768 \
  --out-dir "$out" --results-md "${results_md:-benchmarks/RESULTS.md}"
"$python" -m benchmarks.art_kernel --shape smol --captured --lengths ${LENGTHS:-4096,7500} \
  --batch 1,16,64 --out-dir "$out" --results-md "${results_md:-benchmarks/RESULTS.md}"
echo "gpu_art: done in ${SECONDS}s"
