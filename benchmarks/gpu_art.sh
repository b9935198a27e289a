#!/usr/bin/env bash
# ART on a GPU host (issue 5): the kernel tests compiled, the kernel against SGLang's triton decode
# kernel, decode-step time (TPOT) in the engine, and quality against the base policies. From the
# repo root, with SGLang and this project installed (scripts/gpu_install_ext.sh) and, for
# `kernels` and `quality`, the .gpu/smolA and .gpu/smolB parts' GGUF in /tmp/models:
#   PYTHONPATH=/tmp/site:/tmp/ext bash benchmarks/gpu_art.sh tests|kernels|decode|quality|tpot
# - kernels: random qwen1.5b-shaped inputs (softmax over random keys is flat, so these rows
#   measure the detector's cost, art-p0 against our kernel without it), then SmolLM2's real
#   attention inputs with ART's defaults and with ART_LOOSE (a looser setting, for the trade-off).
# - tpot: end to end on SmolLM2's real weights (prefill computed, natural-text prompts from
#   SEEDS_DIR, default .gpu/seeds where carried): each of POLICIES with CONFIG, every policy saved
#   under PARTIAL and all reported (so a run can be split over calls on one host).
# Outputs as benchmarks/gpu_selection.sh.
set -euo pipefail
python=${PYTHON:-python3}
out=${OUT:-benchmarks/results}
results_md=${OUT:+$OUT/RESULTS.md}
logs=${LOG_DIR:-/tmp/sglang_ext-bench-logs}
common=(--out-dir "$out" --results-md "${results_md:-benchmarks/RESULTS.md}")
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"

case "${1:?tests, kernels, decode or quality}" in
  tests)
    "$python" -m pytest -q -p no:cacheprovider -m "not engine" tests/test_kernels_art.py tests/test_kernels_page_select.py \
      tests/test_policy_art.py tests/test_kernels_sparse_decode.py tests/test_kernels_selection.py ;;
  kernels)
    source benchmarks/gpu_smol_model.sh
    "$python" -m benchmarks.art_kernel --shape qwen1.5b --batch 1,16,64 --context 4096,16384,32768 "${common[@]}"
    for config in '{}' "${ART_LOOSE:-{\"tau\": 1e-3, \"phi\": 1e-2, \"patience\": 2\}}"; do
      "$python" -m benchmarks.art_kernel --shape smol --captured --lengths ${LENGTHS:-4096,7500} \
        --batch 1,16,64 --policy-config "$config" "${common[@]}"
    done ;;
  decode)
    "$python" -c "from benchmarks.harness import require_plugin_entry_point as r; r()"
    "$python" -m benchmarks.decode_step --shape qwen1.5b "${common[@]}" --log-dir "$logs" \
      --policies vanilla,full,art --batch ${BATCH:-1,16,64} --context ${CONTEXT:-4096,16384} \
      --output-len 16 --skip-prefill-compute ;;
  quality)
    source benchmarks/gpu_smol_model.sh
    "$python" -m benchmarks.quality "${common[@]}" --log-dir "$logs" --dtype bfloat16 \
      --server-args=--disable-prefill-cuda-graph --policies ${POLICIES:-full,art,delta,delta+art} \
      --budgets ${BUDGETS:-512} ${QUALITY_ARGS:-} ;;
  tpot)
    source benchmarks/gpu_smol_model.sh
    seeds=${SEEDS_DIR:-.gpu/seeds}
    "$python" -m benchmarks.e2e --shape smol --real-weights ${seeds:+--seeds-dir "$seeds"} \
      --requests ${REQUESTS:-64} --input-len ${INPUT_LEN:-7424} --output-len ${OUTPUT_LEN:-512} \
      --context-length 8192 --cuda-graph-max-bs ${REQUESTS:-64} \
      --policies ${POLICIES:-vanilla@fa3,delta,art,delta+art} \
      ${CONFIG:+--policy-config "$CONFIG"} --partial-dir "${PARTIAL:-$out/tpot}" \
      --log-dir "$logs" "${common[@]}" ;;
esac
echo "gpu_art $1: done in ${SECONDS}s"
