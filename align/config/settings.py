"""Settings several stage types share: the builtin model's size, LoRA, decoding (and which engine samples), pairwise
LLM judges with their endpoint checks, and the names of dtypes, precisions, attention kernels and schedulers. The
stage-type contract that uses them is align/config/contract.py. No torch here.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from align.core.endpoints import endpoint_problem, header_value_problem, url_problem
from align.core.machine import has_gpu
from align.engines import DEFAULT as DEFAULT_ENGINE, engine_names
from align.core.schema import name_field, one_of, ranged

DTYPES = ("float32", "bfloat16", "float16")
# transformers SchedulerType values that need no extra scheduler kwargs (tests check they still exist); not
# cosine_with_restarts: with transformers' default of one cycle (align sets no num_cycles) it is cosine, step for step.
LR_SCHEDULERS = ("linear", "cosine", "polynomial", "constant", "constant_with_warmup", "inverse_sqrt")
LR_SCHEDULER_FIX = "cosine_with_restarts is not offered: with transformers' one cycle it is cosine; use cosine"


def warmup_steps(steps: int, ratio: float, scheduler: str) -> int:
    """The warmup steps transformers gives `steps` optimiser steps (TrainingArguments.get_warmup_steps: a ratio below 1
    rounds up); its constant schedule has none."""
    return 0 if scheduler == "constant" else math.ceil(steps * ratio)


# Pipeline-level compute settings, resolved in each stage process by align/modeling/compute.py.
WEEK_S = 7 * 86400.0  # the most an endpoint judge's timeouts may be (threading.Timer overflows far above)
PRECISIONS = ("auto", "float32", "bfloat16", "float16")
ATTN_IMPLEMENTATIONS = ("auto", "eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")


def flash_attention_problem(attn: str) -> str | None:
    """Why `attn` cannot be used here (None when it can): checked by `align validate` before launching."""
    import importlib.util

    if attn == "flash_attention_2" and importlib.util.find_spec("flash_attn") is None:
        return ("flash_attention_2 needs the flash-attn package (pip install flash-attn --no-build-isolation, "
                "on a CUDA machine); use `attn_implementation: sdpa` otherwise")
    if attn == "flash_attention_3" and importlib.util.find_spec("flash_attn_interface") is None:
        return ("flash_attention_3 needs FlashAttention-3 (flash_attn_interface, Hopper GPUs); use "
                "`attn_implementation: sdpa` otherwise")
    return None


@dataclass
class BuiltinModel:
    """Size of the tiny Llama-style model that `base_model: builtin:tiny-llama` builds from scratch."""

    vocab_size: int = ranged(4096, ge=16)
    """BPE vocabulary size of the tokenizer trained on the first stage's corpus."""
    hidden_size: int = ranged(128, ge=1)
    """Width of the residual stream."""
    num_layers: int = ranged(4, ge=1)
    """Number of transformer blocks."""
    num_heads: int = ranged(4, ge=1)
    """Attention heads per block."""
    intermediate_size: int = ranged(384, ge=1)
    """Width of the MLP."""
    max_position_embeddings: int = ranged(256, ge=2)
    """Longest sequence the model accepts (prompt + response)."""


