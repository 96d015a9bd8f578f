"""Pairwise LLM judges: a model reads a prompt and two responses and answers A, B or tie.

The setting is `align.config.settings.PairwiseJudge` (evaluate's `pairwise:` list, preferences' `pairwise:`). Every
pair is judged in both orders, since judges prefer one slot: first with the policy's response as A, then as B. The
outcome for the policy is a win when both orders prefer it, a loss when both prefer the other response, and a tie
otherwise (a tie in both, or a verdict that flips with the order); a pair with an answer that is not exactly A, B
or tie is invalid: counted and reported, never guessed (`parse_verdict`).

Backends, behind one interface (`answers(judging prompts) -> raw answers`):
- `LocalBackend`: a causal LM in the stage process (a directory, hub id or packaged:NAME), greedy, batched, the
  judging prompt sent as one user turn through the model's chat template;
- `EndpointBackend` (align/judges/endpoint.py): an OpenAI-compatible chat-completions endpoint (`base_url`, `model`), temperature 0, bounded
  concurrency, a timeout per request, retries with exponential backoff on timeouts, 429 and 5xx, a request it
  refuses (a content filter) an invalid answer, never cached; the API key is read from the named environment
  variable when a request is made and is never logged or written.

Answers are cached (`JudgeCache`, <stage>/judge_cache/<judge>.jsonl), keyed by the judge's identity (backend,
model, template, answer length), the prompt and both responses, and appended as they arrive: a rerun, or an
evaluation resumed after a kill, asks only what it has not asked before.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path
from typing import Any, Protocol

from align.core.fsutil import stamp
from align.config.settings import PairwiseJudge
from align.judges.endpoint import TOO_LONG, EndpointBackend, Refused

VERDICTS = ("A", "B", "tie")
DEFAULT_TEMPLATE = Path(__file__).resolve().parent.parent / "templates" / "pairwise_judge.txt"


def parse_verdict(answer: str) -> str | None:
    """Strict: the answer, without surrounding whitespace, quotes, asterisks and one final period, is exactly A, B
    or tie (any case): "A." counts as A; anything else ("Response A", "A or B") is None: invalid."""
    text = answer.strip()
    outside = text.endswith(".")  # the one period: outside the quotes or asterisks ('**A**.') or inside them ('"A."')
    text = text.removesuffix(".").strip().strip("\"'*`").strip()
    if not outside:
        text = text.removesuffix(".").strip()
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
    long = sum(any(TOO_LONG in str(a) for a in r["answers"]) for r in invalid)
    raise InvalidVerdicts(
        f"stage '{stage}': pairwise judge '{settings.name}' gave invalid answers (not exactly A, B or tie) for "
        f"{len(invalid)} of {len(results)} {what} ({len(invalid) / len(results):.1%}), above max_invalid_fraction "
        f"{settings.max_invalid_fraction:g}; examples in the log. " + (
            f"{long} of them were {TOO_LONG}: use or serve a judge with a longer context (vLLM "
            "--max-model-len), sample shorter responses (generation.max_new_tokens), take shorter prompts, or lower the "
            "judge's max_new_tokens"
            if long else "Use a stronger judge, a judging template that asks for one word, or a larger "
            "max_new_tokens"))


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
        self.positions = getattr(getattr(model, "config", None), "max_position_embeddings", None)

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
                answers: list[str | None] = [self._too_long(len(ids)) for ids in
                                             tok(batch, add_special_tokens=False)["input_ids"]]
                fit = [text for text, answer in zip(batch, answers) if answer is None]
                if fit:
                    enc = tok(fit, return_tensors="pt", padding=True, add_special_tokens=False).to(self.model.device)
                    with torch.no_grad():
                        ids = self.model.generate(**enc, do_sample=False, max_new_tokens=self.max_new_tokens,
                                                  pad_token_id=tok.pad_token_id)
                    said = iter(tok.batch_decode(ids[:, enc["input_ids"].size(1):], skip_special_tokens=True))
                    answers = [next(said) if answer is None else answer for answer in answers]
                out += answers
                self.requests += len(fit)
        finally:
            tok.padding_side = side
        return out

    def _too_long(self, tokens: int) -> Refused | None:
        """An invalid answer for a judging prompt whose tokens and max_new_tokens pass the judge's positions (a
        learned-position model raised an IndexError after every policy was sampled; a RoPE one judged past what it
        was trained on), None for one that fits. Not cached: a judge with a longer context answers it."""
        if self.positions is None or tokens + self.max_new_tokens <= self.positions:
            return None
        return Refused(f"[no verdict: the judging prompt ({tokens} tokens) and max_new_tokens ({self.max_new_tokens}) "
                       f"are {TOO_LONG} ({self.positions} positions)]")


def chat_prompt(tokenizer, text: str) -> str:
    """`text` as one user turn with the model's chat template and its generation prompt (the text itself when the
    tokenizer has no template): what an OpenAI-compatible server does with a one-message request."""
    if not tokenizer.chat_template:
        return text
    return tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)


class JudgeCache:
    """Raw answers by key, in a JSONL file appended as answers arrive (a killed run keeps what it was told; a torn
    last line is skipped). `rank`: with several processes, each appends to a file of its own (NAME.rankR.jsonl beside
    `path`: appends from several nodes to one file on a network filesystem can tear lines), and each reads them all."""

    def __init__(self, path: Path, rank: int | None = None):
        self.path = path if rank is None else path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
        self.answers: dict[str, str] = {}
        self._torn = False  # a killed append left a last line without its end: the next one starts a line of its own
        for file in sorted({path, *path.parent.glob(f"{path.stem}.rank*{path.suffix}")}):
            data = file.read_bytes() if file.is_file() else b""
            self._torn = self._torn or (file == self.path and data[-1:] not in (b"", b"\n"))
            for line in data.split(b"\n"):
                try:  # a damaged line (torn, bytes that are not UTF-8, an answer that is not text) is asked again
                    row = json.loads(line.decode("utf-8"))
                    if isinstance(row["key"], str) and isinstance(row["answer"], str):
                        self.answers[row["key"]] = row["answer"]
                except (UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
                    continue
        self._lock = threading.Lock()

    def put(self, items: dict[str, str]) -> None:
        with self._lock:
            self.answers.update(items)
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path, "a", encoding="utf-8") as fh:
                if self._torn:
                    fh.write("\n")
                    self._torn = False
                fh.writelines(json.dumps({"key": k, "answer": v}) + "\n" for k, v in items.items())
                fh.flush()


class PairwiseLLMJudge:
    """One pairwise judge: a backend, a judging prompt template, a cache."""

    def __init__(self, settings: PairwiseJudge, backend: Backend, template: str, cache: JudgeCache,
                 chunk: int = 64, revision: str | None = None):
        self.settings, self.backend, self.template, self.cache = settings, backend, template, cache
        self.chunk = chunk  # answers cached in chunks of this many (a kill loses at most one chunk)
        model = settings.model if settings.base_url is None else f"{settings.base_url}:{settings.model}"
        local = stamp(model) if settings.base_url is None else None  # a local judge, a directory or a .gguf file:
        if local is not None:  # its files as they are now, so an answer cached before its weights were replaced
            model = f"{model}:{local}"  # is not reused (a .gguf file was keyed by its path alone)
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
        if hasattr(self.backend, "answered"):  # answers cached by an earlier run: the endpoint does answer this judge
            self.backend.answered += len(set(keys)) - len(todo)  # (its refusals, never cached, are asked first again)
        refused: dict[str, str] = {}  # answers to requests an endpoint refused (endpoint.Refused): never cached
        for start in range(0, len(todo), self.chunk):
            part = todo[start:start + self.chunk]
            texts = [self.text(prompts[where[k]], a[where[k]], b[where[k]]) for k in part]
            got = dict(zip(part, self.backend.answers(texts)))
            refused.update({k: v for k, v in got.items() if isinstance(v, Refused)})
            self.cache.put({k: v for k, v in got.items() if not isinstance(v, Refused)})
        return [refused[k] if k in refused else self.cache.answers[k] for k in keys]

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
        # the snapshots that answered, in the manifest (filled as answers arrive): cached answers are keyed by the
        # alias, so a moved alias shows here, not in the key
        ctx.extra_manifest.setdefault("judge_endpoint_models", {})[settings.name] = backend.served
    else:
        from align.core.packaged import SCHEME, resolve

        path = resolve(settings.model) if settings.model.startswith(SCHEME) else settings.model
        tokenizer = ctx.load_tokenizer(path)
        backend = LocalBackend(ctx.load_lm(path, device=True, frozen=True).eval(), tokenizer, settings.batch_size,
                               settings.max_new_tokens)
        revision = None if Path(path).is_dir() else hub_commit(path)
    chunk = settings.max_concurrency if settings.base_url else settings.batch_size  # in flight at a kill, at most
    rank = ctx.state.process_index if ctx.state.num_processes > 1 else None
    return PairwiseLLMJudge(settings, backend, template,
                            JudgeCache(ctx.dir / "judge_cache" / f"{settings.name}.jsonl", rank), chunk=chunk,
                            revision=revision)
