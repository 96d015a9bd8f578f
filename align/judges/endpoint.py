"""An OpenAI-compatible chat-completions endpoint as a pairwise judge's backend (align/judges/pairwise.py): temperature
0, bounded concurrency, every request bounded in all (connecting, the status line and headers, the body) by `timeout`
and the judging by `deadline`, retries with exponential backoff on timeouts, 429 (its Retry-After or retry-after-ms,
else a longer jittered backoff) and 5xx; a request refused for what it asks (400, 413, 422) is that pair's invalid
answer (`Refused`), quoting the server; the API key is read from the named environment variable when a request is
made, sent to no other address (no redirect is followed), and never logged or written."""

from __future__ import annotations

import http.client
import json
import os
import random
import re
import socket
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from align.core.endpoints import header_value_problem, no_redirects, redirected, without_key


class _Withheld(Exception):
    """An answer the endpoint withheld (a content filter) though it answered HTTP 200."""


def withheld(choice: dict, max_new_tokens: int) -> str | None:
    """Why an answer that came with HTTP 200 holds no verdict to read (a content filter's, or none within
    max_new_tokens), or None."""
    content, finish = choice["message"]["content"], choice.get("finish_reason")
    if content is None and finish == "length":
        return (f"no answer within max_new_tokens={max_new_tokens} (finish_reason length, content null: a reasoning "
                "model spent them thinking); raise max_new_tokens")
    if content is None or finish == "content_filter":
        return f"an answer the server withheld (finish_reason {finish}, content {str(content)[:40]!r})"
    return None


class EndpointError(OSError):
    """The endpoint failed a request after its retries, or refused it; the message names the URL and the cause (an
    I/O failure: the stage ends with it as its error, exit code 2, no traceback)."""


class Refused(str):
    """The answer to a request the endpoint refused for what it asks (HTTP 400, 413, 422: a content filter, a prompt
    over the model's context): an invalid verdict for that pair, counted against max_invalid_fraction as any other,
    and never cached (a rerun asks again)."""


REFUSED_EVERY = 16
"""Refusals before any answer that end the judging: a request the server refuses every time is a setting (a parameter
it does not take), not a prompt; the error quotes the server. A request refused as longer than the judge's context
(`too_long`) never counts: the longest prompts are judged first (length-sorted batches), and a judge served with a
shorter context than the policy's refused them before any answer came."""
TOO_LONG = "longer than the judge's context"
"""In the answer to a request refused as `too_long` (pairwise.check_invalid counts them)."""
_TOO_LONG_SAYS = ("context length", "context_length", "context window", "maximum context", "max_model_len",
                  "model length", "too long", "too many tokens", "input length", "prompt length", "maximum input")


def too_long(code: int, said: str, max_new_tokens: int = 0) -> bool:
    """Whether an HTTP refusal (`code`, with what the server `said`) is of a request longer than the model's context:
    413, or a 400/422 whose message says so (vLLM: "maximum context length is ... tokens"; OpenAI:
    context_length_exceeded), unless the context it names takes no more than the answer's `max_new_tokens` (then
    every request is refused: a setting)."""
    limit = re.search(r"context length is (\d+)", said)
    if limit and int(limit.group(1)) <= max_new_tokens:
        return False
    return code == 413 or any(words in said.lower() for words in _TOO_LONG_SAYS)


