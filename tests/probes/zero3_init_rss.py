"""What a TRL stage's rank holds in host memory when it loads a model under ZeRO-3, before and after the DeepSpeed
config exists (issue: models loaded after the DeepSpeed config so ZeRO-3's partitioned initialisation applies).

Run under `accelerate launch --config_file pipelines/accelerate/zero3.yaml --num_processes 2` (tests/test_zero3_init.py).
Each rank loads the same checkpoint twice with the stages' loader (align.modeling.models.load_causal_lm) and reports
the growth of its resident set (VmRSS, /proc/self/status) from just before each load to just after it, with every
weight it holds read and the load's freed temporaries returned to the system: first as the stages loaded until this
change (no DeepSpeed config registered yet: whole weights on every rank), then after building the stage's TRL config
(what align.runtime.trl.training_args does now: partitioned by deepspeed.zero.Init). Rank 0 writes {before, after:
{rss_growth_bytes per rank, partitioned}, world, params} to OUT.
"""

import ctypes
import gc
import json
import sys


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def settle() -> None:
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # memory freed by temporaries goes back to the system


def measured_load(state, model_dir: str) -> dict:
    import torch.distributed as dist

    from align.modeling.models import load_causal_lm

    settle()
    state.wait_for_everyone()
    start = rss_bytes()
    model = load_causal_lm(model_dir, "float32")
    # what training touches next: every weight this rank holds (a partitioned parameter's data is its shard)
    held = sum(float(getattr(p, "ds_tensor", p.data).float().sum()) for p in model.parameters())
    settle()
    grown = rss_bytes() - start
    out = {"partitioned": all(hasattr(p, "ds_id") for p in model.parameters()),
           "params": sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters()), "checksum": held}
    growth = [None] * state.num_processes
    dist.all_gather_object(growth, grown)
    out["rss_growth_bytes"] = growth
    del model
    settle()
    return out


def main(model_dir: str, out: str) -> None:
    import torch
    from accelerate import PartialState
    from trl import SFTConfig

    from align.runtime.process import no_cpu_shm_op
    from align.runtime.trl import share_process_group_with_deepspeed

    state = PartialState(cpu=not torch.cuda.is_available())
    before = measured_load(state, model_dir)
    args = SFTConfig(output_dir="/tmp/unused", per_device_train_batch_size=1, max_steps=1, report_to="none",
                     use_cpu=not torch.cuda.is_available())  # the config first, as the stages do now
    no_cpu_shm_op()  # as a stage process does: DeepSpeed on CPU compiles no shared-memory op
    share_process_group_with_deepspeed()
    after = measured_load(state, model_dir)
    if state.is_main_process:
        with open(out, "w", encoding="utf-8") as fh:
            json.dump({"before": before, "after": after, "world": state.num_processes}, fh)
    del args
    state.wait_for_everyone()


if __name__ == "__main__":
    main(*sys.argv[1:3])
