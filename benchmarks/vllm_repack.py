"""What is left of a CPU weight sync read where the weights lie, and whether the engine could skip it: vLLM's CPU
backend packs every linear layer's weight into a oneDNN handle, and a sync must pack them again. Measures, in one
in-process engine on the packaged SmolLM2 (fp32): the packing (`process_weights_after_loading` on every layer
align's in-place load touches), the copy of every weight into the engine's, and sampling speed with the oneDNN
handles against `torch.nn.functional.linear` on the kept weights (what serving without packing would give), and
the packing again in two threads (whether a sync could pack layers side by side).

    .venv-vllm/bin/python benchmarks/vllm_repack.py        # vLLM's own environment (./launch.sh --vllm)

Results: docs/benchmarks.md, "Could the engine skip its repacking?".
"""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "align" / "engines" / "vllm_side"))
MODEL = Path(os.environ.get("ALIGN_CACHE", Path.home() / ".cache" / "align")) / "models" / "smollm2" / "hf"


def main() -> None:
    import torch

    import align_vllm_worker as worker

    worker.keep_cpu_weights()
    from vllm import LLM, SamplingParams

    llm = LLM(str(MODEL), dtype="float32", enforce_eager=True, max_model_len=256, seed=0)
    model = llm.llm_engine.model_executor.driver_worker.worker.model_runner.get_model()
    layers = list({id(m): m for ms in worker._owners(model).values() for m in ms}.values())
    params = list(model.parameters())
    copies = [p.detach().clone() for p in params]
    for _ in range(3):
        t0 = time.perf_counter()
        with torch.no_grad():
            for m in layers:
                m.quant_method.process_weights_after_loading(m)
        t1 = time.perf_counter()
        with torch.no_grad():
            for p, c in zip(params, copies):
                p.copy_(c)
        t2 = time.perf_counter()
        with torch.no_grad(), ThreadPoolExecutor(2) as pool:  # the same packing, two layers at a time
            list(pool.map(lambda m: m.quant_method.process_weights_after_loading(m), layers))
        t3 = time.perf_counter()
        print(f"pack {t1 - t0:.3f} s ({len(layers)} layers; in 2 threads {t3 - t2:.3f} s), copy {t2 - t1:.3f} s "
              f"({sum(p.numel() * p.element_size() for p in params) / 1e6:.0f} MB)", flush=True)
    packed = {id(m): m.cpu_linear for m in layers if hasattr(m, "cpu_linear")}
    prompts = [f"Review {i}: the film was" for i in range(32)]
    params_ = SamplingParams(max_tokens=48, temperature=1.0, ignore_eos=True)

    def plain(x, weight, bias):
        return torch.nn.functional.linear(x, weight, bias)

    for _ in range(2):
        for label, kernel in (("oneDNN", None), ("F.linear", plain)):
            for m in layers:
                if id(m) in packed:
                    m.cpu_linear = packed[id(m)] if kernel is None else kernel
            llm.generate(prompts[:4], params_, use_tqdm=False)  # warm-up
            rates = []
            for _ in range(3):
                t0 = time.perf_counter()
                out = llm.generate(prompts, params_, use_tqdm=False)
                rates.append(sum(len(o.outputs[0].token_ids) for o in out) / (time.perf_counter() - t0))
            print(f"{label}: {', '.join(f'{r:.0f}' for r in rates)} tokens/s", flush=True)


if __name__ == "__main__":
    main()
