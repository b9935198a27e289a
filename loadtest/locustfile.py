"""Locust load test of an ``sglang_ext.launch`` server: streaming ``/generate`` and
``/v1/chat/completions``. Besides each request's own entry, the time to first token and every
inter-token gap are recorded as their own entries (``TTFT …``, ``ITL …``), so locust's tables and
CSVs report their percentiles.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:30000

The mix comes from the environment: LOADTEST_PROMPT_WORDS and LOADTEST_MAX_TOKENS (comma lists,
each request picks one of each at random), LOADTEST_CHAT_WEIGHT and LOADTEST_GENERATE_WEIGHT (task
weights, default 1 and 1), LOADTEST_API_KEY (sent as a bearer token when set),
LOADTEST_KV_POLICIES (a JSON list of ``custom_params.kv_policy`` values, one picked per request;
null: the server's policy), LOADTEST_ABORT_FRACTION (that fraction of /generate requests, each
user's first included, is aborted through ``POST /abort_request`` after its first tokens, on
purpose: recorded as ``ABORTED …``, not as a failure), LOADTEST_IGNORE_EOS=1 (every request generates its max tokens: fixed lengths,
for comparing servers), LOADTEST_TEMPERATURE (default 0.7).
"""

from __future__ import annotations

import json
import os
import random
import time
import uuid

from locust import FastHttpUser, between, task

FILLER = (
    "The lighthouse keeper wrote the date, the weather and the ships that passed in his log, "
    "as he had every evening for thirty years."
).split()


def _ints(name: str, default: str) -> list[int]:
    return [int(x) for x in os.environ.get(name, default).split(",")]


PROMPT_WORDS = _ints("LOADTEST_PROMPT_WORDS", "32,256")
MAX_TOKENS = _ints("LOADTEST_MAX_TOKENS", "16,64")
KV_POLICIES = json.loads(os.environ.get("LOADTEST_KV_POLICIES", "[null]"))
ABORT_FRACTION = float(os.environ.get("LOADTEST_ABORT_FRACTION", "0"))
ABORT_AFTER_TOKENS = 4
IGNORE_EOS = os.environ.get("LOADTEST_IGNORE_EOS") == "1"
TEMPERATURE = float(os.environ.get("LOADTEST_TEMPERATURE", "0.7"))


def with_policy(body: dict, params_key: str | None) -> dict:
    """``body`` with a kv_policy picked from LOADTEST_KV_POLICIES (under sampling_params for
    /generate, at the top for the OpenAI routes)."""
    spec = random.choice(KV_POLICIES)
    if spec is not None:
        target = body[params_key] if params_key else body
        target["custom_params"] = {"kv_policy": spec}
    return body


def prompt(words: int) -> str:
    return " ".join(FILLER[i % len(FILLER)] for i in range(words)) + " Summarise the log:"


class ServingUser(FastHttpUser):
    wait_time = between(0, 0.5)

    def on_start(self) -> None:
        key = os.environ.get("LOADTEST_API_KEY")
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self._abort_credit = 1.0 - ABORT_FRACTION  # the first /generate is aborted (see below)

    def _aborts_next(self) -> bool:
        """Every (1 / LOADTEST_ABORT_FRACTION)-th /generate of a user, its first included: the
        fraction over a long run, and aborts even in a short one (a coin per request left a
        one-minute run on a slow machine with none: 0.8^10)."""
        if ABORT_FRACTION <= 0:
            return False
        self._abort_credit += ABORT_FRACTION
        if self._abort_credit < 1.0 - 1e-9:
            return False
        self._abort_credit -= 1.0
        return True

    def _stream(self, name: str, url: str, body: dict, tokens_in) -> None:
        """POST a streaming request; report TTFT and inter-token latency under ``name``: an event
        carrying n new tokens n - 1 events after the last reports its gap / n, n times (events
        coalesce when the client reads slower than the server streams)."""
        start = last = time.perf_counter()
        tokens = 0
        abort_rid = body.get("rid")
        try:
            lines = self.client.iter_lines(url, method="POST", json=body, headers=self.headers, name=name)
            for line in lines:
                if abort_rid and tokens >= ABORT_AFTER_TOKENS:
                    # the server ends the stream with finish_reason "abort"; read on to its end
                    self.client.post("/abort_request", json={"rid": abort_rid}, headers=self.headers)
                    self._record(f"ABORTED {name}", (time.perf_counter() - start) * 1000)
                    abort_rid = None
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                new = tokens_in(json.loads(line[5:]), tokens)
                if new <= 0:
                    continue
                now = time.perf_counter()
                if tokens == 0:
                    self._record(f"TTFT {name}", (now - start) * 1000)
                    new -= 1
                for _ in range(new):
                    self._record(f"ITL {name}", (now - last) * 1000 / max(new, 1))
                last, tokens = now, tokens + new + (1 if tokens == 0 else 0)
        except Exception as err:  # the request's own entry has the failure; the stream ended
            self._record(f"TTFT {name}", (time.perf_counter() - start) * 1000, err)

    def _record(self, name: str, ms: float, exception: Exception | None = None) -> None:
        self.environment.events.request.fire(
            request_type="STREAM", name=name, response_time=ms, response_length=0,
            exception=exception, context={},
        )  # fmt: skip

    @task(int(os.environ.get("LOADTEST_GENERATE_WEIGHT", "1")))
    def generate(self) -> None:
        body = {
            "text": prompt(random.choice(PROMPT_WORDS)),
            "stream": True,
            "sampling_params": {
                "max_new_tokens": random.choice(MAX_TOKENS), "temperature": TEMPERATURE,
                "ignore_eos": IGNORE_EOS,
            },
        }  # fmt: skip
        with_policy(body, "sampling_params")
        if self._aborts_next():
            body["rid"] = uuid.uuid4().hex  # to abort it by id (POST /abort_request)
        def tokens_in(chunk: dict, seen: int) -> int:
            return chunk.get("meta_info", {}).get("completion_tokens", seen) - seen

        self._stream("/generate", "/generate", body, tokens_in)

    @task(int(os.environ.get("LOADTEST_CHAT_WEIGHT", "1")))
    def chat(self) -> None:
        body = {
            "model": "default",
            "messages": [{"role": "user", "content": prompt(random.choice(PROMPT_WORDS))}],
            "max_tokens": random.choice(MAX_TOKENS),
            "temperature": TEMPERATURE,
            "ignore_eos": IGNORE_EOS,
            "stream": True,
        }
        with_policy(body, None)

        def tokens_in(chunk: dict, seen: int) -> int:  # a content delta is one token
            choices = chunk.get("choices") or [{}]
            return int(bool(choices[0].get("delta", {}).get("content")))

        self._stream("/v1/chat/completions", "/v1/chat/completions", body, tokens_in)
