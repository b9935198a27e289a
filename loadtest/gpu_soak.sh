#!/usr/bin/env bash
# The mixed-policy soak (loadtest.soak) on a GPU host with SmolLM2's real weights, from the repo root
# after .gpu/part1, part2, ext (locust, py-spy), fa3a-d and smolA/smolB are installed. The soak
# outlasts a device call (10 minutes at most), so it runs in two calls back to back:
#   PYTHONPATH=/tmp/site:/tmp/ext bash loadtest/gpu_soak.sh start   # builds the sampling kernels,
#       starts the soak in its own session, follows it until the call's end is near
#   PYTHONPATH=/tmp/site:/tmp/ext bash loadtest/gpu_soak.sh wait    # until it ends; results to $OUT
# If the server stops answering, py-spy's stack dumps of every SGLang process go beside its log.
# DURATION, USERS, PROMPT_WORDS, MAX_TOKENS and SERVER_ARGS override the defaults below.
set -euo pipefail
source benchmarks/gpu_smol_model.sh
dir=/tmp/soak-gpu
follow() {  # until the soak ends or $1 seconds pass; every 60 s a line of its log and /health
  local until=$((SECONDS + $1)) ticks=0
  while pgrep -f "loadtest[.]soak" >/dev/null && ((SECONDS < until)); do
    sleep 10
    (( ++ticks % 6 == 0 )) || continue
    if [[ -f $dir/server_url ]] && ! "${PYTHON:-python3}" -c \
        "import sys, urllib.request; urllib.request.urlopen(sys.argv[1] + '/health', timeout=20)" \
        "$(cat "$dir/server_url")" 2>/dev/null && [[ -f $dir/server_url ]]; then  # not stopping
      echo "soak: /health did not answer in 20 s at ${SECONDS}s: stack dumps to $dir/stacks.txt"
      for pid in $(pgrep -f "sglang"); do py-spy dump --pid "$pid" >> "$dir/stacks.txt" 2>&1 || true; done
    fi
    echo "soak at ${SECONDS}s: $(cat "$dir/server.log" 2>/dev/null | grep -c 'Decode batch') decode logs"
  done
}
case "${1:-}" in
  start)
    rm -rf "$dir" && mkdir -p "$dir"
    "${PYTHON:-python3}" -c "from sglang_ext.engine import kernel_warmup as k; k.build_sampling_kernels('flashinfer')"
    setsid nohup "${PYTHON:-python3}" -m loadtest.soak --duration "${DURATION:-10m}" \
      --users "${USERS:-32}" --prompt-words "${PROMPT_WORDS:-256,2048}" \
      --max-tokens "${MAX_TOKENS:-64,512}" --locust /tmp/locust/bin/locust --out-dir "$dir" \
      --results-md "$dir/RESULTS.md" -- --cuda-graph-max-bs 64 ${SERVER_ARGS:-} \
      > "$dir/soak.log" 2>&1 < /dev/null &
    follow $((560 - SECONDS)) ;;
  wait)
    follow 560
    if pgrep -f "loadtest[.]soak" >/dev/null; then echo "soak: still running" >&2; exit 1; fi
    tail -n 40 "$dir/soak.log"
    # a device call brings back at most 8 files: these
    mkdir -p "${OUT:-/tmp/out}/soak-gpu"
    for f in summary.json RESULTS.md locust_stats.csv server.log soak.log stacks.txt; do
      if [[ -f $dir/$f ]]; then cp "$dir/$f" "${OUT:-/tmp/out}/soak-gpu/"; fi
    done ;;
  *) echo "usage: $0 start|wait" >&2; exit 2 ;;
esac
