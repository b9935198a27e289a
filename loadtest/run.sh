#!/usr/bin/env bash
# Headless locust run against a server; writes CSVs (requests, TTFT and ITL entries, failures,
# history) and an HTML report under OUT_DIR.
#   HOST=http://127.0.0.1:30000 USERS=8 DURATION=2m bash loadtest/run.sh
set -euo pipefail
host=${HOST:-http://127.0.0.1:30000}
out=${OUT_DIR:-loadtest/results}
mkdir -p "$out"
"${LOCUST:-locust}" -f "$(dirname "$0")/locustfile.py" --headless --host "$host" \
  --users "${USERS:-8}" --spawn-rate "${SPAWN_RATE:-4}" --run-time "${DURATION:-2m}" \
  --csv "$out/locust" --csv-full-history --html "$out/locust.html" --only-summary