@dataclass
class LoraSettings:
    """Optional LoRA adapters (peft). `model/` holds the adapters alone (or merged, with `merge`)."""

    enabled: bool = False
    """Train LoRA adapters instead of the full model."""
    r: int = ranged(16, ge=1)
    """Adapter rank."""
    alpha: int = ranged(32, ge=1)
    """Scaling numerator (effective scale alpha / r)."""
    dropout: float = ranged(0.05, ge=0, lt=1)
    """Dropout on the adapter input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Module names that get adapters."""
    merge: bool = False
    """Publish model/ as the base with the adapters merged in (a plain checkpoint as large as the base) instead of
    the adapters alone (adapter_config.json and their weights, beside the name of the base they were trained on,
    which every later stage loads and merges in memory). A vllm engine needs merged weights to start from: `align
    validate` says which stage must set this."""
    quantize: str = one_of("none", "none", "4bit")
    """`4bit`: QLoRA (Dettmers et al. 2023): the frozen base is loaded in 4-bit NormalFloat with double
    quantization and bf16 compute (bitsandbytes), the adapters train on top. Needs a CUDA GPU and
    `pip install 'align[qlora]'`; `model/` holds the adapters (trained over the unquantised base), or with `merge`
    the merged 16/32-bit model."""

    def unread(self) -> dict[str, str]:
        """Its settings a stage does not read (dotted key -> why): all of them while LoRA is off."""
        if self.enabled:
            return {}
        return {f"lora.{k}": "lora.enabled is false" for k in ("r", "alpha", "dropout", "target_modules", "merge")}

    def check(self) -> None:
        """`align validate`: targets named where LoRA is on; QLoRA only with LoRA on, bitsandbytes and a CUDA GPU."""
        if self.enabled and not [t for t in self.target_modules if str(t).strip()]:
            raise ValueError(f"lora.target_modules: {self.target_modules} names no layer, so no adapter would train; "
                             "name the linear layers to adapt (e.g. [q_proj, v_proj])")
        if self.quantize == "none":
            return
        if not self.enabled:
            raise ValueError(f"lora.quantize: '{self.quantize}' quantizes the frozen base under LoRA adapters; set "
                             "lora.enabled: true, or lora.quantize: none")
        if importlib.util.find_spec("bitsandbytes") is None:
            raise ValueError(f"lora.quantize: '{self.quantize}' needs the bitsandbytes package, which is not "
                             "installed; `pip install 'align[qlora]'` on a CUDA machine, or set lora.quantize: none")
        if not has_gpu():  # torch-free (this layer is the orchestrator's too): the NVIDIA driver's device nodes
            raise ValueError(f"lora.quantize: '{self.quantize}' runs only on a CUDA GPU (bitsandbytes 4-bit kernels) "
                             "and none is present here; run on a GPU machine, or set lora.quantize: none")


