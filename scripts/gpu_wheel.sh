#!/usr/bin/env bash
# Builds this project as a wheel into .gpu/ext, to carry to the offline GPU machine beside the
# SGLang bundle: installed there, its dist-info registers the sglang.srt.plugins entry point.
# pytest and its pure-python dependencies ride along (.gpu/ext/test), so the kernel tests can run
# compiled on the GPU (scripts/gpu_install_ext.sh installs both).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$root/.gpu/ext" && mkdir -p "$root/.gpu/ext/test"
python3 -m pip wheel -q --no-deps -w "$root/.gpu/ext" "$root" 2>&1 | { grep -v "is ignored" || true; }
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  -d "$root/.gpu/ext/test" pytest pluggy iniconfig pygments
ls "$root/.gpu/ext" "$root/.gpu/ext/test"
