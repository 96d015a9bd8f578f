"""Pairwise LLM judges: a model reads a prompt and two responses and answers A, B or tie.

The setting is `align.config.settings.PairwiseJudge` (evaluate's `pairwise:` list, preferences' `pairwise:`). Every
pair is judged in both orders, since judges prefer one slot: first with the policy's response as A, then as B. The
outcome for the policy is a win when both orders prefer it, a loss when both prefer the other response, and a tie
otherwise (a tie in both, or a verdict that flips with the order); a pair with an answer that is not exactly A, B
or tie is invalid: counted and reported, never guessed (`parse_verdict`).

Backends, behind one interface (`answers(judging prompts) -> raw answers`):
- `LocalBackend`: a causal LM in the stage process (a directory, hub id or packaged:NAME), greedy, batched, the
  judging prompt sent as one user turn through the model's chat template;
- `EndpointBackend`: an OpenAI-compatible chat-completions endpoint (`base_url`, `model`), temperature 0, bounded
  concurrency, a timeout per request, retries with exponential backoff on timeouts, 429 and 5xx; the API key is
  read from the named environment variable when a request is made and is never logged or written.

Answers are cached (`JudgeCache`, <stage>/judge_cache/<judge>.jsonl), keyed by the judge's identity (backend,
model, template, answer length), the prompt and both responses, and appended as they arrive: a rerun, or an
evaluation resumed after a kill, asks only what it has not asked before.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from align.core.fsutil import tree_stamp
from align.config.settings import PairwiseJudge, header_value_problem, no_redirects, redirected, without_key

VERDICTS = ("A", "B", "tie")
DEFAULT_TEMPLATE = Path(__file__).resolve().parent.parent / "templates" / "pairwise_judge.txt"


def parse_verdict(answer: str) -> str | None:
    """Strict: the answer, without surrounding whitespace, quotes, asterisks and one final period, is exactly A, B
    or tie (any case): "A." counts as A; anything else ("Response A", "A or B") is None: invalid."""
    text = answer.strip().strip("\"'*`").strip()
    if text.endswith("."):
        text = text[:-1].strip()
    for verdict in VERDICTS:
        if text.lower() == verdict.lower():
            return verdict
    return None


def outcome(policy_first: str | None, policy_second: str | None) -> str:
    """The policy's outcome from the verdict with its response as A (`policy_first`) and as B (`policy_second`):
    win, loss, tie (a tie in both orders, or a verdict that flips with the order) or invalid."""
    if policy_first is None or policy_second is None:
        return "invalid"
    first = {"A": "win", "B": "loss", "tie": "tie"}[policy_first]
    second = {"B": "win", "A": "loss", "tie": "tie"}[policy_second]
    return first if first == second else "tie"


class InvalidVerdicts(ValueError):
    """A pairwise judge answered something other than A, B or tie too often for its verdicts to be used."""


def check_invalid(results: list[dict[str, Any]], settings: PairwiseJudge, stage: str, what: str,
                  show: bool = True) -> None:
    """The one failure rule of both callers (preferences labelling pairs, evaluate comparing policies): invalid
    outcomes above the judge's `max_invalid_fraction` end the stage, the first five answers in the log (`show`: the
    main process says them; every process raises). `what` names the pairs in the message ("prompts", "pairs of ppo
    vs sft")."""
    invalid = [r for r in results if r["outcome"] == "invalid"]
    if not results or len(invalid) / len(results) <= settings.max_invalid_fraction:
        return
    for r in invalid[:5] if show else ():
        print(f"[align] {stage}: {settings.name}: invalid answers (first as A, as B): {r['answers']!r}", flush=True)
    raise InvalidVerdicts(
        f"stage '{stage}': pairwise judge '{settings.name}' gave invalid answers (not exactly A, B or tie) for "
        f"{len(invalid)} of {len(results)} {what} ({len(invalid) / len(results):.1%}), above max_invalid_fraction "
        f"{settings.max_invalid_fraction:g}; examples in the log. Use a stronger judge, a judging template that asks "
        "for one word, or a larger max_new_tokens")


class Backend(Protocol):
    name: str
    requests: int

    def answers(self, texts: list[str]) -> list[str]: ...


class LocalBackend:
    """A causal LM judging in the stage process: greedy decoding, `batch_size` judging prompts per call, left
    padding (positions from the mask), each prompt a user turn of the model's own chat template."""

    name = "local"

    def __init__(self, model, tokenizer, batch_size: int, max_new_tokens: int):
        self.model, self.tokenizer = model, tokenizer
        self.batch_size, self.max_new_tokens = batch_size, max_new_tokens
        self.requests = 0

    def render(self, text: str) -> str:
        return chat_prompt(self.tokenizer, text)

    def answers(self, texts: list[str]) -> list[str]:
        import torch  # heavy: stage processes only

        out: list[str] = []
        tok = self.tokenizer
        side = tok.padding_side
        tok.padding_side = "left"
        try:
            for start in range(0, len(texts), self.batch_size):
                batch = [self.render(t) for t in texts[start:start + self.batch_size]]
                enc = tok(batch, return_tensors="pt", padding=True, add_special_tokens=False).to(self.model.device)
                with torch.no_grad():
                    ids = self.model.generate(**enc, do_sample=False, max_new_tokens=self.max_new_tokens,
                                              pad_token_id=tok.pad_token_id)
                out += tok.batch_decode(ids[:, enc["input_ids"].size(1):], skip_special_tokens=True)
                self.requests += len(batch)
        finally:
            tok.padding_side = side
        return out


def chat_prompt(tokenizer, text: str) -> str:
    """`text` as one user turn with the model's chat template and its generation prompt (the text itself when the
    tokenizer has no template): what an OpenAI-compatible server does with a one-message request."""
    if not tokenizer.chat_template:
        return text
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


class EndpointError(OSError):
    """The endpoint failed a request after its retries, or refused it; the message names the URL and the cause (an
    I/O failure: the stage ends with it as its error, exit code 2, no traceback)."""


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
        self.requests = 0
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
        """The answer's body, within `timeout` seconds in all: the socket timeout bounds each wait, and the body is
        read in pieces against the request's deadline (a server that trickles its answer cannot hold a request)."""
        deadline = time.monotonic() + self.timeout
        with no_redirects().open(req, timeout=self.timeout) as resp:
            chunks = []
            while True:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the answer took longer than timeout={self.timeout:g} s to arrive")
                chunk = resp.read1(1 << 16) if hasattr(resp, "read1") else resp.read(1 << 16)
                if not chunk:
                    return b"".join(chunks)
                chunks.append(chunk)

    def ask(self, text: str) -> str:
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": text}],
                           "max_tokens": self.max_new_tokens, "temperature": 0}).encode()
        last, wait, limited = "", 0.0, 0
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(wait or min(0.5 * 2 ** (attempt - 1), 8.0))
            if time.monotonic() > self.stop_at:
                raise EndpointError(f"{self.url}: the judging took longer than deadline={self.deadline:g} s (last: "
                                    f"{last or 'no answer yet'}); raise the judge's deadline, or lower max_prompts")
            req = urllib.request.Request(self.url, data=body, headers=self._headers(), method="POST")
            with self._lock:
                self.requests += 1
            wait = 0.0
            try:
                answer = json.loads(self._read(req).decode("utf-8"))
                return str(answer["choices"][0]["message"]["content"] or "")
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}"
                if moved := redirected(exc):
                    raise EndpointError(f"{self.url}: {moved}") from None
                if exc.code not in (408, 429) and exc.code < 500:  # the request itself is wrong: retrying will not help
                    raise EndpointError(f"{self.url} refused the request ({last}"
                                        + (": check the key in " + self.key_env if exc.code in (401, 403)
                                           and self.key_env else "") + f"; model '{self.model}')") from None
                limited += exc.code == 429
                wait = min(retry_after(exc.headers.get("Retry-After") if exc.headers else None) or 0.0,
                           self.max_retry_wait)
            except (urllib.error.URLError, TimeoutError, OSError, http.client.HTTPException) as exc:  # the last: an
                # answer cut off mid-body (IncompleteRead) or a garbled status line, as a transient fault is retried
                last = without_key(f"{type(exc).__name__}: {getattr(exc, 'reason', exc)}",
                                   os.environ.get(self.key_env or "", ""))
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                last = f"an answer that is not a chat completion ({type(exc).__name__})"
        if limited:
            raise EndpointError(f"{self.url}: rate limited (HTTP 429 to {limited} of {self.retries + 1} attempts, each "
                                f"retried after the server's Retry-After, at most max_retry_wait={self.max_retry_wait:g} "
                                "s); lower max_concurrency, or raise retries / max_retry_wait")
        raise EndpointError(f"{self.url}: no answer after {self.retries + 1} attempts (last: {last}); check that the "
                            "server is up, or raise timeout / retries")

    def answers(self, texts: list[str]) -> list[str]:
        if self.stop_at == float("inf"):
            self.stop_at = time.monotonic() + self.deadline
        with ThreadPoolExecutor(max_workers=self.max_concurrency) as pool:
            return list(pool.map(self.ask, texts))


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


