"""The HTTP test tools (locust, schemathesis) that scripts/setup.sh installs into .venv-tools."""

import os
from pathlib import Path

TOOLS_BIN = Path(os.environ.get("SGLANG_EXT_TOOLS_VENV", Path(__file__).resolve().parents[1] / ".venv-tools")) / "bin"


def tool(name: str) -> str:
    path = TOOLS_BIN / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: run scripts/setup.sh (it installs requirements/tools.txt)")
    return str(path)
