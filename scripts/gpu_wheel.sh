#!/usr/bin/env bash
# Builds this project as a wheel into .gpu/ext, to carry to the offline GPU machine beside the
# SGLang bundle: installed there, its dist-info registers the sglang.srt.plugins entry point.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
rm -rf "$root/.gpu/ext" && mkdir -p "$root/.gpu/ext"
python3 -m pip wheel -q --no-deps -w "$root/.gpu/ext" "$root" 2>&1 | { grep -v "is ignored" || true; }
ls "$root/.gpu/ext"