class EndpointBackend:
    """An OpenAI-compatible chat-completions endpoint."""

    name = "endpoint"

    def __init__(self, base_url: str, model: str, key_env: str | None, max_new_tokens: int, timeout: float,
                 retries: int, max_concurrency: int, max_retry_wait: float = 60.0, deadline: float = 3600.0):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.model, self.key_env, self.max_new_tokens = model, key_env, max_new_tokens
        self.timeout, self.retries, self.max_concurrency = timeout, retries, max_concurrency
        self.max_retry_wait, self.deadline = max_retry_wait, deadline
        self.stop_at = float("inf")  # set per `answers` call: the judging's deadline
        self.requests = self.answered = self.refused = 0
        self.served: list[str] = []  # the models the endpoint says answered (its `model`: the snapshot an alias names)
        self._lock = threading.Lock()
        problem = header_value_problem(key_env) if key_env else None
        if problem:
            raise EndpointError(f"{self.url}: key_env: {problem}")

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        if self.key_env:  # read now, used in this request only
            headers["Authorization"] = f"Bearer {os.environ.get(self.key_env, '')}"
        return headers

    def _read(self, req) -> bytes:
        """The answer's body, within `timeout` seconds in all (and within the judging's deadline): the socket timeout
        bounds each wait, the body is read in pieces against the request's deadline, and a watchdog shuts the
        connection when it passes, so a server that trickles its status line or headers cannot hold a request
        either (urllib reads those inside `open`, where the socket timeout restarts with every byte)."""
        limit = max(0.0, min(self.timeout, self.stop_at - time.monotonic()))
        deadline = time.monotonic() + limit
        late = TimeoutError(f"the answer took longer than timeout={self.timeout:g} s to arrive" if limit >= self.timeout
                            else f"the judging's deadline={self.deadline:g} s passed while the answer arrived")
        conns: list[http.client.HTTPConnection] = []
        watchdog = threading.Timer(limit, _shut, (conns,))
        watchdog.daemon = True
        watchdog.start()
        try:
            with no_redirects(*_watched(conns)).open(req, timeout=max(limit, 0.01)) as resp:
                chunks = []
                while True:
                    if time.monotonic() > deadline:
                        raise late
                    chunk = resp.read1(1 << 16) if hasattr(resp, "read1") else resp.read(1 << 16)
                    if not chunk:
                        body = b"".join(chunks)
                        if time.monotonic() >= deadline:  # the watchdog ended a body without a length
                            raise late
                        if resp.length:  # Content-Length not met: the answer was cut off, not malformed
                            raise http.client.IncompleteRead(body, resp.length)
                        return body
                    chunks.append(chunk)
        except urllib.error.HTTPError:
            raise
        except (OSError, http.client.HTTPException):
            if time.monotonic() >= deadline:  # the watchdog shut it
                raise late from None
            raise
        finally:
            watchdog.cancel()

    def ask(self, text: str) -> str:
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": text}],
                           "max_tokens": self.max_new_tokens, "temperature": 0}).encode()
        last, wait, limited = "", 0.0, 0
        for attempt in range(self.retries + 1):
            if attempt:  # never past the judging's deadline, however long Retry-After asks
                time.sleep(max(0.0, min(wait or min(0.5 * 2 ** (attempt - 1), 8.0), self.stop_at - time.monotonic())))
            if time.monotonic() > self.stop_at:
                raise EndpointError(f"{self.url}: the judging took longer than deadline={self.deadline:g} s (last: "
                                    f"{last or 'no answer yet'}); raise the judge's deadline, or lower max_prompts")
            req = urllib.request.Request(self.url, data=body, headers=self._headers(), method="POST")
            with self._lock:
                self.requests += 1
            wait, answer = 0.0, None
            try:
                answer = json.loads(self._read(req).decode("utf-8"))
                choice = answer["choices"][0]
                if why := withheld(choice, self.max_new_tokens):
                    raise _Withheld(why)
                content = str(choice["message"]["content"])
                with self._lock:
                    self.answered += 1
                    if isinstance(answer.get("model"), str) and answer["model"] not in self.served:
                        self.served.append(answer["model"])
                return content
            except _Withheld as exc:  # a content filter's: that pair's invalid answer, never cached (outside the
                return self._refused(str(exc))  # try: the EndpointError it may raise is not a fault to retry)
            except urllib.error.HTTPError as exc:
                last = self._unkeyed(f"HTTP {exc.code}{_server_error(_error_body(exc))}")
                if moved := redirected(exc):
                    raise EndpointError(f"{self.url}: {moved}") from None
                if exc.code in (400, 413, 422):  # this request (a filtered prompt, one over the context): invalid
                    return self._refused(last, too_long(exc.code, last, self.max_new_tokens))
                if exc.code not in (408, 429) and exc.code < 500:  # the request itself is wrong: retrying will not help
                    raise EndpointError(f"{self.url} refused the request ({last}"
                                        + (": check the key in " + self.key_env if exc.code in (401, 403)
                                           and self.key_env else "") + f"; model '{self.model}')") from None
                limited += exc.code == 429
                wait = min(_asked_wait(exc.headers) or 0.0, self.max_retry_wait)
                if exc.code == 429 and not wait:  # no Retry-After: back off longer than for a fault, jittered
                    wait = min(2.0 ** (attempt + 1), self.max_retry_wait) * random.uniform(0.5, 1.0)
            except (urllib.error.URLError, TimeoutError, OSError, http.client.HTTPException) as exc:  # the last: an
                # answer cut off mid-body (IncompleteRead) or a garbled status line, as a transient fault is retried
                last = self._unkeyed(f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}")
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                last = self._unkeyed(f"an answer that is not a chat completion ({type(exc).__name__}"
                                     f"{_server_error(answer)})")  # a gateway may echo the Authorization header
        if limited:
            raise EndpointError(f"{self.url}: rate limited (HTTP 429 to {limited} of {self.retries + 1} attempts, each "
                                "retried after the server's Retry-After or retry-after-ms, else a jittered backoff, at "
                                f"most max_retry_wait={self.max_retry_wait:g} s; last: {last}); lower max_concurrency, "
                                "or raise retries / max_retry_wait")
        raise EndpointError(f"{self.url}: no answer after {self.retries + 1} attempts (last: {last}); check that the "
                            "server is up, or raise timeout / retries")

    def _unkeyed(self, text: str) -> str:
        """`text` with the endpoint's key (from its variable) replaced by <key>: what a failure may quote of it."""
        return without_key(text, os.environ.get(self.key_env or "", ""))

    def _refused(self, last: str, long: bool = False) -> Refused:
        """A request the endpoint refused: an invalid answer, or the end of the judging when it has refused every
        request so far (REFUSED_EVERY of them, not counting those too `long` for its context) and answered none, this
        run or (the judge counts its cache) before."""
        if long:
            return Refused(f"[no verdict: the endpoint refused the request as {TOO_LONG}: {last}]")
        with self._lock:
            self.refused += 1
            every = self.refused >= REFUSED_EVERY and not self.answered
        if every:
            raise EndpointError(f"{self.url} refused each of the first {self.refused} requests ({last}; model "
                                f"'{self.model}'): a setting the server does not take, not a prompt; see its message")
        return Refused(f"[no verdict: the endpoint refused the request: {last}]")

    def answers(self, texts: list[str]) -> list[str]:
        if self.stop_at == float("inf"):
            self.stop_at = time.monotonic() + self.deadline
        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            return list(pool.map(self.ask, texts))


