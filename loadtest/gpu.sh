#!/usr/bin/env bash
# The load test on a GPU host: loadtest.compare with SmolLM2's real weights (the .gpu/smolA and
# .gpu/smolB parts' GGUF in /tmp/models, benchmarks/gpu_smol_model.sh), one server per policy,
# full first (the baseline), locust from scripts/gpu_install_ext.sh. From the repo root:
#   PYTHONPATH=/tmp/site:/tmp/ext bash loadtest/gpu.sh
# SERVER_ARGS adds flags to every server (e.g. "--dp-size 2" on a 2-GPU host).
# Writes under $OUT (or loadtest/results/gpu) and appends its section to $OUT/RESULTS.md.
set -euo pipefail
source benchmarks/gpu_smol_model.sh
out=${OUT:-loadtest/results}/loadtest-gpu
python3 -m loadtest.compare --policies "${POLICIES:-full,delta,art,lethe}" \
  --users "${USERS:-32}" --duration "${DURATION:-45s}" --prompt-words "${PROMPT_WORDS:-512,2048}" \
  --max-tokens "${MAX_TOKENS:-128}" --locust "${LOCUST:-/tmp/locust/bin/locust}" \
  --out-dir "$out" --results-md "${OUT:-benchmarks}/RESULTS.md" -- --enable-metrics ${SERVER_ARGS:-}
echo "loadtest/gpu.sh: done in ${SECONDS}s"
