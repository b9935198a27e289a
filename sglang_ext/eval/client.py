"""The server, over HTTP: what it serves (``GET /policy``, ``/server_info``, ``/v1/models``), its
tokenizer (``/v1/tokenize``) and greedy generations (``/generate`` with token ids, the request's
policy in ``custom_params.kv_policy``, its report read back from ``meta_info``: docs/serving.md)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from statistics import fmean
from typing import Any

import requests

from sglang_ext.eval.tasks import split_frame


class ServerError(Exception):
    """A request the server did not answer: refused connection, timeout, an HTTP error."""


@dataclasses.dataclass(frozen=True)
class ServerFacts:
    """What a run records of the server it measured, and the lengths it can hold."""

    model: str  # the served model's name (its last path part)
    context_len: int  # the model's context (prompt and generated tokens)
    max_input_len: int  # SGLang's cap on a prompt (its scheduler's max_req_input_len)
    pool_tokens: int  # the KV pool: one request's prompt and output must fit in it
    attention_backend: str
    device: str
    sglang_version: str

    def __post_init__(self):
        if min(self.context_len, self.max_input_len, self.pool_tokens) < 1:
            raise ValueError(f"server limits must be positive: {self}")

    def max_prompt_len(self, max_new_tokens: int) -> int:
        """The longest prompt a request generating ``max_new_tokens`` may send."""
        room = min(self.context_len, self.pool_tokens) - max_new_tokens
        return min(self.max_input_len, room)


@dataclasses.dataclass(frozen=True)
class Generation:
    output_ids: list[int]
    text: str
    kv_policy: str | None  # the policy that decoded it, as the server reported (None: no report)
    retained_tokens: int | None  # KV tokens the request held at its end
    evicted_tokens: int | None
    attended_tokens: float | None  # per decode step, mean over steps and layers


@dataclasses.dataclass(frozen=True)
class Server:
    url: str
    api_key: str | None = None
    timeout_s: float = 600.0

    def __post_init__(self):
        if not self.url.startswith(("http://", "https://")):
            raise ValueError(f"expected an http(s):// URL, got {self.url!r}")
        if self.timeout_s <= 0:
            raise ValueError(f"timeout must be positive, got {self.timeout_s}")

    def _call(
        self, method: str, path: str, body: dict | None = None, timeout: float | None = None
    ) -> Any:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        try:
            response = requests.request(
                method, self.url.rstrip("/") + path, json=body, headers=headers,
                timeout=timeout or self.timeout_s,
            )  # fmt: skip
        except requests.ConnectionError:
            raise ServerError(f"{method} {path}: cannot connect to {self.url}") from None
        except requests.Timeout:
            waited = timeout or self.timeout_s
            raise ServerError(f"{method} {path}: no answer in {waited:g} s") from None
        except requests.RequestException as err:
            raise ServerError(f"{method} {path}: {type(err).__name__}: {err}") from None
        if response.status_code >= 400:
            detail = response.text[:300]
            raise ServerError(f"{method} {path}: HTTP {response.status_code}: {detail}")
        return response.json()

    def policy_info(self) -> dict | None:
        """``GET /policy``; None from a server without the extension's route (vanilla SGLang)."""
        try:
            return self._call("GET", "/policy", timeout=30)
        except ServerError as err:
            if "HTTP 404" in str(err):
                return None
            raise

    def facts(self) -> ServerFacts:
        info = self._call("GET", "/server_info", timeout=60)
        models = self._call("GET", "/v1/models", timeout=30)["data"]
        return ServerFacts(
            model=models[0]["id"].rstrip("/").rsplit("/", 1)[-1],  # a --model-path's folder name
            context_len=int(models[0]["max_model_len"]),
            max_input_len=int(info.get("max_req_input_len") or models[0]["max_model_len"]),
            pool_tokens=int(info.get("max_total_num_tokens") or models[0]["max_model_len"]),
            attention_backend=(
                info.get("decode_attention_backend") or info.get("attention_backend") or ""
            ),
            device=info.get("device") or "",
            sglang_version=info.get("version") or "",
        )  # fmt: skip

    def generate(
        self, input_ids: Sequence[int], kv_policy: dict | None, max_new_tokens: int
    ) -> Generation:
        """One greedy generation; ``kv_policy`` None sends no policy (a vanilla server's)."""
        sampling: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": 0}
        if kv_policy is not None:
            sampling["custom_params"] = {"kv_policy": kv_policy}
        body = {"input_ids": list(input_ids), "sampling_params": sampling}
        out = self._call("POST", "/generate", body)
        meta = out["meta_info"]
        # per output token (server/report.py): the last entry is the request's end state
        attended = [a for a in meta.get("kv_attended_tokens") or [] if a is not None]
        return Generation(
            output_ids=list(out["output_ids"]),
            text=out["text"],
            kv_policy=(meta.get("kv_policy") or [None])[-1],
            retained_tokens=(meta.get("kv_retained_tokens") or [None])[-1],
            evicted_tokens=(meta.get("kv_evicted_tokens") or [None])[-1],
            attended_tokens=round(fmean(attended), 1) if attended else None,
        )

    def tokenize(self, texts: list[str], add_special_tokens: bool = False) -> list[list[int]]:
        body = {"prompt": texts, "add_special_tokens": add_special_tokens}
        return self._call("POST", "/v1/tokenize", body)["tokens"]

    def tokenize_chat(self, user: str) -> list[int]:
        """A one-message chat through the server's chat template, with the assistant's turn's
        start (SGLang renders it as its chat route would)."""
        body = {"messages": [{"role": "user", "content": user}]}
        return self._call("POST", "/v1/tokenize", body)["tokens"]


class ServerEncoder:
    """The server's own tokenizer and chat template (``tasks.Encoder``), through /v1/tokenize;
    texts seen before (repeated filler sentences, coded words) are not sent again."""

    BATCH = 512  # texts per tokenize call
    CACHE_LIMIT = 200_000  # texts remembered, about a 128k-token case's units many times over

    def __init__(self, server: Server):
        self.server = server
        self._ids: dict[str, list[int]] = {}
        self._frame: tuple[list[int], list[int]] | None = None
        self._lock = threading.Lock()

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        with self._lock:
            known = {t: self._ids[t] for t in set(texts) if t in self._ids}
        missing = list(dict.fromkeys(t for t in texts if t not in known))
        for start in range(0, len(missing), self.BATCH):
            chunk = missing[start : start + self.BATCH]
            known.update(zip(chunk, self.server.tokenize(chunk)))
        with self._lock:
            if len(self._ids) > self.CACHE_LIMIT:
                self._ids.clear()
            self._ids.update((t, known[t]) for t in missing)
        return [list(known[t]) for t in texts]

    def chat_frame(self) -> tuple[list[int], list[int]]:
        if self._frame is None:
            try:
                self._frame = split_frame(*(self.server.tokenize_chat(c) for c in ("A", "B")))
            except ServerError:  # a model without a chat template: plain text after its BOS
                self._frame = (self.server.tokenize([""], add_special_tokens=True)[0], [])
        return self._frame
