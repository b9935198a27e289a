# Sourced by the GPU scripts that need SmolLM2's real weights, from the repo root, after the
# .gpu/smolA and .gpu/smolB parts put the GGUF into /tmp/models: converts it once into the model
# cache (GGUF overrides the file) and exports the environment the benchmarks run in.
gguf=${GGUF:-/tmp/models/SmolLM2-135M-Instruct.Q4_1.gguf}
export SGLANG_EXT_MODEL_CACHE=${SGLANG_EXT_MODEL_CACHE:-/tmp/sglang_ext-models}
source benchmarks/gpu_env.sh

"${PYTHON:-python3}" - "$gguf" <<'PY'
import sys
from pathlib import Path
from sglang_ext import model
target = model.cache_dir() / model.MODEL_NAME
if not (target / "sglang_ext_converted.json").is_file():
    model.convert_gguf(Path(sys.argv[1]), target)
print("model:", model.default_model_path())
PY