@dataclass
class Generation:
    """Decoding settings for sampling (rollouts, preference labelling, evaluation)."""

    max_new_tokens: int = ranged(24, ge=1, fix="a response needs at least one token")
    """Longest response in tokens; responses stop earlier at EOS."""
    temperature: float = ranged(1.0, gt=0, fix="sampling divides logits by it; greedy decoding is not offered")
    """Softmax temperature."""
    top_k: int | None = ranged(None, ge=1, fix="use null to keep every token")
    """Keep only the k most likely tokens (None = off)."""
    top_p: float = ranged(1.0, gt=0, le=1, fix="1.0 turns nucleus sampling off")
    """Nucleus sampling mass (1.0 = off)."""
    batch_size: int = ranged(64, ge=1)
    """Responses per generate call (one per prompt; a preferences stage samples batch_size // samples_per_prompt
    prompts at once, each samples_per_prompt times)."""
    fast: str = one_of("auto", "auto", "on", "off")
    """Static KV cache (compiled with torch.compile by transformers on a GPU) and prompts padded to a multiple of
    32 tokens: auto = on on a GPU outside ZeRO-3, off on CPU (align/modeling/compute.py). hf engine only."""
    engine: str = one_of(DEFAULT_ENGINE, *engine_names())
    """What samples (align/engines/): hf (transformers.generate with the stage's own model) or vllm (vLLM in its own
    process and environment, weights synced after every PPO update). vllm needs vLLM in this interpreter or
    ALIGN_VLLM_PYTHON naming one (./launch.sh --vllm sets up .venv-vllm); `align validate` says so when it is missing."""
    zero3_gather: str = one_of("whole", "whole", "layers")
    """Under ZeRO-3, how the hf engine reaches the sharded policy's weights to sample (PPO; GRPO and RLOO as TRL's
    ds3_gather_for_generation): `whole` gathers the
    whole policy once per rollout batch (fast; `align estimate` counts its full 16-bit copy on every GPU), `layers`
    leaves DeepSpeed's hooks on, so every decoding step gathers one layer at a time and every process steps until
    all are done (memory of one layer; a collective per layer and step: much slower)."""
    engine_timeout_s: float = ranged(600.0, gt=0, fix="seconds the vllm engine may take for one call (start, a batch, a sync)")
    """vllm: the longest one engine call may take (start-up, one generate batch, one weight sync) before the stage
    ends with an error naming it, instead of waiting forever; a generate on an engine shared by n processes may take
    n times as long (it may wait for the others' batches)."""
    max_logprob_gap: float = ranged(10.0, gt=0)
    """vllm: the largest |engine - trainer| log-prob of a sampled token (nats) before the stage stops, naming the
    weight sync and the engine's log; a non-finite gap always stops it. fp32 engines agree within ~1e-3 nats; bf16
    engines on GPU can differ by a few nats on rare tokens (kernel and precision mismatch), so the default only
    catches weights that loaded wrongly (tens of nats)."""
    kv_cache_gib: float = ranged(1.0, gt=0)
    """vllm on CPU: the KV cache in GiB (VLLM_CPU_KVCACHE_SPACE, rounded to whole GiB); align estimate counts it."""
    gpu_memory_utilization: float = ranged(0.3, gt=0, le=1, fix="a fraction of the GPU's memory, e.g. 0.3")
    """vllm on a GPU: the fraction of the GPU's memory vLLM takes (weights + KV cache), beside the trainer."""
    weight_sync: str = one_of("shared", "shared", "host", "file", "broadcast")
    """vllm: how the trained weights reach the engine after an update (align/engines/weight_sync.py): `shared`
    streams them through one bucket (sync_bucket_mib) that the engine loads from in place (vLLM's own weight loaders;
    on a CPU the engine keeps its linear weights beside vLLM's packed copies for this: one more copy of the weights in
    its memory), after the first sync only the weights that train (a LoRA run: the adapted layers, merged); the
    bucket is on the trainer's GPU, shared by CUDA IPC, where the engine runs on that GPU (colocated), else in
    /dev/shm. Weights in host memory (a CPU run) skip the bucket: the trainer's storages move into shared memory once
    and the engine reads them where they lie (merged LoRA layers still travel). Under ZeRO-3 with the partitions in
    host memory (a CPU run; offload_param on GPUs, not run there) and every process on one node, nothing is gathered:
    each process writes its own partitions into one bucket of the node's (align/engines/node_bucket.py; `host` too).
    `host`: every weight through the bucket in /dev/shm, on GPUs too (a device-to-host copy each way; for machines
    where CUDA IPC between processes is not allowed). `file` writes the whole policy as a safetensors file in /dev/shm
    for the engine to reload (the older path, kept for comparison). `broadcast`: the bucket stays in the trainer's memory and reaches the engine by a
    broadcast in a process group of the two (NCCL GPU to GPU, for engines on separate GPUs; gloo on a CPU, where it
    is the tested twin and slower than shared memory); NCCL has not run in this project. The CUDA IPC bucket has not run on a GPU in this project (vLLM's CUDA build cannot be
    carried to the lent GPU)."""
    lora_sync: str = one_of("merged", "merged", "adapter")
    """vllm with a LoRA-trained policy: what a sync sends. `merged`: the adapted layers with the adapters merged in
    (W + BA; the engine serves a plain model). `adapter`: the adapters alone (a few MB), which the engine applies with
    vLLM's LoRA support at every generation (started with enable_lora; a 4-bit base is refused: the engine's base would
    differ from the trainer's). On the 2-core CPU, SmolLM2, r 16 on every linear layer: the adapter sync took 0.05 s
    against 1.1 s merged, but sampling with the adapter was 1.6-2.2x slower (docs/benchmarks.md); not measured on a GPU."""
    sync_bucket_mib: float = ranged(32.0, gt=0, fix="the sync bucket in MiB, e.g. 32")
    """vllm with weight_sync: shared or host: the bucket's size in MiB per process, on the GPU or in /dev/shm (a larger
    tensor travels in pieces); Docker's default /dev/shm is 64 MiB in all. The node's bucket under ZeRO-3 (above) is
    this times the processes, at least 512 MiB where /dev/shm has room. On a GPU (CUDA IPC, broadcast) a weight larger
    than the bucket is put together inside the engine in a copy outside vLLM's memory share (Llama-3.1-8B's embedding:
    1 GiB) over one round trip per piece: a bucket as large as the largest weight trades that for its room on the
    trainer's GPU (read in the code, not measured: no GPU has run vLLM in this project)."""
    tensor_parallel_size: int = ranged(1, ge=1, fix="the GPUs one engine spans, e.g. 2")
    """vllm: the GPUs one engine spans (vLLM's tensor parallelism), each engine shared by that many training processes
    (align/engines/placement.py, group.py): colocated, the processes of GPUs 0-1 share one engine over GPUs 0-1 and so
    on; separate, each engine takes that many spare GPUs. The engine's starter syncs it (under ZeRO-3 every process
    still joins the gathers), the others send it their prompts. An engine over more than one GPU syncs by file (its
    workers are processes of their own: the bucket reaches one). On a CPU, the processes share one engine that runs in
    one process. Tensor parallelism has not run on a GPU in this project (vLLM's CUDA build cannot be carried there)."""
    sleep: bool = False
    """An engine with its own copy that can free its memory (vllm on GPUs: vLLM's sleep mode, level 1, weights to host
    memory and the KV cache dropped): it sleeps after each round of sampling while the policy trains; a sync wakes its
    weights, sampling the rest, once every process it serves has given back its cached GPU memory (stages that
    train: refused on evaluate and preferences). Level 1 keeps a pinned host copy of the weights per engine. For colocated engines on GPUs (vLLM's sleep mode is CUDA-only: refused on a machine
    without a GPU, and with placement: separate); `align estimate` counts the larger of sampling (the engine awake) and training (asleep: a 1 GiB allowance).
    Not yet run on a GPU in this project; its CPU twin is the test suite's copy engine."""
    cuda_graphs: bool = True
    """vllm on GPUs: decode with CUDA graphs (vLLM's default: captured at start-up, a few seconds and some memory
    within gpu_memory_utilization, much faster decoding of small batches); false decodes eagerly. Weight syncs copy
    into the captured weights' own memory, which the graphs keep reading. Always eager on a CPU. Not yet run on a GPU
    in this project (vLLM's CUDA build cannot be carried to the lent GPU)."""
    placement: str = one_of("colocated", "colocated", "separate")
    """vllm on GPUs: `colocated` engines share the training GPUs (each takes gpu_memory_utilization of its GPUs);
    `separate` engines get the node's GPUs training does not use (launch fewer processes than GPUs), the whole of each,
    process r served by engine r mod the number of engines; weights reach them through /dev/shm. Ignored on a CPU."""

    def truncation_problem(self, measures: str) -> str | None:
        """Why top_k / top_p cannot be used where align `measures` something as an expectation under the policy's own
        distribution at the temperature (its log-probs are of the whole distribution; truncated samples do not
        estimate it: TRL's PPO asked for top_k 0 and top_p 1.0 for this, its KL could come out negative), else None."""
        if not self.top_k and self.top_p >= 1.0:
            return None
        return (f"generation.top_k {self.top_k or 'null'} / top_p {self.top_p}: {measures} is an expectation under the policy's "
                "own distribution at generation.temperature, which truncated samples do not estimate (log-probs are "
                "of the whole distribution); leave top_k null and top_p 1.0 (temperature alone)")


