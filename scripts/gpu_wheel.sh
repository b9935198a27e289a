#!/usr/bin/env bash
# Builds this project as a wheel into .gpu/ext, to carry to the offline GPU machine beside the
# SGLang bundle: installed there, its dist-info registers the sglang.srt.plugins entry point.
# pytest and its pure-python dependencies ride along (.gpu/ext/test), so the kernel tests can run
# compiled on the GPU, and locust with its dependencies (.gpu/ext/locust), for the load tests
# (scripts/gpu_install_ext.sh installs them), and py-spy (.gpu/ext/tools).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$root/.gpu/ext" && mkdir -p "$root/.gpu/ext/test"
python3 -m pip wheel -q --no-deps -w "$root/.gpu/ext" "$root" 2>&1 | { grep -v "is ignored" || true; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  -d "$root/.gpu/ext/test" pytest pluggy iniconfig pygments
locust=$(grep -E '^locust==' "$root/requirements/tools.txt")
python3 -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$root/.gpu/ext/locust" "$locust" 2>&1 | { grep -v "is ignored" || true; }
# py-spy: SGLang dumps a stuck server's process stacks with it when its health check fails
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_17_x86_64 --platform manylinux_2_5_x86_64 -d "$root/.gpu/ext/tools" \
  py-spy==0.4.3 2>&1 | { grep -v "is ignored" || true; }
ls "$root/.gpu/ext" "$root/.gpu/ext/test" "$root/.gpu/ext/tools"
