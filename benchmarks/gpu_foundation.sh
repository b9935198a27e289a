#!/usr/bin/env bash
# Foundation benchmarks on a GPU host (H100/H200), vanilla SGLang against the `full` policy on the
# qwen1.5b shape: decode-step latency over batch x context, then end-to-end generation throughput
# and KV tokens in use. From the repo root, with SGLang and this project installed as README's
# "GPU" section says (the policy servers need sglang_ext's installed plugin entry point):
#   PYTHONPATH=/tmp/site:/tmp/ext bash benchmarks/gpu_foundation.sh
# Rows and plots go to ${OUT:-benchmarks/results}. The RESULTS.md section goes to
# benchmarks/RESULTS.md, or with $OUT set (the device machine) to $OUT/RESULTS.md, to be appended
# to benchmarks/RESULTS.md by hand. Engine logs go to ${LOG_DIR:-/tmp/sglang_ext-bench-logs}.
set -euo pipefail
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
results_md=${OUT:+$OUT/RESULTS.md}
common=(--shape qwen1.5b --policies vanilla,full --out-dir "$out"
        --results-md "${results_md:-benchmarks/RESULTS.md}" --log-dir "${LOG_DIR:-/tmp/sglang_ext-bench-logs}")
export PYTHONUNBUFFERED=1
# A checkout's sglang_ext lacks sglang_ext.policies (pyproject maps it from policies/), so the
# installed copy must win: the checkout comes after PYTHONPATH, and PYTHONSAFEPATH keeps python
# from putting the working directory first. The checkout then provides only `benchmarks`.
export PYTHONSAFEPATH=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"

"$python" -c "from benchmarks.harness import require_plugin_entry_point as r; r()"
"$python" -m benchmarks.e2e "${common[@]}" --requests 256 --input-len 1024 --output-len 512
"$python" -m benchmarks.decode_step "${common[@]}" --batch 1,16,64 --context 4096,16384 --output-len 32
echo "gpu_foundation: done in ${SECONDS}s"