def _watched(conns: list) -> tuple:
    """urllib's HTTP and HTTPS handlers, each connection they open kept in `conns` for the watchdog."""
    class Kept:
        def do_open(self, http_class, req, **kwargs):
            def made(*args, **kw):
                conns.append(conn := http_class(*args, **kw))
                return conn
            return super().do_open(made, req, **kwargs)

    return (type("KeptHTTP", (Kept, urllib.request.HTTPHandler), {})(),
            type("KeptHTTPS", (Kept, urllib.request.HTTPSHandler), {})())


def _shut(conns: list) -> None:
    """Shut the connections' sockets: a read blocked on one returns at once."""
    for conn in conns:
        if getattr(conn, "sock", None) is not None:
            try:
                conn.sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def _server_error(answer: Any) -> str:
    """The server's own message when its answer is an OpenAI-style error object (`{"error": {"message": ...}}`)."""
    error = answer.get("error") if isinstance(answer, dict) else None
    message = error.get("message") if isinstance(error, dict) else error
    return f": the server says {str(message)[:200]!r}" if message else ""


def _error_body(exc: urllib.error.HTTPError) -> Any:
    """An error answer's JSON body (OpenAI-style: `{"error": {"message": ...}}`), or None: what the server said."""
    try:
        return json.loads(exc.read(1 << 16).decode("utf-8", "replace"))
    except (OSError, ValueError, http.client.HTTPException, AttributeError):
        return None


def _asked_wait(headers: Any) -> float | None:
    """Seconds a 429 or 503 asks to wait: Retry-After, or OpenAI's and Azure's `retry-after-ms`."""
    if not headers:
        return None
    ms = (headers.get("retry-after-ms") or "").strip()
    asked = retry_after(headers.get("Retry-After"))
    return asked if asked is not None else (float(ms) / 1000 if ms.replace(".", "", 1).isdigit() else None)


def retry_after(value: str | None) -> float | None:
    """Seconds a Retry-After header asks for (delta-seconds or an HTTP date; RFC 9110 sec. 10.2.3), None if absent or
    unreadable."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return float(value)
    try:
        from email.utils import parsedate_to_datetime

        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError, IndexError, OverflowError):
        return None
