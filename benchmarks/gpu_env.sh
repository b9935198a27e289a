# Sourced by the GPU scripts, from the repo root: the environment they run in (the installed
# sglang_ext with its plugin entry point first, benchmarks/ and tests/ from the checkout).
export PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1 PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$PWD"
