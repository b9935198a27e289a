"""Entry point of SGLang's ``sglang.srt.plugins`` group; SGLang runs it in every engine process.

Without a served policy (``SGLANG_EXT_POLICY`` unset: a plain ``sglang.launch_server`` with this
package installed) it does nothing at all. With one, it hands it to the engine adapter; a policy
that does not build, or an SGLang that lacks what the adapter hooks, stops the process (SGLang
only logs a plugin's exception, and would serve vanilla).
"""

from __future__ import annotations


def register() -> None:
    from sglang_ext.config import active_policy
    from sglang_ext.policies import PolicyConfigError

    try:
        policy = active_policy()
    except PolicyConfigError as err:  # SGLang would log it and serve vanilla
        raise SystemExit(f"sglang_ext: the served policy does not build here: {err}") from None
    if policy is None:
        return
    from sglang_ext import engine

    try:
        engine.install(policy)
    except engine.EngineAdapterError as err:
        raise SystemExit(f"sglang_ext: {err}") from None
