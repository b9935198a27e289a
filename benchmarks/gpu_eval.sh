#!/usr/bin/env bash
# python -m sglang_ext.eval on a GPU host: one server of every policy at its defaults (and full
# attention, the reference) with SmolLM2-135M-Instruct's real weights, on the launcher's default
# backend (fa3 on Hopper). From the repo root, after the .gpu parts (part1, fa3z, fa3a-d, part2
# with the ext wheels, smolA, smolB):
#   PYTHONPATH=/tmp/site:/tmp/ext bash benchmarks/gpu_eval.sh
# Writes the eval's results.jsonl, rows.json, table.md, accuracy.png and the server's log under
# $OUT/eval (else ./eval-gpu). POLICIES: the served policies; POLICY_CONFIG: their --policy-config;
# EVAL_ARGS: more of the eval's flags.
set -euo pipefail
python=${PYTHON:-python3}
out=${OUT:+$OUT/eval}
out=${out:-eval-gpu}
port=${PORT:-31300}
mkdir -p "$out"
source benchmarks/gpu_smol_model.sh
setsid "$python" -m sglang_ext.launch --policy "${POLICIES:-lethe,snapkv,tova,h2o,delta,tidal,full}" \
  ${POLICY_CONFIG:+--policy-config "$POLICY_CONFIG"} \
  --port "$port" --sampling-backend pytorch --cuda-graph-max-bs 16 \
  > "$out/server.log" 2>&1 &
server=$!
trap 'kill -- "-$server" 2> /dev/null || true' EXIT
healthy="import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=5)"
until "$python" -c "$healthy" "http://127.0.0.1:$port/health" 2> /dev/null; do
  kill -0 "$server" 2> /dev/null || { tail -30 "$out/server.log"; exit 1; }
  sleep 2
done
echo "gpu_eval: server up after ${SECONDS}s"
"$python" -m sglang_ext.eval --url "http://127.0.0.1:$port" --out "$out" ${EVAL_ARGS:-}
echo "gpu_eval: done in ${SECONDS}s"