class JudgeCache:
    """Raw answers by key, in a JSONL file appended as answers arrive (a killed run keeps what it was told; a torn
    last line is skipped). `rank`: with several processes, each appends to a file of its own (NAME.rankR.jsonl beside
    `path`: appends from several nodes to one file on a network filesystem can tear lines), and each reads them all."""

    def __init__(self, path: Path, rank: int | None = None):
        self.path = path if rank is None else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
        self.answers: dict[str, str] = {}
        for file in sorted({path, *path.parent.glob(f"{path.stem}.rank*{path.suffix}")}):
            for line in file.read_text(encoding="utf-8").splitlines() if file.is_file() else ():
                try:
                    row = json.loads(line)
                    self.answers[row["key"]] = row["answer"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    continue
        self._lock = threading.Lock()

    def put(self, items: dict[str, str]) -> None:
        with self._lock:
            self.answers.update(items)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as fh:
                fh.writelines(json.dumps({"key": k, "answer": v}) + "\n" for k, v in items.items())
                fh.flush()


class PairwiseLLMJudge:
    """One pairwise judge: a backend, a judging prompt template, a cache."""

    def __init__(self, settings: PairwiseJudge, backend: Backend, template: str, cache: JudgeCache,
                 chunk: int = 64, revision: str | None = None):
        self.settings, self.backend, self.template, self.cache = settings, backend, template, cache
        self.chunk = chunk  # answers cached in chunks of this many (a kill loses at most one chunk)
        model = settings.model if settings.base_url is None else f"{settings.base_url}:{settings.model}"
        if settings.base_url is None and Path(model).is_dir():  # a local judge: its files as they are now, so an
            model = f"{model}:{tree_stamp(model)}"  # answer cached before its weights were replaced is not reused
        elif revision:  # a hub judge: the commit its weights came from (hub_commit), so an answer cached from an
            model = f"{model}@{revision}"  # older commit of the repository is not reused
        self.identity = json.dumps([backend.name, model, hashlib.sha256(template.encode()).hexdigest(),
                                    settings.max_new_tokens])

    def key(self, prompt: str, a: str, b: str) -> str:
        return hashlib.sha256(json.dumps([self.identity, prompt, a, b]).encode()).hexdigest()

    def text(self, prompt: str, a: str, b: str) -> str:
        return self.template.format(prompt=prompt, response_a=a, response_b=b)

    def raw_answers(self, prompts: list[str], a: list[str], b: list[str]) -> list[str]:
        """The judge's raw answers for (prompt, A, B) triples: from the cache, else asked (and cached)."""
        keys = [self.key(p, x, y) for p, x, y in zip(prompts, a, b)]
        todo = list(dict.fromkeys(k for k in keys if k not in self.cache.answers))
        where = {k: i for i, k in enumerate(keys)}
        for start in range(0, len(todo), self.chunk):
            part = todo[start:start + self.chunk]
            texts = [self.text(prompts[where[k]], a[where[k]], b[where[k]]) for k in part]
            self.cache.put(dict(zip(part, self.backend.answers(texts))))
        return [self.cache.answers[k] for k in keys]

    def compare(self, prompts: list[str], policy: list[str], baseline: list[str]) -> list[dict[str, Any]]:
        """Both orders for each prompt: the raw answers, the verdicts and the policy's outcome."""
        first = self.raw_answers(prompts, policy, baseline)  # the policy's response as A
        second = self.raw_answers(prompts, baseline, policy)  # ... and as B
        out = []
        for f, s in zip(first, second):
            vf, vs = parse_verdict(f), parse_verdict(s)
            out.append({"answers": [f, s], "verdicts": [vf, vs], "outcome": outcome(vf, vs)})
        return out


def hub_commit(model_id: str, cache_dir: str | None = None) -> str | None:
    """The commit of a hub model's files in the local Hugging Face cache: after loading, the one loaded (loading
    moves the cache's ref to what it fetched); None when the cache has none or `model_id` names no repository."""
    from huggingface_hub import try_to_load_from_cache

    try:
        found = try_to_load_from_cache(model_id, "config.json", cache_dir=cache_dir)
    except ValueError:  # not a repository id (a GGUF file, a relative path): no commit to name
        return None
    return Path(found).parent.name if isinstance(found, str) else None


def build_pairwise(ctx, settings: PairwiseJudge) -> PairwiseLLMJudge:
    """The judge of a setting in a stage process (`ctx`: its StageContext): the template read from its resolved
    path (or the shipped one), the local model loaded on the stage's device, the cache in the stage's directory."""
    template = Path(settings.template).read_text(encoding="utf-8") if settings.template else \
        DEFAULT_TEMPLATE.read_text(encoding="utf-8")
    revision = None
    if settings.base_url:
        backend: Backend = EndpointBackend(settings.base_url, settings.model, settings.key_env,
                                           settings.max_new_tokens, settings.timeout, settings.retries,
                                           settings.max_concurrency, settings.max_retry_wait, settings.deadline)
    else:
        from align.core.packaged import SCHEME, resolve
        from align.modeling.models import load_tokenizer

        path = resolve(settings.model) if settings.model.startswith(SCHEME) else settings.model
        tokenizer = load_tokenizer(path)
        backend = LocalBackend(ctx.load_lm(path, device=True, frozen=True).eval(), tokenizer, settings.batch_size,
                               settings.max_new_tokens)
        revision = None if Path(path).is_dir() else hub_commit(path)
    chunk = settings.max_concurrency if settings.base_url else settings.batch_size  # in flight at a kill, at most
    rank = ctx.state.process_index if ctx.state.num_processes > 1 else None
    return PairwiseLLMJudge(settings, backend, template,
                            JudgeCache(ctx.dir / "judge_cache" / f"{settings.name}.jsonl", rank), chunk=chunk,
                            revision=revision)
