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
source benchmarks/gpu_smol_model.sh
"$python" -m benchmarks.art_kernel --shape qwen1.5b --batch 1,16,64 --context 4096,16384,32768 \
  --out-dir "$out" --results-md "${results_md:-benchmarks/RESULTS.md}"
"$python" -m benchmarks.art_kernel --shape smol --captured --lengths ${LENGTHS:-4096,7500} \
  --batch 1,16,64 --out-dir "$out" --results-md "${results_md:-benchmarks/RESULTS.md}"
echo "gpu_art: done in ${SECONDS}s"
