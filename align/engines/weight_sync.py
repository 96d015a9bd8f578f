"""What a weight sync sends to an engine that holds its own copy of the policy, and how it travels without a file.

What: the policy's weights under the names of its checkpoint (what vLLM loads), one group at a time: each decoder
layer is a group, everything outside the layers (embeddings, final norm, an untied head) is one more. Under ZeRO-3 a
group's parameters are gathered while it is sent and released after it (`deepspeed.zero.GatheredParameters`, a
collective every process joins in the same order), so no process ever holds more than one layer gathered, where a
whole-policy gather holds all of it on every GPU. A LoRA layer is sent merged (W + scale B A, peft's own
`get_delta_weight`, out of place: the training model is not touched). After the first sync of a model into an
engine only what can have changed is sent: entries computed from a parameter that trains (a LoRA layer's merged
weight, any weight under full fine-tuning); frozen weights are already in the engine from the first sync. With
`generation.lora_sync: adapter` a LoRA policy sends its adapters alone (`adapter_state`), which vLLM applies itself.

How (align/engines/buckets.py): the trainer copies the entries into one fixed bucket (`generation.sync_bucket_mib`;
a tensor larger than the bucket goes in pieces), tells the engine which bytes are which, and waits for the engine to
load them (in place, by vLLM's weight loaders, straight from the bucket) before it fills the bucket again: one bucket
in flight per process instead of a file of the whole policy (8 processes x 16 GB at 8B in bf16 before). Weights that
lie in host memory (a CPU run) need no bucket at all (`HostTensors`): the engine maps the trainer's own storages,
moved into shared memory once, and reads them where they lie; only what is computed (merged LoRA layers) or gathered
(ZeRO-3) still travels. Under ZeRO-3 with the partitions in host memory and every process on one node nothing is
gathered: each process writes its own partitions into one bucket of the node's (align/engines/node_bucket.py).
"""

from __future__ import annotations

import itertools
import math
import os
import re
import shutil
from contextlib import nullcontext
from typing import Iterator

import torch

def _peft_parts(model):
    from peft import PeftModel

    if isinstance(model, PeftModel):
        return True, model.get_base_model()
    return False, model