@dataclass
class PairwiseJudge:
    """A pairwise LLM judge: it reads a prompt and two responses and answers A, B or tie (align/judges/pairwise.py).
    Every pair is judged in both orders; a verdict that flips with the order is a tie. Backends: a local causal LM
    run in the stage process (`model` a directory, hub id or packaged:NAME; greedy, batched), or an OpenAI-compatible
    chat-completions endpoint (`base_url` + `model`, the key read from the environment variable `key_env`,
    never written anywhere). Answers are cached in the stage's directory (judge_cache/), keyed by judge, prompt and
    both responses: a rerun or a resumed evaluation does not ask twice."""

    name: str = name_field("llm_judge", fix="it names the judge's metrics: eval/<policy>/<name>/win_rate")
    """Names the judge's metrics (eval/<policy>/<name>/...) and its cache file."""
    model: str = ""
    """Local backend: a model directory, hub id or packaged:NAME (e.g. packaged:smollm2). Endpoint: the model's
    name at the endpoint."""
    base_url: str | None = None
    """An OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1 (null: the local backend)."""
    key_env: str | None = None
    """The environment variable that holds the endpoint's API key (its name only; the key is never written)."""
    template: str | None = None
    """A judging prompt file (relative to the pipeline) with {prompt}, {response_a} and {response_b}; null: the
    shipped one (align/templates/pairwise_judge.txt). The answer must be A, B or tie."""
    max_new_tokens: int = ranged(8, ge=1)
    """Longest answer; an answer that is not exactly A, B or tie is invalid (counted, never guessed)."""
    batch_size: int = ranged(16, ge=1)
    """Local backend: judging prompts per generate call."""
    max_concurrency: int = ranged(4, ge=1)
    """Endpoint: requests in flight at once, per process (a stage over several processes judges a share on each)."""
    timeout: float = ranged(60.0, gt=0, le=WEEK_S)
    """Endpoint: seconds one request may take in all (connecting, waiting, reading the answer) before it is retried."""
    retries: int = ranged(3, ge=0)
    """Endpoint: retries of a failed request (timeouts, 429 and 5xx), with exponential backoff, or after the server's
    Retry-After or retry-after-ms (at most max_retry_wait seconds). A request refused for what it asks (HTTP 400, 413,
    422: a content filter, a prompt over the judge's context) is that pair's invalid answer, not retried."""
    max_retry_wait: float = ranged(60.0, gt=0, le=WEEK_S)
    """Endpoint: the longest a Retry-After header (or a 429's own backoff) may make a request wait before its retry."""
    deadline: float = ranged(3600.0, gt=0, le=WEEK_S)
    """Endpoint: seconds the whole judging (every policy of the stage) may take; past it the stage stops, naming this
    setting (cached answers are kept: a rerun asks only what is left)."""
    max_prompts: int | None = ranged(None, ge=1, fix="use null to judge every prompt")
    """Judge at most this many prompts per policy, a seeded uniform sample of the evaluated ones (null: all)."""
    max_invalid_fraction: float = ranged(0.2, ge=0, le=1)
    """Fail the stage when more than this fraction of answers are invalid (with examples in the log)."""

    def loads_a_model(self) -> bool:
        """A local model the stage process loads (a directory or a hub id), not an endpoint's or a packaged one."""
        return not self.base_url and not self.model.startswith(PACKAGED)

    def check(self, where: str, base_dir: Path) -> None:
        """`align validate`: the model or endpoint is there, the key variable is set, the template exists; an
        endpoint is probed (one request naming the URL) so a wrong URL fails now, not after sampling."""
        if not self.model:
            raise ValueError(f"{where}.model: required (a local model, or the endpoint's model name)")
        if self.key_env and not self.base_url:
            raise ValueError(f"{where}.key_env: only an endpoint (base_url) takes a key")
        if self.template:
            path = (base_dir / self.template)
            if not path.is_file():
                raise ValueError(f"{where}.template: '{self.template}' not found (looked for {path.resolve()})")
            if problem := template_problem(path.read_text(encoding="utf-8")):
                raise ValueError(f"{where}.template: {path.resolve()}: {problem}")
        if self.base_url:
            if problem := url_problem(self.base_url):
                raise ValueError(f"{where}.base_url: {problem}")
            if self.key_env and not os.environ.get(self.key_env):
                raise ValueError(f"{where}.key_env: the variable {self.key_env} is not set (or empty); export "
                                 f"it with the endpoint's key before running")
            if self.key_env and (problem := header_value_problem(self.key_env)):
                raise ValueError(f"{where}.key_env: {problem}")
            if problem := endpoint_problem(self.base_url, os.environ.get(self.key_env or "", ""),
                                           min(self.timeout, 10), self.model):
                raise ValueError(f"{where}.base_url: {self.base_url}: {problem}")
        elif self.model.startswith(PACKAGED):
            from align.core.packaged import PackagedError, resolve

            try:
                resolve(self.model)
            except PackagedError as exc:
                raise ValueError(f"{where}.model: {exc}") from None
        elif (self.model.startswith((".", "/")) or (base_dir / self.model).exists()) and \
                not (base_dir / self.model / "config.json").is_file():
            raise ValueError(f"{where}.model: '{self.model}' is not a model directory (no config.json in "
                             f"{(base_dir / self.model).resolve()})")


PACKAGED = "packaged:"
TEMPLATE_FIELDS = ("{prompt}", "{response_a}", "{response_b}")


def template_problem(text: str) -> str | None:
    """What a judging prompt template lacks (None when it is usable)."""
    missing = [f for f in TEMPLATE_FIELDS if f not in text]
    if missing:
        return f"it must contain {', '.join(TEMPLATE_FIELDS)}; missing {', '.join(missing)}"
    try:
        text.format(prompt="", response_a="", response_b="")
    except (KeyError, IndexError, ValueError) as exc:
        return f"it is not a template Python's str.format fills with prompt, response_a and response_b ({exc!r}); " \
               "write literal braces as {{ and }}"
    return None
