"""An OpenAI-compatible endpoint judge against servers that misbehave the way real ones do (in-process HTTP servers on
127.0.0.1): a body trickled byte by byte cannot hold a request past its timeout; 429 with Retry-After is waited out
(within max_retry_wait) and, when it never ends, said to be rate limiting; the whole judging has a deadline; a key
with a trailing CR is refused naming its variable, never its value; `align validate` refuses a model the endpoint
does not serve and a base_url that already names an endpoint path."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from conftest import REPO

KEY = "sk-test-0123456789abcdef"
ANSWER = {"object": "chat.completion", "choices": [{"index": 0, "message": {"role": "assistant", "content": "A"}}]}


def serve(behaviour):
    """A server whose POST handler is `behaviour(handler, state)`; GET /v1/models lists `judge`."""
    state = {"posts": 0, "times": []}

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            body = json.dumps({"object": "list", "data": [{"id": "judge", "object": "model"}]}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_POST(self):
            raw = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            try:
                self.body = json.loads(raw)  # what the client asked (a behaviour may answer by it)
            except ValueError:
                self.body = None
            state["posts"] += 1
            state["times"].append(time.monotonic())
            behaviour(self, state)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, state, f"http://127.0.0.1:{server.server_address[1]}/v1"


def send(handler, code: int, body: dict, headers: dict | None = None) -> None:
    data = json.dumps(body).encode()
    handler.send_response(code)
    for k, v in (headers or {}).items():
        handler.send_header(k, v)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    try:
        handler.wfile.write(data)
    except (BrokenPipeError, ConnectionResetError):  # the client gave up (a deadline under test): its traceback,
        pass  # printed by the server's thread, landed in whichever test of this worker ran next and failed it


def backend(url: str, **kw):
    from align.judges.endpoint import EndpointBackend

    args = dict(model="judge", key_env=None, max_new_tokens=4, timeout=2.0, retries=1, max_concurrency=2)
    return EndpointBackend(url, **{**args, **kw})


def test_a_trickled_answer_cannot_hold_a_request_past_its_timeout():
    def trickle(h, state):
        h.send_response(200)
        h.send_header("Content-Length", "1000")
        h.end_headers()
        try:
            for _ in range(60):  # 1 byte every 0.25 s: each read returns before the socket timeout
                h.wfile.write(b" ")
                h.wfile.flush()
                time.sleep(0.25)
        except (BrokenPipeError, ConnectionResetError):
            pass

    server, state, url = serve(trickle)
    from align.judges.endpoint import EndpointError

    t0 = time.monotonic()
    with pytest.raises(EndpointError, match=r"no answer after 2 attempts \(last: TimeoutError: the answer took longer "
                                            r"than timeout=1 s"):
        backend(url, timeout=1.0).ask("judge this")
    assert time.monotonic() - t0 < 6  # two attempts of ~1 s and a back-off, not 15 s of trickle each
    server.shutdown()


def test_429_with_retry_after_is_waited_out_and_named_when_it_never_ends():
    def limited_once(h, state):
        if state["posts"] == 1:
            return send(h, 429, {"error": "slow down"}, {"Retry-After": "2"})
        send(h, 200, ANSWER)

    server, state, url = serve(limited_once)
    assert backend(url).ask("judge this") == "A"
    assert state["posts"] == 2 and state["times"][1] - state["times"][0] >= 1.9  # the server's 2 s, not 0.5 s
    server.shutdown()

    server, state, url = serve(lambda h, s: send(h, 429, {"error": "slow down"}, {"Retry-After": "600"}))
    from align.judges.endpoint import EndpointError

    t0 = time.monotonic()
    with pytest.raises(EndpointError, match=r"rate limited \(HTTP 429 to 3 of 3 attempts.*max_retry_wait=1 s; last: "
                                            r"HTTP 429: the server says 'slow down'\); lower max_concurrency"):
        backend(url, retries=2, max_retry_wait=1.0).ask("judge this")
    assert 1.9 <= time.monotonic() - t0 < 5  # two waits of max_retry_wait, not 600 s
    server.shutdown()


def test_429_without_retry_after_backs_off_as_asked_in_milliseconds_or_longer_than_for_a_fault():
    """OpenAI and Azure send `retry-after-ms`, not Retry-After: it was ignored, and a 429 without either got the
    fault back-off (0.5, 1, 2 s: 3.5 s in all, then "rate limited", naming a Retry-After never sent)."""
    import random

    seed = 20261130
    print("seed", seed)
    random.seed(seed)

    def limited_once(header):
        def behaviour(h, state):
            if state["posts"] == 1:
                return send(h, 429, {"error": {"message": "Rate limit reached"}}, header)
            send(h, 200, ANSWER)
        return behaviour

    for header, least in (({"retry-after-ms": "1500"}, 1.45), ({}, 0.99)):  # no header: 2 s x U(0.5, 1), at least 1
        server, state, url = serve(limited_once(header))
        b = backend(url)
        assert b.ask("judge this") == "A" and b.served == []  # an answer naming no model: none recorded
        assert state["posts"] == 2 and state["times"][1] - state["times"][0] >= least, (header, state["times"])
        server.shutdown()


def test_a_request_the_endpoint_refuses_is_that_pairs_invalid_answer_and_a_refusal_of_every_one_ends_it(tmp_path):
    """One prompt a content filter refuses (HTTP 400) ended the whole judging, after every policy had sampled, and the
    server's reason was dropped; max_invalid_fraction never applied. It is that pair's invalid answer now, quoting
    the server, and not cached (a rerun asks again); a server that refuses every request (a parameter it does not
    take) ends the judging after REFUSED_EVERY of them, quoting it."""
    from align.config.settings import PairwiseJudge
    from align.judges.endpoint import REFUSED_EVERY, EndpointError, Refused
    from align.judges.pairwise import JudgeCache, PairwiseLLMJudge, parse_verdict

    filtered = {"error": {"message": "The response was filtered due to the prompt triggering content management"}}

    def some(h, state):
        return send(h, 400, filtered) if state["posts"] % 2 == 0 else send(h, 200, {**ANSWER, "model": "judge-2026-11-30"})

    server, state, url = serve(some)
    judge = PairwiseLLMJudge(PairwiseJudge(name="j", model="judge", base_url=url), backend(url, max_concurrency=1),
                             "{prompt}|{response_a}|{response_b}", JudgeCache(tmp_path / "cache.jsonl"))
    answers = judge.raw_answers(["p1", "p2", "p3", "p4"], ["a"] * 4, ["b"] * 4)
    refused = [a for a in answers if isinstance(a, Refused)]
    assert len(refused) == 2 and all(parse_verdict(a) is None and "filtered due to the prompt" in a for a in refused)
    assert sorted(a for a in answers if not isinstance(a, Refused)) == ["A", "A"]
    assert judge.backend.served == ["judge-2026-11-30"]  # the snapshot the alias named, as the endpoint said
    assert len(JudgeCache(tmp_path / "cache.jsonl").answers) == 2  # the refused ones are asked again by a rerun
    server.shutdown()

    unsupported = {"error": {"message": "Unsupported parameter: 'max_tokens'. Use 'max_completion_tokens' instead."}}
    server, state, url = serve(lambda h, s: send(h, 400, unsupported))
    with pytest.raises(EndpointError, match=rf"refused each of the first {REFUSED_EVERY} requests \(HTTP 400: the "
                                            r"server says \"Unsupported parameter: 'max_tokens'"):
        backend(url, max_concurrency=1).answers(["q"] * 40)
    assert REFUSED_EVERY <= state["posts"] <= REFUSED_EVERY + 1  # (+1: the request in flight as it ended)
    server.shutdown()

    # a rerun: its answers cached, the refused (never cached) asked first again, all refused: not "a setting"
    server, state, url = serve(lambda h, s: send(h, 400, filtered))
    cache = JudgeCache(tmp_path / "rerun.jsonl")
    judge = PairwiseLLMJudge(PairwiseJudge(name="j", model="judge", base_url=url), backend(url, max_concurrency=1),
                             "{prompt}|{response_a}|{response_b}", cache)
    cache.put({judge.key("answered", "a", "b"): "A"})
    prompts = ["answered", *(f"filtered {i}" for i in range(REFUSED_EVERY + 4))]
    answers = judge.raw_answers(prompts, ["a"] * len(prompts), ["b"] * len(prompts))
    assert answers[0] == "A" and all(isinstance(a, Refused) for a in answers[1:])
    server.shutdown()


def test_prompts_longer_than_the_judges_context_are_invalid_answers_not_a_refused_setting(tmp_path):
    """The stage judges the longest prompts first (length-sorted batches); a judge served with a shorter context than
    the policy's (vLLM --max-model-len) refuses those at once with HTTP 400, and REFUSED_EVERY of them came back
    before any slow answer: "a setting the server does not take", after all the sampling, the same on every rerun.
    A refusal as too long for the context (413, or a message saying so) is that pair's invalid answer and never
    counts towards that stop; when such answers pass max_invalid_fraction, the error says what to change."""
    from align.config.settings import PairwiseJudge
    from align.judges.endpoint import TOO_LONG, Refused, too_long
    from align.judges.pairwise import InvalidVerdicts, JudgeCache, PairwiseLLMJudge, check_invalid

    vllm = {"error": {"message": "This model's maximum context length is 8192 tokens. However, you requested 9000 "
                                 "tokens (8990 in the messages, 10 in the completion)."}}

    def by_length(h, state):
        if len(h.body["messages"][0]["content"]) > 200:
            return send(h, 400, vllm)
        time.sleep(0.05)  # a real answer takes time: the refusals come back first
        return send(h, 200, ANSWER)

    server, state, url = serve(by_length)
    prompts = [f"{i} " + "long " * 60 for i in range(20)] + [f"short {i}" for i in range(30)]  # longest first
    judge = PairwiseLLMJudge(PairwiseJudge(name="j", model="judge", base_url=url), backend(url, max_concurrency=4),
                             "{prompt}|{response_a}|{response_b}", JudgeCache(tmp_path / "cache.jsonl"), chunk=4)
    results = judge.compare(prompts, ["a"] * 50, ["b"] * 50)
    server.shutdown()
    assert [r["outcome"] == "invalid" for r in results] == [True] * 20 + [False] * 30
    assert all(isinstance(a, Refused) and TOO_LONG in a for r in results[:20] for a in r["answers"])
    with pytest.raises(InvalidVerdicts, match=r"20 of them were longer than the judge's context: use or serve a "
                                              r"judge with a longer context \(vLLM --max-model-len\)"):
        check_invalid(results, PairwiseJudge(name="j", model="judge", base_url=url), "prefs", "prompts", show=False)
    assert too_long(413, "") and not too_long(400, "HTTP 400: the server says 'Unsupported parameter: max_tokens'")
    # the judge's own max_new_tokens over its context: every request refused, a setting (REFUSED_EVERY ends it)
    over = "This model's maximum context length is 4096 tokens. However, you requested 4106 tokens"
    assert too_long(400, over, max_new_tokens=8) and not too_long(400, over, max_new_tokens=4096)


def test_the_whole_judging_has_a_deadline():
    def slow(h, state):
        time.sleep(0.6)
        send(h, 200, ANSWER)

    server, state, url = serve(slow)
    from align.judges.endpoint import EndpointError

    b = backend(url, max_concurrency=1, deadline=1.0)
    with pytest.raises(EndpointError, match=r"the judging took longer than deadline=1 s"):
        b.answers(["q"] * 10)
    assert state["posts"] < 10
    server.shutdown()


def test_a_key_with_a_carriage_return_is_refused_without_its_value(monkeypatch):
    from align.config.settings import PairwiseJudge
    from align.judges.endpoint import EndpointError

    monkeypatch.setenv("JUDGE_KEY", KEY + "\r")
    with pytest.raises(EndpointError) as err:
        backend("http://127.0.0.1:9/v1", key_env="JUDGE_KEY")
    assert "JUDGE_KEY holds whitespace, control or non-ASCII characters" in str(err.value) and KEY not in str(err.value)
    with pytest.raises(ValueError) as err:
        PairwiseJudge(name="j", model="judge", base_url="http://127.0.0.1:9/v1", key_env="JUDGE_KEY").check("pairwise[0]", None)
    assert "pairwise[0].key_env: the value of JUDGE_KEY holds whitespace" in str(err.value) and KEY not in str(err.value)


def test_validate_refuses_a_model_the_endpoint_does_not_serve_and_an_endpoint_path(monkeypatch):
    from align.config.settings import PairwiseJudge

    server, _, url = serve(lambda h, s: send(h, 200, ANSWER))
    PairwiseJudge(name="j", model="judge", base_url=url).check("pairwise[0]", None)  # served: fine
    with pytest.raises(ValueError, match=r"pairwise\[0\].base_url: .*: it serves no model 'gpt-judge' \(its /models "
                                         r"lists 'judge'\); set model to one of them"):
        PairwiseJudge(name="j", model="gpt-judge", base_url=url).check("pairwise[0]", None)
    with pytest.raises(ValueError, match=rf"names an endpoint path; give the API's root \(align adds /chat/completions\): "
                                         rf"base_url: {url}$"):
        PairwiseJudge(name="j", model="judge", base_url=url + "/chat/completions").check("pairwise[0]", None)
    server.shutdown()


def test_a_redirect_is_refused_and_the_key_goes_to_no_other_address(monkeypatch):
    """urllib follows a 302/303 with every header but the body's, the key included, to whatever host the server
    names (and 307/308 for the validate probe's GET): a judge's requests follow no redirect, and the error names
    where to and the fix. The address redirected to never hears from align."""
    from align.core.endpoints import endpoint_problem
    from align.judges.endpoint import EndpointError

    heard = []

    class Elsewhere(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            heard.append(self.headers.get("Authorization"))
            send(self, 200, {"object": "list", "data": [{"id": "judge"}]})

        do_POST = do_GET

    other = ThreadingHTTPServer(("127.0.0.1", 0), Elsewhere)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    target = f"http://127.0.0.1:{other.server_address[1]}/v1/chat/completions"

    class Redirecting(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            self.send_response(307)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            self.send_response(302)
            self.send_header("Location", target)
            self.send_header("Content-Length", "0")
            self.end_headers()

    server = ThreadingHTTPServer(("127.0.0.1", 0), Redirecting)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1"
    monkeypatch.setenv("JUDGE_KEY", KEY)
    with pytest.raises(EndpointError, match=rf"redirects \(HTTP 302\) to {target}: .*set base_url to where it"):
        backend(url, key_env="JUDGE_KEY").ask("judge this")
    problem = endpoint_problem(url, KEY, 2.0, "judge")
    assert problem.startswith(f"the endpoint redirects (HTTP 307) to {target}") and KEY not in problem
    assert heard == []
    server.shutdown()
    other.shutdown()


def test_an_answer_cut_off_mid_body_is_retried():
    """A chunk of the body lost (the connection closed before Content-Length bytes came: http.client's
    IncompleteRead, not an OSError) is a transient fault like a reset connection: retried, not a traceback."""
    def cut_once(h, state):
        if state["posts"] == 1:
            h.send_response(200)
            h.send_header("Content-Length", "1000")
            h.end_headers()
            h.wfile.write(b'{"choices": [')
            h.wfile.flush()
            h.close_connection = True
            return
        send(h, 200, ANSWER)

    server, state, url = serve(cut_once)
    assert backend(url).ask("judge this") == "A" and state["posts"] == 2
    server.shutdown()


def test_a_trickled_status_line_or_header_cannot_hold_a_request_nor_a_retry_wait_the_deadline():
    """urllib reads the status line and headers inside `open`, where the socket timeout restarts with every byte: a
    server sending a header line every 0.3 s held a request with timeout=2 for over a minute. A watchdog now shuts the
    connection at the request's limit; and a long Retry-After is not slept past the judging's deadline."""
    from align.judges.endpoint import EndpointError

    def headers_forever(h, state):
        try:
            h.wfile.write(b"HTTP/1.1 200 OK\r\n")
            for i in range(200):
                h.wfile.write(f"X-Slow-{i}: 1\r\n".encode())
                h.wfile.flush()
                time.sleep(0.3)
        except (BrokenPipeError, ConnectionResetError):
            pass

    server, state, url = serve(headers_forever)
    t0 = time.monotonic()
    with pytest.raises(EndpointError, match=r"last: TimeoutError: the answer took longer than timeout=1 s"):
        backend(url, timeout=1.0, retries=0).ask("judge this")
    assert time.monotonic() - t0 < 5  # ~1 s; before, the 100-header limit ended it after ~30 s
    server.shutdown()

    server, state, url = serve(lambda h, s: send(h, 429, {"error": "slow down"}, {"Retry-After": "30"}))
    b = backend(url, retries=3, max_retry_wait=30.0, deadline=1.5)
    t0 = time.monotonic()
    with pytest.raises(EndpointError, match=r"the judging took longer than deadline=1.5 s"):
        b.answers(["q"])
    assert time.monotonic() - t0 < 6  # the deadline, not 30 s of Retry-After
    server.shutdown()


def test_a_cut_off_body_and_a_servers_error_object_are_named_as_such():
    from align.judges.endpoint import EndpointError

    def cut(h, state):
        h.send_response(200)
        h.send_header("Content-Length", "500")
        h.end_headers()
        h.wfile.write(b'{"choices": [')
        h.wfile.flush()
        h.connection.shutdown(2)

    server, state, url = serve(cut)
    with pytest.raises(EndpointError, match=r"last: IncompleteRead"):
        backend(url, retries=0).ask("judge this")
    server.shutdown()
    server, state, url = serve(lambda h, s: send(h, 200, {"error": {"message": "model overloaded"}}))
    with pytest.raises(EndpointError, match=r"not a chat completion \(KeyError: the server says 'model overloaded'\)"):
        backend(url, retries=0).ask("judge this")
    server.shutdown()


def test_a_key_that_is_not_ascii_is_refused_by_name(monkeypatch):
    from align.judges.endpoint import EndpointError

    monkeypatch.setenv("JUDGE_KEY", "sk-ключ-0123456789")
    with pytest.raises(EndpointError, match=r"JUDGE_KEY holds whitespace, control or non-ASCII characters") as err:
        backend("http://127.0.0.1:9/v1", key_env="JUDGE_KEY")
    assert "ключ" not in str(err.value)


def test_a_damaged_judge_cache_is_asked_again_not_a_traceback(tmp_path):
    """A cache line whose answer is not text crashed evaluate after all its sampling (AttributeError in
    parse_verdict), a byte that is not UTF-8 failed it naming no file; and an append after a torn last line was glued
    onto it, losing one more answer."""
    from align.judges.pairwise import JudgeCache

    path = tmp_path / "judge_cache" / "ep.jsonl"
    path.parent.mkdir()
    path.write_bytes(b'{"key": "k1", "answer": "A"}\n{"key": "k2", "answer": null}\n{"key": "k3", "answer": 7}\n'
                     b'{"key": "k4", "answer": "B\xff"}\n{"key": "k5", "answer": "tie"}\n{"key": "k6", "ans')
    cache = JudgeCache(path)
    assert cache.answers == {"k1": "A", "k5": "tie"}
    cache.put({"k2": "B"})
    assert JudgeCache(path).answers == {"k1": "A", "k5": "tie", "k2": "B"}


def test_a_body_without_a_length_cut_by_the_watchdog_is_a_timeout_not_an_answer():
    """A server that sends no Content-Length, part of a body, then nothing: when the watchdog's shutdown (not the
    socket's timeout, which races it) ends the blocked read, it ends with no error, and the part read was returned
    as the answer ('not a chat completion')."""
    from align.judges.endpoint import EndpointError

    def endless(h, state):
        h.send_response(200)
        h.send_header("Connection", "close")
        h.end_headers()
        try:
            h.wfile.write(b'{"choices": [')
            h.wfile.flush()
            time.sleep(10)
        except (BrokenPipeError, ConnectionResetError):
            pass

    server, state, url = serve(endless)
    with pytest.raises(EndpointError, match=r"last: TimeoutError: the answer took longer than timeout=1 s"):
        backend(url, timeout=1.0, retries=0).ask("judge this")
    server.shutdown()


def test_a_gateways_error_object_echoing_the_key_is_named_without_it(monkeypatch):
    """A proxy answering HTTP 200 with an error object that echoes the Authorization header put the key into the
    stage's error and its manifest: the other error paths scrubbed it, this one did not."""
    from align.judges.endpoint import EndpointError

    monkeypatch.setenv("JUDGE_KEY", "sk-SECRET1234567890")
    server, state, url = serve(lambda h, s: send(h, 200, {"error": {"message": h.headers["Authorization"]}}))
    with pytest.raises(EndpointError) as err:
        backend(url, retries=0, key_env="JUDGE_KEY").ask("judge this")
    server.shutdown()
    assert "sk-SECRET1234567890" not in str(err.value) and "the server says 'Bearer <key>'" in str(err.value), err.value


def test_a_filtered_answer_is_a_refusal_never_cached_not_an_empty_verdict():
    """A content filter's answer (HTTP 200, finish_reason content_filter, content null) was read as "" and cached as
    the verdict: never asked again, and never counted toward the judging's stop after REFUSED_EVERY refusals."""
    from align.judges.endpoint import REFUSED_EVERY, EndpointError, Refused

    filtered = {"choices": [{"finish_reason": "content_filter", "message": {"role": "assistant", "content": None}}]}
    server, state, url = serve(lambda h, s: send(h, 200, filtered))
    judge = backend(url, retries=2, timeout=20.0)  # a refusal is not retried: only a slow machine's faults are
    first = judge.ask("judge this")
    assert isinstance(first, Refused) and "finish_reason content_filter" in first and judge.refused == 1
    with pytest.raises(EndpointError, match=r"refused each of the first \d+ requests \(an answer the server withheld"):
        judge.answers(["judge this"] * REFUSED_EVERY)
    assert judge.requests <= REFUSED_EVERY + 2  # (two in flight at once) none retried: a refusal is not a fault
    server.shutdown()
    thought = {"choices": [{"finish_reason": "length", "message": {"role": "assistant", "content": None}}]}
    server, state, url = serve(lambda h, s: send(h, 200, thought))  # a reasoning model out of tokens: not a filter
    answer = backend(url, retries=0).ask("judge this")
    assert isinstance(answer, Refused) and "no answer within max_new_tokens=4" in answer and "raise" in answer
    server.shutdown()


def test_a_base_url_without_v1_or_with_a_query_is_refused_at_validate_not_after_the_sampling():
    """The probe took a 404 from {base_url}/models for a server without /models, so base_url with /v1 left off (or
    with an Azure-style ?api-version, after which /chat/completions was glued) passed validate, and the stage failed
    with HTTP 404 after every policy was sampled. A 404 there is now followed by one chat completion of 1 token."""
    from align.core.endpoints import endpoint_problem, url_problem

    class OnlyV1(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_GET(self):
            if self.path == "/v1/models":
                return send(self, 200, {"object": "list", "data": [{"id": "judge"}]})
            send(self, 404, {"error": "not found"})

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path in ("/v1/chat/completions", "/bare/chat/completions"):
                return send(self, 200, ANSWER)
            send(self, 404, {"error": "not found"})

    server = ThreadingHTTPServer(("127.0.0.1", 0), OnlyV1)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    root = f"http://127.0.0.1:{server.server_address[1]}"
    assert endpoint_problem(root, "", 2.0, "judge") == (f"neither {root}/models nor {root}/chat/completions exists "
                                                        f"there (HTTP 404); did you mean base_url: {root}/v1?")
    assert endpoint_problem(root + "/v1", "", 2.0, "judge") is None
    assert endpoint_problem(root + "/bare", "", 2.0, "judge") is None  # no /models, but it answers chat completions
    server.shutdown()
    assert "holds a query or fragment" in url_problem("https://h.example.com/openai/v1?api-version=2024-06-01")
    assert url_problem("https://h.example.com/openai/v1") is None


def test_a_timeout_past_what_a_timer_takes_is_refused_by_name():
    """timeout: 1e10 passed validate (its probe waits at most 10 s) and the judging died in threading.Timer with an
    OverflowError traceback, not an error naming the setting."""
    from align.config import ConfigError, load_pipeline

    for key in ("timeout", "deadline", "max_retry_wait"):
        with pytest.raises(ConfigError, match=rf"stages\.evaluate\.pairwise\[0\]\.{key}: 10000000000(\.0)? is not "
                                              r"allowed: must be in \(0, 604800\]"):
            load_pipeline(str(REPO / "pipelines" / "default.yaml"),
                          [f"evaluate.pairwise=[{{base_url: 'http://h/v1', model: m, {key}: 1e10}}]"])