def _gathered(params: list[torch.nn.Parameter]):
    """Under ZeRO-3 (partitioned parameters carry `ds_id`), `params` gathered for the duration; else nothing."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        return nullcontext()
    import deepspeed  # heavy: only under ZeRO-3

    return deepspeed.zero.GatheredParameters(partitioned)


def decoder_layers(model) -> str | None:
    """The qualified name of the model's decoder layers: its shallowest `nn.ModuleList` of two or more modules
    (`model.layers` in Llama and its kin, `transformer.h` in GPT-2, Falcon, BLOOM, StarCoder, `transformer.blocks`
    in MPT; an MoE layer's experts lie deeper), the longest at that depth; None for a model without one."""
    lists = [(name.count("."), -len(module), name) for name, module in model.named_modules()
             if isinstance(module, torch.nn.ModuleList) and len(module) > 1]
    return min(lists)[2] if lists else None


def groups(model) -> list[list[str]]:
    """The model's state-dict keys in sync groups, in state-dict order: one per decoder layer (`decoder_layers`),
    the rest in one group of its own. Found by name alone (`.layers.N.`), every GPT-2-style model (`.h.N.`) was one
    group, gathered whole under ZeRO-3 on every GPU at each sync, beside the engine (a review, 2026-12-02)."""
    prefix = decoder_layers(model)
    layer = re.compile(rf"^({re.escape(prefix)}\.\d+)\.") if prefix else None
    out: dict[str, list[str]] = {}
    for key in model.state_dict(keep_vars=True):
        m = layer.match(key) if layer else None
        out.setdefault(m.group(1) if m else "", []).append(key)
    return list(out.values())


def engine_entries(model, changed_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every weight the engine loads, group by group (gathered under ZeRO-3 while the
    group is read: consume each entry before asking for the next). `changed_only`: only entries computed from a
    parameter that trains (requires_grad). Tensors stay on the model's device; a tied `lm_head` is left out (the
    engine ties it to the embedding). Checkpoint names: transformers 5 renames and fuses some families' weights as
    it loads them (Mixtral's experts: `mlp.experts.gate_up_proj` in memory, `block_sparse_moe.experts.N.w1` on disk),
    so each group is converted back as `save_pretrained` converts it (`checkpoint_names`); vLLM's loader knows only
    the checkpoint's names, and a Mixtral policy's first sync failed (a review, 2026-12-02)."""
    from peft.tuners.lora import LoraLayer

    peft, base = _peft_parts(model)
    tied = getattr(getattr(base, "config", None), "tie_word_embeddings", False)
    state = model.state_dict(keep_vars=True)
    converting = changed_only and converts_weights(base)
    for keys in groups(model):
        wanted, others = [], []
        for k in keys:
            name = k.removeprefix("base_model.model.") if peft else k
            if peft and ("lora_" in name or "modules_to_save" in name):
                continue
            layer = None
            if ".base_layer." in name:
                layer = base.get_submodule(name.split(".base_layer.")[0])
                name = name.replace(".base_layer.", ".")
            if tied and name == "lm_head.weight":
                continue
            sources = list(layer.parameters()) if layer is not None else [state[k]]
            trains = not changed_only or any(getattr(p, "requires_grad", False) for p in sources)
            (wanted if trains else others).append((k, name, layer, sources))
        if not wanted:
            continue
        if converting and not _converts_alone(base, state, wanted, wanted + others):
            wanted = wanted + others  # a fused tensor is rebuilt from all its parts, the frozen ones too
        with torch.no_grad(), _gathered([p for *_, sources in wanted for p in sources
                                         if isinstance(p, torch.nn.Parameter)]):
            yield from checkpoint_names(base, _merged(state, wanted, LoraLayer))


def _merged(state, wanted, lora_layer) -> Iterator[tuple[str, torch.Tensor]]:
    """A group's (name, tensor), each LoRA layer's active adapters merged into its weight (out of place)."""
    for k, name, layer, _ in wanted:
        v = state[k].detach()
        if isinstance(layer, lora_layer) and name.endswith(".weight") and not layer.merged:
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    v = v + layer.get_delta_weight(adapter).to(v.dtype)
        yield name, v


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    """A tensor of `t`'s whole shape (ZeRO-3's `ds_shape` where partitioned) and dtype on the meta device: no copy."""
    return torch.empty(tuple(getattr(t, "ds_shape", t.shape)), dtype=t.dtype, device="meta")


def _meta(state, entries) -> dict[str, torch.Tensor]:
    return {name: _meta_like(state[k]) for k, name, *_ in entries}


def _converts_alone(model, state, part, whole) -> bool:
    """Whether `part` of a group converts to checkpoint tensors of the names and shapes the whole group gives (on the
    meta device): a fused checkpoint tensor (sarvam's `query_key_value`) rebuilt from the trained parts alone (q and v
    under LoRA) would be a tensor of another shape under the same name."""
    from transformers.core_model_loading import revert_weight_conversion

    full = revert_weight_conversion(model, _meta(state, whole))
    return all(k in full and v.shape == full[k].shape
               for k, v in revert_weight_conversion(model, _meta(state, part)).items())


def converts_weights(model) -> bool:
    """Whether transformers renames or fuses `model`'s weights between its checkpoint and memory (Mixtral's and other
    MoE families' experts): whether `save_pretrained`'s conversion of its state dict (on the meta device: no copy,
    whatever ZeRO-3 partitioned) changes the names. Asked of the conversions' list instead, a Llama loaded by a stage
    had one (a legacy renaming that names nothing of its) and was refused the node bucket."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return False
    state = {k: _meta_like(v) for k, v in model.state_dict(keep_vars=True).items()}
    return set(revert_weight_conversion(model, state)) != set(state)


def checkpoint_names(model, entries: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """`entries` (one sync group) under the names and layout `save_pretrained` writes, by the call it makes
    (transformers' `revert_weight_conversion`: a model it does not convert comes back as it was), so the engine,
    started from the saved directory, is sent the names it loaded."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers that converts nothing: names are the checkpoint's
        yield from entries
        return
    yield from revert_weight_conversion(model, dict(entries)).items()


@torch.no_grad()
def policy_state_for_engine(model) -> dict[str, torch.Tensor]:
    """The whole state dict vLLM loads (the file transport's content): `engine_entries` as contiguous CPU copies."""
    return {name: v.to("cpu", copy=True).contiguous() for name, v in engine_entries(model)}


@torch.no_grad()
def adapter_state(model) -> tuple[dict[str, torch.Tensor], object]:
    """A peft model's active LoRA adapter as peft saves it (`get_peft_model_state_dict`: contiguous CPU copies, under
    ZeRO-3 gathered while copied) and its config: what `generation.lora_sync: adapter` sends."""
    from peft import get_peft_model_state_dict

    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    with _gathered(lora):
        state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in get_peft_model_state_dict(model).items()}
    return state, model.peft_config[model.active_adapter]


def partitioned(model) -> bool:
    return any(hasattr(p, "ds_id") for p in model.parameters())


@torch.no_grad()
def finish_gathers(entries, model) -> None:
    """After a sync failed part-way: under ZeRO-3, the rest of `entries` (an `engine_entries` iterator) read and
    dropped, so this process joins every gather the other processes' syncs still make and the failure is raised
    with them all at the same point instead of leaving them waiting in a collective."""
    if partitioned(model):
        for _ in entries:
            pass


@torch.no_grad()
def join_gathers(model, how: str) -> None:
    """At a sync of an engine another process syncs (one shared by several processes: align/engines/group.py): under
    ZeRO-3, the gathers that process's sync takes part in (collectives every process joins, in the same order), their
    tensors dropped; nothing when `model` is not partitioned. `how`: what that sync sends: "adapter" (adapter_state),
    "whole" (every weight: the file transport, a first sync) or "changed" (the weights that train)."""
    if not partitioned(model):
        return
    if how == "adapter":
        with _gathered([p for n, p in model.named_parameters() if "lora_" in n]):
            return
    for _ in engine_entries(model, changed_only=how == "changed"):
        pass


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class HostTensors:
    """Weights the engine reads where they lie (`generation.weight_sync: shared`, the trainer's weights in host memory,
    as on a CPU): no bucket copy. `split(model, entries)` passes on the entries that must travel through the bucket
    (computed ones such as merged LoRA layers, ZeRO-3's gathered copies, weights on a GPU, anything non-contiguous, a
    storage mapped from a file) and keeps, in `refs`, the others: views of a parameter's or buffer's own storage. Such
    a storage is moved once into host shared memory, in place (torch's `_share_fd_cpu_`, as torch.multiprocessing
    shares a tensor: the storage keeps its identity, so every view of it, a DeepSpeed flat buffer's parameters
    included, follows, and the optimiser goes on updating it where the engine reads it; the memory is unlinked at
    once, so nothing is left behind however the trainer exits), and its file descriptor goes to the engine once
    (`message`: passed over the engine's Unix socket after the stream's last message), which maps it read-only.
    `held` (kept by the caller from sync to sync) is data pointer -> (id, storage) for the storages the engine has
    mapped: holding them keeps their addresses from being reused by another storage; `files` (id -> bytes) names those
    this sync reads, and both sides let go of the others. The engine reads them only while the trainer waits for the
    sync's reply. Each shared storage keeps a descriptor open on each side: at most `budget` are held (a quarter of
    the open-file limit, which the engine inherits). `problem`: why nothing more is shared (FSDP, which frees and
    re-allocates parameter storages; the budget; no room in /dev/shm; a storage torch could not move): the rest goes
    through the bucket."""

    def __init__(self, held: dict, space_problem=None, budget: int | None = None):
        self.held = held
        self.space_problem = space_problem or shm_room_problem  # bytes -> why they do not fit (None when they do)
        self.budget = open_files_limit() // 4 if budget is None else budget
        self.refs: list[tuple] = []  # (name, dtype, shape, storage id, byte offset in it)
        self.files: dict[int, int] = {}
        self.new: list[tuple[int, int]] = []  # (storage id, file descriptor) the engine has not mapped yet
        self.problem = ""

    def split(self, model, entries):
        own = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers())
               if t.device.type == "cpu" and not hasattr(t, "ds_id")}
        if any(type(m).__name__.startswith(("FSDP", "FullyShardedDataParallel")) for m in model.modules()):
            self.problem = "FSDP frees and re-allocates parameter storages, which shared memory cannot follow"
        for name, tensor in entries:
            if self.problem or not self._share(name, tensor, own):
                yield name, tensor
        for ptr in [p for p, (i, _) in self.held.items() if i not in self.files]:
            del self.held[ptr]  # not read this sync: the engine lets go of it too

    def _share(self, name: str, t: torch.Tensor, own: set) -> bool:
        storage = t.untyped_storage()
        if t.device.type != "cpu" or not t.is_contiguous() or not t.numel() or storage.data_ptr() not in own:
            return False
        old = storage.data_ptr()
        known = self.held.get(old)
        if known is None or known[1].data_ptr() != old:
            if len(self.held) >= self.budget:
                self.problem = f"more weight storages than the open-file budget ({self.budget}, a quarter of the limit)"
            self.problem = self.problem or self.space_problem(storage.nbytes()) or ""
            if self.problem:
                return False
            try:
                fd, _ = storage._share_fd_cpu_()  # moves it into shared memory unless it is there
            except (AttributeError, RuntimeError) as exc:
                self.problem = f"a weight storage could not be moved into shared memory ({type(exc).__name__}: {exc})"
                self.problem = self.problem[:300]
                return False
            if fd < 0:  # a storage mapped from a file (torch.from_file): no descriptor to pass
                return False
            own.discard(old)
            own.add(storage.data_ptr())
            known = self.held[storage.data_ptr()] = (next(_IDS), storage)
            self.new.append((known[0], fd))
        self.files[known[0]] = storage.nbytes()
        self.refs.append((name, dtype_name(t.dtype), list(t.shape), known[0], t.storage_offset() * t.element_size()))
        return True

    def message(self, last: bool) -> tuple[dict, list[int]]:
        """What the stream's last message carries (the entries read where they lie, the storages they lie in, the ids
        of those new to the engine) and the file descriptors to pass after it, in that order."""
        if not last:
            return {}, []
        return {"refs": self.refs, "files": self.files, "new": [i for i, _ in self.new]}, [fd for _, fd in self.new]

    def nbytes(self) -> int:
        return sum(math.prod(shape) * getattr(torch, dtype).itemsize for _, dtype, shape, *_ in self.refs)


_IDS = itertools.count(1)


def open_files_limit() -> int:
    """This process's soft limit on open files (a large number when unlimited)."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return 2 ** 16 if soft == resource.RLIM_INFINITY or soft < 0 else soft


def shm_room_problem(needed: int, directory: str = "/dev/shm") -> str | None:
    """Why `needed` more bytes will not fit in /dev/shm, where torch moves a shared storage (None when they will,
    with 5% and 64 MiB to spare for everything else there)."""
    free = shutil.disk_usage(directory).free if os.path.isdir(directory) else 0
    if free >= needed * 1.05 + 64 * 2 ** 20:
        return None
    return (f"{directory} has {free / 2 ** 20:.0f} MiB free, too little to share a weight storage of "
            f"{needed / 2 ** 20:.0f} MiB with the engine (docker run --shm-size=... gives a container more)")
