"""``python -m sglang_ext.eval``: tasks sized with SmolLM2's real tokenizer, scoring, results kept
and resumed, the command's refusals and a failing server (against a stand-in HTTP server), and
one end-to-end run against the real CPU engine (``engine``)."""

import collections
import dataclasses
import http.server
import json
import re
import subprocess
import sys
import threading
import time

import pytest
from row_schema import assert_rows_schema

from sglang_ext.eval import report, runner, scoring, store, tasks
from sglang_ext.eval.cli import length_list, main
from sglang_ext.eval.client import Generation, Server, ServerEncoder, ServerError, ServerFacts
from sglang_ext.eval.store import REFERENCE, Result, Settings, SettingsMismatch, Store


class HFEncoder:
    """tasks.Encoder on a local transformers tokenizer (the server's is ServerEncoder)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def encode(self, texts):
        return self.tokenizer(list(texts), add_special_tokens=False).input_ids

    def chat_frame(self):
        def render(content):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": content}], tokenize=False, add_generation_prompt=True
            )
            return self.tokenizer(text, add_special_tokens=False).input_ids

        return tasks.split_frame(render("A"), render("B"))


@pytest.fixture(scope="module")
def tokenizer(model_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_path)


@pytest.fixture(scope="module")
def encoder(tokenizer):
    return HFEncoder(tokenizer)


# --- tasks ------------------------------------------------------------------------------------


@pytest.mark.parametrize("length", [1024, 3000])
@pytest.mark.parametrize("task", list(tasks.TASKS))
def test_a_case_is_exactly_its_length_with_its_answers_in_it(encoder, tokenizer, task, length):
    case = tasks.build_case(encoder, task, length, index=0, seed=0)
    assert len(case.input_ids) == length and case.key == f"{task}/{length}/0"
    text = tokenizer.decode(case.input_ids)
    assert text.startswith("<|im_start|>system") and "<|im_start|>assistant\n" in text
    assert not text.endswith("<|im_end|>")  # it ends inside the answer, after RULER's prefix
    said = set(re.findall(r"[A-Za-z0-9]+", text))
    assert all(answer in said for answer in case.answers), case.answers


def test_the_same_seed_gives_the_same_case_and_others_differ(encoder):
    first = tasks.build_case(encoder, "multi_key", 1024, 0, 7)
    assert first == tasks.build_case(encoder, "multi_key", 1024, 0, 7)
    others = [tasks.build_case(encoder, "multi_key", 1024, i, s) for i, s in [(1, 7), (0, 8)]]
    assert all(other.input_ids != first.input_ids for other in others)
    assert len({c.answers for c in [first, *others]}) == 3


def test_a_variable_chain_appears_in_its_order(encoder, tokenizer):
    case = tasks.build_case(encoder, "variable_tracking", 2048, 0, 0)
    text = tokenizer.decode(case.input_ids)
    first, *rest = case.answers
    assert re.search(rf"VAR {first} = \d+\.", text)
    places = [text.index(f"VAR {b} = VAR {a}.") for a, b in zip(case.answers, rest)]
    assert places == sorted(places)


def test_the_frequent_words_answer_is_the_three_most_frequent_in_the_prompt(encoder, tokenizer):
    case = tasks.build_case(encoder, "frequent_words", 2048, 0, 0)
    counts = collections.Counter(re.findall(r"\b[a-z]{5}\b", tokenizer.decode(case.input_ids)))
    assert {word for word, _ in counts.most_common(3)} == set(case.answers)


@pytest.mark.parametrize("task", ["single_needle", "multi_key", "multi_value"])
def test_a_case_says_where_its_answers_needles_are(encoder, tokenizer, task):
    case = tasks.build_case(encoder, task, 2048, index=1, seed=0)
    assert len(case.answer_depths) == (4 if task == "multi_value" else 1)
    for depth in case.answer_depths:
        at = round(depth * case.length)
        needle = tokenizer.decode(case.input_ids[at : at + 40])
        assert any(answer in needle for answer in case.answers), (depth, needle)


def test_a_length_too_short_for_the_task_is_refused(encoder):
    with pytest.raises(ValueError, match="multi_query needs more than 100 tokens"):
        tasks.build_case(encoder, "multi_query", 100, 0, 0)


def test_the_chat_frame_is_what_two_renderings_share():
    assert tasks.split_frame([1, 2, 3, 9, 4, 5], [1, 2, 3, 7, 8, 4, 5]) == ([1, 2, 3], [4, 5])
    assert tasks.split_frame([9], [8]) == ([], [])


def test_lengths_parse_with_k_as_1024():
    assert length_list("4k, 8K,1536,4k") == [1536, 4096, 8192]
    for bad in ("4x", "k", "0", "-1k", ""):
        with pytest.raises(Exception, match="length"):
            length_list(bad)


# --- scoring ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answers, text, correct",
    [
        (["584417"], " 584417.", True),
        (["584417"], " **584417**, as stated", True),
        (["584417"], " 5844170", False),  # a longer number only contains it
        (["Osaka"], " osaka, in 1915", True),  # case aside
        (["Osaka"], " Osakan", False),
        (["1", "2"], "1 and 3", False),  # every answer, not some
        (["1", "2"], "2, then 1", True),  # in any order
        (["1"], "", False),
    ],
)
def test_an_answer_is_correct_when_every_expected_word_is_in_it(answers, text, correct):
    assert scoring.is_correct(answers, text) == correct


def test_agreement_counts_the_tokens_before_the_first_difference():
    assert scoring.agreed_tokens([1, 2, 3, 4], [1, 2, 9, 4]) == 2
    assert scoring.agreement([1, 2, 3, 4], [1, 2, 3, 4]) == 1.0
    assert scoring.agreement([1, 2, 9, 4], [1, 2, 3, 4]) == 0.5
    assert scoring.agreement([1, 2], [1, 2, 3, 4]) == 0.5  # stopping early falls short
    assert scoring.agreement([], []) == 1.0


# --- results kept and resumed -----------------------------------------------------------------

SETTINGS = Settings(seed=0, model="m", served_policy={"name": "lethe,full"}, reference="full",
                    max_new_tokens=None)  # fmt: skip


def _result(case="qa/1024/0", arm=REFERENCE, error=None, **fields) -> Result:
    task, length, _ = case.split("/")
    if error is None:
        fields = {"output_ids": (1, 2), "text": "x", "correct": True, **fields}
    return Result(case, task, int(length), arm, ("x",), 0.1, error=error, **fields)


def test_finished_results_are_kept_and_failed_ones_run_again(tmp_path):
    kept = Store(tmp_path, SETTINGS)
    kept.add(_result(arm=REFERENCE))
    kept.add(_result(arm="lethe", error="HTTP 500"))
    with open(tmp_path / store.RESULTS_FILE, "a") as out:
        out.write('{"case": "qa/1024/1", "ta')  # a run killed mid-line
    again = Store(tmp_path, SETTINGS)
    assert again.done("qa/1024/0", REFERENCE) and not again.done("qa/1024/0", "lethe")
    assert again.finished[("qa/1024/0", REFERENCE)] == _result(arm=REFERENCE)
    assert not again.failed  # a failure of an earlier run is retried, not reported


def test_a_folder_of_other_settings_is_refused(tmp_path):
    Store(tmp_path, SETTINGS)
    with pytest.raises(SettingsMismatch, match="seed 0 then, 1 now"):
        Store(tmp_path, dataclasses.replace(SETTINGS, seed=1))


def test_a_result_is_a_score_or_an_error():
    with pytest.raises(ValueError, match="not both"):
        Result("qa/1024/0", "qa", 1024, "lethe", ("x",), 0.1, correct=True, error="HTTP 500")


def test_the_table_says_where_a_policy_missed_what_the_reference_answered():
    facts = ServerFacts("m", 4096, 4090, 8192, "torch_native", "cpu", "0.5.17")
    info = report.RunInfo("u", facts, facts, "full", ("lethe", "tidal"), ("single_needle",),
                          (1024,), 2, 1, 0, "d", {})  # fmt: skip
    outcomes = report.Outcomes({
        (r.case, r.arm): r for r in [
            _result("single_needle/1024/0", REFERENCE, answer_depths=(0.25,)),
            _result("single_needle/1024/1", REFERENCE, answer_depths=(0.75,)),
            _result("single_needle/1024/0", "lethe", correct=False, answer_depths=(0.25,)),
            _result("single_needle/1024/1", "lethe", answer_depths=(0.75,)),
            _result("single_needle/1024/0", "tidal"),
            _result("single_needle/1024/1", "tidal"),
        ]
    }, {})  # fmt: skip
    table = report.markdown(outcomes, info)
    assert ("- `lethe`, single_needle at 1k: 0.50 against full's 1.00; missed 1 that full "
            "answered, answers at 25% of the prompt") in table  # fmt: skip
    assert "`tidal`" not in table  # it answered all that full did


class WordEncoder:
    """A stand-in tokenizer: a token per word."""

    def encode(self, texts):
        return [[10 + len(word) for word in text.split()] for text in texts]

    def chat_frame(self):
        return [1, 2], [3]


@dataclasses.dataclass
class FakeServer:
    failing: set
    calls: list = dataclasses.field(default_factory=list)

    def generate(self, input_ids, kv_policy, max_new_tokens):
        self.calls.append(kv_policy["name"])
        if kv_policy["name"] in self.failing:
            raise ServerError("POST /generate: HTTP 500: boom")
        return Generation([5, 6], " 7", kv_policy["name"], 9, 0, 8.0)


def test_a_failing_request_is_recorded_and_a_rerun_runs_only_what_is_missing(tmp_path):
    server = FakeServer(failing={"lethe"})
    arms = [runner.Arm("lethe", server, {"name": "lethe"}),
            runner.Arm(REFERENCE, server, {"name": "full"})]  # fmt: skip
    cases = [runner.CaseId("single_needle", 512, i) for i in range(3)]
    first = Store(tmp_path, SETTINGS)
    runner.run(WordEncoder(), cases, arms, first, 0, 2, 4)
    assert len(first.finished) == 3 and len(first.failed) == 3
    assert all("HTTP 500" in r.error for r in first.failed.values())
    server.failing.clear()
    server.calls.clear()
    again = Store(tmp_path, SETTINGS)
    runner.run(WordEncoder(), cases, arms, again, 0, 2, 4)
    assert server.calls == ["lethe"] * 3 and len(again.finished) == 6 and not again.failed


# --- the command against a stand-in server ----------------------------------------------------


class StandIn(http.server.ThreadingHTTPServer):
    """Answers the routes the command uses as a ``lethe,tidal,full`` server would (a token per
    word; every answer " 7"); ``failing`` policies get a 500, ``slow`` ones an answer after 2 s."""

    daemon_threads = True

    def __init__(self, policy_route=True):
        super().__init__(("127.0.0.1", 0), StandInHandler)
        self.policy_route, self.failing, self.slow, self.calls = policy_route, set(), set(), []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class StandInHandler(http.server.BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, body, status=200):
        data = json.dumps(body).encode()
        try:
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (its timeout)
            pass

    def do_GET(self):
        served = {"lethe": {"evict_threshold": 128}, "tidal": {}, "full": {}}
        routes = {
            "/server_info": {"max_req_input_len": 4090, "max_total_num_tokens": 8192,
                             "attention_backend": "torch_native", "device": "cpu",
                             "version": "0.5.17"},
            "/v1/models": {"data": [{"id": "stand-in", "max_model_len": 4096}]},
            "/policy": {"policy": {"name": "lethe,tidal,full", **served},
                        "per_request": {"policies": {name: [] for name in served}}},
        }  # fmt: skip
        if self.path == "/policy" and not self.server.policy_route:
            return self._answer({"detail": "Not Found"}, 404)
        self._answer(routes[self.path])

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["content-length"])))
        if self.path == "/v1/tokenize":
            if "messages" in body:
                content = _word_ids(body["messages"][0]["content"])
                return self._answer({"tokens": [1, 2, *content, 3]})
            return self._answer({"tokens": [_word_ids(text) for text in body["prompt"]]})
        name = body["sampling_params"].get("custom_params", {"kv_policy": {"name": "vanilla"}})
        name = name["kv_policy"]["name"]
        self.server.calls.append(name)
        if name in self.server.failing:
            return self._answer(json.loads(BOOM), 500)
        if name in self.server.slow:
            time.sleep(2)
        n = len(body["input_ids"])
        meta = {"prompt_tokens": n, "kv_policy": [name] * 2, "kv_retained_tokens": [n, n + 1],
                "kv_evicted_tokens": [0, 0], "kv_attended_tokens": [n / 2, n / 2]}  # fmt: skip
        self._answer({"text": " 7", "output_ids": [9, 7], "meta_info": meta})


BOOM = '{"error": {"message": "boom"}}'


def _word_ids(text: str) -> list[int]:
    return [100 + sum(map(ord, word)) % 900 for word in text.split()]


@pytest.fixture
def stand_in():
    server = StandIn()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()


def _run_command(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_ext.eval", *args], check=False,
                          capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--url", "http://127.0.0.1:1"], ["--url http://127.0.0.1:1", "cannot connect"]),
        (["--url", "x", "--tasks", "single_needle,nope"], ["--tasks", "unknown task 'nope'"]),
        (["--url", "x", "--lengths", "4x"], ["--lengths", "'4x' is not a length"]),
        (["--url", "x", "--concurrency", "0"], ["--concurrency", "at least 1"]),
        (["--lengths", "4k"], ["--url", "required"]),
    ],
)
def test_bad_input_exits_2_naming_the_flag(args, fragments):
    done = _run_command(*args)
    assert done.returncode == 2, done.stderr
    assert all(fragment in done.stderr for fragment in fragments), done.stderr


@pytest.mark.parametrize(
    "args, fragments",
    [
        (["--policies", "lethe,tova"], ["--policies", "'tova' is not served", "tidal, full"]),
        (["--lengths", "4k"], ["--lengths", "4096 tokens is more than the server holds", "4048"]),
        (["--lengths", "48"], ["--lengths", "needs more than 48 tokens"]),
    ],
)
def test_what_the_server_cannot_do_exits_2_naming_the_flag(stand_in, tmp_path, args, fragments):
    done = _run_command("--url", stand_in.url, "--out", str(tmp_path), *args)
    assert done.returncode == 2, done.stderr
    assert all(fragment in done.stderr for fragment in fragments), done.stderr
    assert not stand_in.calls  # refused before any generation


def test_a_vanilla_server_is_refused_as_url(tmp_path, capsys):
    server = StandIn(policy_route=False)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with pytest.raises(SystemExit) as exited:
            main(["--url", server.url, "--out", str(tmp_path)])
    finally:
        server.shutdown()
    assert exited.value.code == 2
    assert "serves no KV policy" in capsys.readouterr().err


def test_server_errors_mid_run_are_reported_and_a_rerun_retries_them(stand_in, tmp_path, capsys):
    stand_in.failing, stand_in.slow = {"lethe"}, {"tidal"}
    args = ["--url", stand_in.url, "--out", str(tmp_path), "--tasks", "single_needle,qa",
            "--lengths", "256,512", "--cases", "2", "--timeout", "0.5"]  # fmt: skip
    assert main(args) == 1  # finished, with failures
    err = capsys.readouterr().err
    assert "16 requests failed" in err and "[eval] 32/32 requests, 16 failed" in err
    lines = [json.loads(line) for line in (tmp_path / store.RESULTS_FILE).read_text().splitlines()]
    errors = collections.Counter((r["arm"], r["error"]) for r in lines)
    assert errors[("lethe", "ServerError: POST /generate: HTTP 500: " + BOOM)] == 8
    assert errors[("tidal", "ServerError: POST /generate: no answer in 0.5 s")] == 8
    assert errors[(REFERENCE, None)] == 8 and errors[("full", None)] == 8
    table = (tmp_path / report.TABLE_FILE).read_text()
    cells = "0.00 | no result · 2 failed | no result · 2 failed | 0.00 · 1.00 · 100% · 100%"
    assert f"| single_needle | 256 | {cells} |" in table
    rows = json.loads((tmp_path / report.ROWS_FILE).read_text())
    assert_rows_schema(rows, "eval", kv_sources={"real"})
    lethe = [r for r in rows if r["policy"] == "lethe"]
    assert all(r["value"] is None and "2 requests failed" in r["skipped"] for r in lethe
               if r["metric"] != "accuracy:all")  # fmt: skip

    stand_in.failing, stand_in.slow, stand_in.calls[:] = set(), set(), []
    assert main(args) == 0
    assert sorted(stand_in.calls) == ["lethe"] * 8 + ["tidal"] * 8  # only what had failed
    rows = json.loads((tmp_path / report.ROWS_FILE).read_text())
    assert_rows_schema(rows, "eval", kv_sources={"real"})
    by = {(r["policy"], r["context"], r["metric"]): r for r in rows}
    assert len(by) == len(rows) == 3 * 2 * (4 * 2 + 1)  # policies, lengths, metrics
    lethe = by[("lethe", 512, "kv_retained:qa")]
    assert lethe["value"] == lethe["baseline_value"] == 513 and lethe["ratio"] == 1.0
    accuracy = by[("full", 256, "accuracy:all")]  # " 7" answers nothing
    assert accuracy["value"] == accuracy["baseline_value"] == 0.0 and accuracy["ratio"] is None
    assert by[("lethe", 256, "agreement:qa")]["value"] == 1.0
    assert (tmp_path / report.PLOT_FILE).read_bytes().startswith(b"\x89PNG")


def test_a_vanilla_baseline_server_is_the_reference_when_given(stand_in, tmp_path):
    vanilla = StandIn(policy_route=False)
    threading.Thread(target=vanilla.serve_forever, daemon=True).start()
    try:
        code = main(["--url", stand_in.url, "--baseline-url", vanilla.url, "--policies",
                     "lethe", "--tasks", "qa", "--lengths", "300", "--cases", "2",
                     "--out", str(tmp_path)])  # fmt: skip
    finally:
        vanilla.shutdown()
    assert code == 0
    assert vanilla.calls == ["vanilla"] * 2 and stand_in.calls == ["lethe"] * 2
    table = (tmp_path / report.TABLE_FILE).read_text()
    assert "| task | length | vanilla (reference) | lethe |" in table
    assert_rows_schema(json.loads((tmp_path / report.ROWS_FILE).read_text()), "eval", {"real"})


# --- the real engine --------------------------------------------------------------------------


@pytest.mark.engine
def test_eval_runs_end_to_end_against_the_cpu_engine(model_path, strict_env, tmp_path, encoder):
    from server import policy_servers

    config = {"lethe": {"evict_threshold": 128, "max_kv_ratio": 0.5}}
    flags = ["--max-total-tokens", "8192", "--dtype", "float32"]
    with policy_servers(model_path, strict_env, tmp_path / "logs",
                        {"mix": ("tidal,lethe,full", config, flags)}) as servers:  # fmt: skip
        url = servers["mix"].url
        # the server's tokenizer and chat template build the case a local one does
        local = tasks.build_case(encoder, "qa", 1024, 0, 0)
        assert tasks.build_case(ServerEncoder(Server(url)), "qa", 1024, 0, 0) == local
        out = tmp_path / "eval"
        code = main(["--url", url, "--tasks", "single_needle,qa", "--lengths", "1k", "--cases", "1",
                     "--max-new-tokens", "8", "--concurrency", "1", "--out", str(out)])  # fmt: skip
    assert code == 0
    rows = json.loads((out / report.ROWS_FILE).read_text())
    assert_rows_schema(rows, "eval", kv_sources={"real"})
    by = {(r["policy"], r["metric"]): r for r in rows}
    for task in ("single_needle", "qa"):
        assert by[("full", f"agreement:{task}")]["value"] == 1.0  # full agrees with itself
        assert by[("full", f"accuracy:{task}")]["ratio"] in (1.0, None)
        # it evicted: it ran before tidal, whose prompt in the radix cache it could not have freed
        lethe = by[("lethe", f"kv_retained:{task}")]
        assert lethe["value"] < lethe["baseline_value"]
    assert by[("lethe", "kv_retained:qa")]["budget"].startswith("max_kv_ratio 0.5")
    table = (out / report.TABLE_FILE).read_text()
    assert "| task | length | full (reference) | tidal | lethe | full |" in table
    assert "| single_needle | 1k |" in table and "| qa | 1k |" in table
    assert (out / report.PLOT_FILE).read_bytes().startswith(b"\x89PNG")
    results = (out / store.RESULTS_FILE).read_text().splitlines()
    assert len(results) == 2 * 4  # cases, arms
