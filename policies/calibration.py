"""Per-model layer configurations written by ``python -m sglang_ext.tools.calibrate``.

A calibration file is JSON in ``sglang_ext/calibrations/`` (or the directory named by
$SGLANG_EXT_CALIBRATION_DIR), matched to a model by its architecture fingerprint:

    {"format": 1,
     "model": {<model_fingerprint(config)>},
     "delta": {"full_layers": [...], "delta_layers": [...]},
     "tidal": {"full_layers": [...], "selection_layers": [...]},
     "measurements": {...}, "source": {...}}

A policy takes its layer lists from the file when the user leaves them unset; explicit values win.
"""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from pathlib import Path
from typing import Any

CALIBRATION_DIR_ENV = "SGLANG_EXT_CALIBRATION_DIR"
FORMAT = 1
_FINGERPRINT_KEYS = (
    "num_hidden_layers",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "vocab_size",
)


def model_fingerprint(hf_config: Any) -> dict[str, Any]:
    """What identifies a model's architecture: its class and shape (the same for real and dummy
    weights of one model)."""
    architectures = getattr(hf_config, "architectures", None) or ["unknown"]
    return {
        "architecture": architectures[0],
        **{key: getattr(hf_config, key, None) for key in _FINGERPRINT_KEYS},
    }


def calibration_dir() -> Path:
    override = os.environ.get(CALIBRATION_DIR_ENV)
    return Path(override) if override else Path(str(resources.files("sglang_ext") / "calibrations"))


def find_calibration(fingerprint: dict[str, Any]) -> dict[str, Any] | None:
    """The calibration file whose model matches ``fingerprint``, or None."""
    return _load_all(str(calibration_dir())).get(json.dumps(fingerprint, sort_keys=True))


@functools.lru_cache(maxsize=4)
def _load_all(directory: str) -> dict[str, dict[str, Any]]:
    found = {}
    for path in sorted(Path(directory).glob("*.json")):
        data = json.loads(path.read_text())
        if data.get("format") == FORMAT:
            found[json.dumps(data["model"], sort_keys=True)] = {**data, "path": str(path)}
    return found
