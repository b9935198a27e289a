#!/usr/bin/env bash
# The GPU test tier, in one call on a GPU host from the repo root (after .gpu/part1, part2 and ext
# are installed, and smolA/smolB for the engine): the kernels and policies against their torch
# references on CUDA, then the engine on CUDA with SmolLM2's real weights (tests/test_engine_gpu.py).
#   PYTHONPATH=/tmp/site:/tmp/ext bash benchmarks/gpu_tests.sh
#   bash benchmarks/gpu_tests.sh kernels|engine   (one half per call: each stays under a call's limit)
#   bash benchmarks/gpu_tests.sh parallel   (2 GPUs: --tp-size 2 and --dp-size 2 servers; skipped on 1)
#   bash benchmarks/gpu_tests.sh kernels tests/test_kernels_rasr.py …   (those files of a half only)
# On a fresh host run `kernels` first: it JIT-compiles FlashInfer's top-k once (about 2 min), and
# its sampling kernels, which every policy server builds at start-up; the engine half's six
# servers compiling them side by side on a cold host took longer than a call's 10 min.
# Give the engine half a call's whole 10 min: on 2026-11-25 it had not finished in 7 min (no result).
# JUnit XML goes to ${OUT:-/tmp}/gpu-tests[-PART].xml, the servers' logs under ${OUT:-/tmp}/pytest[-PART].
set -euo pipefail
# the kernel half reads no model: it runs on a host without the SmolLM2 parts
if [[ "${1:-all}" == kernels ]]; then source benchmarks/gpu_env.sh; else source benchmarks/gpu_smol_model.sh; fi
# the installed sglang_ext (its plugin entry point) wins over the checkout; tests/ from the checkout
kernels=(tests/test_kernels_*.py tests/test_policy_*.py tests/test_lethe_runtime.py tests/test_layer_memory.py)
case "${1:-all}" in
  kernels) tests=("${kernels[@]}")
    "${PYTHON:-python3}" -c "from sglang_ext.engine import kernel_warmup as k; k.build_sampling_kernels('flashinfer')" ;;
  engine) tests=(tests/test_engine_gpu.py) ;;
  parallel) tests=(tests/test_engine_gpu_parallel.py) ;;
  all) tests=("${kernels[@]}" tests/test_engine_gpu.py tests/test_engine_gpu_parallel.py) ;;
  *) echo "usage: $0 [kernels|engine|parallel|all]" >&2; exit 2 ;;
esac
if [[ $# -gt 1 ]]; then tests=("${@:2}"); fi
"${PYTHON:-python3}" -m pytest -q -ra -p no:cacheprovider --basetemp "${OUT:-/tmp}/pytest${1:+-$1}" \
  --junitxml "${OUT:-/tmp}/gpu-tests${1:+-$1}.xml" "${tests[@]}"
