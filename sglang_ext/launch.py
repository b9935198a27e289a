"""``python -m sglang_ext.launch --policy NAME [any sglang server flag]``

Validates the policy before anything heavy starts (a bad flag exits 2 naming the flag, the field
and the valid choices), fills in the embedded model, 127.0.0.1 and the CPU engine's flags where
the user gave none, hands the policy to every engine process and runs SGLang's own HTTP server.
"""

from __future__ import annotations

import argparse
import os
import sys

from sglang_ext.config import export_policy, policy_from_flags
from sglang_ext.engine.backends import POLICY_BASES, default_cuda_backend
from sglang_ext.platform import cpu
from sglang_ext.policies import KVPolicy, PolicyConfigError, policy_names
from sglang_ext.server import validation

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
# SmolLM2-135M holds ~23 KB of KV per token; without a cap SGLang sizes the pool from host memory
# on CPU and spends a minute zero-filling gigabytes.
CPU_DEFAULT_MAX_TOTAL_TOKENS = 65536


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m sglang_ext.launch",
        description="Serve a model with SGLang and a sglang_ext KV-cache policy.",
        epilog="Every other flag goes to SGLang's server (python -m sglang.launch_server --help).",
    )
    parser.add_argument(
        "--policy", default="full",
        help=f"KV policy: {', '.join(policy_names())}; BASE+art; or several, A,B,...: each request "
        "names its own (custom_params.kv_policy.name), the first by default",
    )  # fmt: skip
    parser.add_argument(
        "--policy-config",
        default=None,
        metavar="JSON|@FILE",
        help="policy parameters as a JSON object, or @path to a JSON file; for several "
        'policies, each one\'s under its name: {"delta": {...}, "lethe": {...}}',
    )
    parser.add_argument(
        "--max-request-bytes",
        type=positive_int,
        default=validation.DEFAULT_MAX_REQUEST_BYTES,
        metavar="N",
        help="a request body over N bytes is answered 413 (default: 16 MiB)",
    )
    return parser


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def _has_flag(argv: list[str], *flags: str) -> bool:
    return any(arg == f or arg.startswith(f + "=") for arg in argv for f in flags)


def flag_value(argv: list[str], flag: str, default: str = "") -> str:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return default


def sglang_argv(argv: list[str], policy: KVPolicy | None = None) -> list[str]:
    """SGLang's flags with this project's and the policy's defaults added where the user gave
    none."""
    out = list(argv)
    for flag, value in (policy.server_defaults() if policy is not None else {}).items():
        if not _has_flag(out, flag):
            out += [flag] if value is None else [flag, value]
    if not _has_flag(out, "--model-path", "--model"):
        from sglang_ext.model import MODEL_NAME, default_model_path

        out += ["--model-path", str(default_model_path())]
        if not _has_flag(out, "--served-model-name"):
            out += ["--served-model-name", MODEL_NAME]  # not the cache folder's path
    if not _has_flag(out, "--host"):
        out += ["--host", DEFAULT_HOST]
    if cpu.is_cuda_host():
        defaults = {"--attention-backend": default_cuda_backend()}
    else:
        defaults = cpu.server_flags()
        if not _has_flag(out, "--mem-fraction-static"):
            defaults["--max-total-tokens"] = str(CPU_DEFAULT_MAX_TOTAL_TOKENS)
    return out + cpu.as_argv({f: v for f, v in defaults.items() if not _has_flag(out, f)})


def _check_engine_flags(parser: argparse.ArgumentParser, argv: list[str], policy: KVPolicy) -> None:
    """Flags under which a policy would silently not run (exit 2 naming the flag)."""
    backend = flag_value(argv, "--attention-backend", "")
    decode = flag_value(argv, "--decode-attention-backend", backend)
    if decode not in POLICY_BASES:
        parser.error(
            f"argument --attention-backend: sglang_ext policies decode through {decode!r}, "
            f"which they do not wrap (valid: {', '.join(POLICY_BASES)})"
        )
    prefill = flag_value(argv, "--prefill-attention-backend", backend)
    if prefill != decode:
        # SGLang then runs a hybrid backend around both, whose decode half our hooks cannot see
        parser.error(
            f"argument --prefill-attention-backend: {prefill!r} differs from the decode backend "
            f"{decode!r}; sglang_ext policies need one backend for both"
        )
    page_size = flag_value(argv, "--page-size", "1")
    if policy.evicts() and page_size != "1":
        parser.error(
            f"argument --page-size: {policy.name} frees single KV slots, so it needs --page-size 1, "
            f"got {page_size}"
        )


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    ours, rest = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    policy = _policy_or_exit(parser, ours)

    cpu.activate()
    argv_out = sglang_argv(rest, policy)
    _check_engine_flags(parser, argv_out, policy)
    export_policy(policy)

    from sglang.srt.plugins import load_plugins

    load_plugins()
    from sglang.launch_server import run_server

    from sglang_ext.engine import http

    http.install_app(policy, ours.max_request_bytes)
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    server_args = prepare_server_args(argv_out)
    print(
        f"sglang_ext: serving {server_args.model_path} with policy {policy.describe()} "
        f"at http://{server_args.host}:{server_args.port}",
        flush=True,
    )
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)


def _policy_or_exit(parser: argparse.ArgumentParser, ours: argparse.Namespace) -> KVPolicy:
    try:
        return policy_from_flags(ours.policy, ours.policy_config)
    except PolicyConfigError as err:
        if err.field == "policy":
            parser.error(f"argument --policy: {err.detail}")
        if err.field == "--policy-config":
            parser.error(f"argument --policy-config: {err.detail}")
        parser.error(f"argument --policy-config: field {err.field}: {err.detail}")


if __name__ == "__main__":
    main()
