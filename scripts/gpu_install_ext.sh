#!/usr/bin/env bash
# Runs ON the GPU machine from the repo root: installs the carried .gpu/ext wheel and pytest into
# /tmp/ext (fresh every time, so a rebuilt wheel replaces the old one).
set -euo pipefail
rm -rf /tmp/ext
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/ext .gpu/ext/*.whl .gpu/ext/test/*.whl \
  2>&1 | { grep -v WARNING || true; }
# locust apart from SGLang's site (its pins are not SGLang's); /tmp/locust/bin/locust runs it
rm -rf /tmp/locust && mkdir -p /tmp/locust/bin
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/locust .gpu/ext/locust/*.whl \
  2>&1 | { grep -v WARNING || true; }
printf '#!/bin/sh\nPYTHONPATH=/tmp/locust exec python3 -m locust "$@"\n' > /tmp/locust/bin/locust
chmod +x /tmp/locust/bin/locust
# py-spy on the PATH of the servers started later: SGLang's crash diagnostics call `py-spy dump`
rm -rf /tmp/tools && python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/tools \
  .gpu/ext/tools/*.whl 2>&1 | { grep -v WARNING || true; }
ln -sf /tmp/tools/bin/py-spy /usr/local/bin/py-spy
echo "sglang_ext and pytest installed into /tmp/ext, locust into /tmp/locust, py-spy on the PATH"
