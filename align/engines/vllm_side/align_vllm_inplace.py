"""Loading synced weights into the engine's live model in place (vLLM's weight loaders, then each touched layer
processed again), and when a model does not allow it (`in_place_problem`: the worker then uses vLLM's
`reload_weights`). Runs inside the vLLM engine process beside align_vllm_worker.py; imports nothing from align."""

from __future__ import annotations

import time

import torch


def in_place_problem(model) -> str | None:
    """Why weights cannot be loaded into `model` in place (None: they can). In place means vLLM's weight loaders copy
    into the live parameters and each touched layer is processed again after loading: right only where that
    processing is a repeatable pack or nothing, i.e. every layer with a quant method is an unquantized linear layer
    or embedding with a plain 2-D weight it kept. Not: a quantized layer, fused MoE experts (on a CPU vLLM pads and
    repacks them into new parameters), a 3-D linear weight (a Mamba conv1d, packed in place on some CPUs), vLLM's
    LoRA wrappers, or a linear weight emptied once packed (a CPU engine started without `keep_cpu_weights`)."""
    from vllm.model_executor.layers.attention import Attention, is_deferred_attention_layer
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod
    from vllm.v1.attention.backend import AttentionImplBase

    if callable(getattr(model, "process_weights_after_loading", None)):  # vLLM's loader calls it after every layer
        return f"the model ({type(model).__name__}) processes its weights once they are loaded"
    for name, m in model.named_modules():
        if "LoRA" in type(m).__name__:
            return f"{name} is a LoRA layer ({type(m).__name__})"
        impl = getattr(m, "impl", None)  # MLA derives W_UK/W_UV from kv_b_proj, FlashInfer keeps fp32 sinks: stale
        if is_deferred_attention_layer(m) and (  # after an in-place load, which processes no attention layer
                type(m).process_weights_after_loading is not Attention.process_weights_after_loading or getattr(
                    type(impl), "process_weights_after_loading", None) not in (
                    None, AttentionImplBase.process_weights_after_loading)):
            return f"{name} ({type(m).__name__}, {type(impl).__name__}) derives weights of its own once loaded"
        method = getattr(m, "quant_method", None)
        if method is not None and not isinstance(method, (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)):
            return f"{name} ({type(m).__name__}) is processed by {type(method).__name__}"
        if isinstance(m, LinearBase):
            weight = getattr(m, "weight", None)
            if weight is None or weight.numel() == 0:
                return f"{name} keeps no weight (packed)"
            if weight.dim() != 2:
                return f"{name} has a {weight.dim()}-D weight"
    return None


def _owners(model, embedding_class=None) -> dict[int, list]:
    """id(parameter) -> the layers that own it and are processed after loading (have a quant method). An input
    embedding whose parameter a head shares (tied) is left out: on a CPU its processing packs a oneDNN handle for
    `apply`, which the tied head (processed, as it owns the same parameter) serves instead; an embedding that is also
    its model's head (Gemma 2, Command R compute logits with `embed_tokens`) is tied to no head module and kept.
    `embedding_class`: vLLM's VocabParallelEmbedding (a stand-in in tests)."""
    if embedding_class is None:
        from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding as embedding_class

    owners: dict[int, list] = {}
    for m in model.modules():
        if getattr(m, "quant_method", None) is not None:
            for p in m._parameters.values():
                if p is not None:
                    owners.setdefault(id(p), []).append(m)
    for key, layers in owners.items():
        heads = [m for m in layers if type(m) is not embedding_class]
        if heads and len(heads) < len(layers):  # a tied input embedding: its head is packed instead
            owners[key] = heads
    return owners


def load_in_place(model, chunks, owners: dict[int, list]) -> tuple[int, float]:
    """`chunks(consume)` hands lists of (checkpoint name, tensor) to `consume`; each list goes through the model's
    own `load_weights` (vLLM's weight loaders copy into the live parameters, fusing q/k/v and gate/up as at start-up).
    Then every layer owning a loaded parameter (`owners`: id(parameter) -> layers) is processed again as after loading,
    once (on a CPU: its oneDNN handle packed from the new weight; a tied head owns the embedding's parameter). Packing
    each layer while the trainer fills the next bucket was measured slower on 2 cores (the two contend), so it waits
    for the end. Returns (tensors received, seconds spent processing)."""
    params = dict(model.named_parameters())
    received = 0
    touched: dict[int, object] = {}

    def consume(items):
        nonlocal received
        received += len(items)
        for name in model.load_weights(items) or ():
            for m in owners.get(id(params[name]), ()) if name in params else ():
                touched[id(m)] = m

    chunks(consume)
    t0 = time.perf_counter()
    with torch.no_grad():
        for m in touched.values():
            m.quant_method.process_weights_after_loading(m)
    return received, time.perf_counter() - t0
