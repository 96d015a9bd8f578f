"""Run one PPO optimiser step (align.stages.ppo.optim.backward_and_step) on seeded tiny models and write, per
parameter group, the pre-clip gradient norm and the norm of the step taken (SGD, lr 1: the clipped gradient), how
many whole-gradient gathers (`safe_get_full_grad`, `get_full_hp_grad`) and all-reduces the step made, then a
second step whose loss is NaN: whether it was skipped and the weights left as they were. Used by
tests/test_ppo_update.py on one CPU process and under `accelerate launch` with DeepSpeed ZeRO-2 (and ZeRO-3)."""

import json
import sys

import torch
from accelerate import Accelerator, PartialState

from align.stages.ppo.optim import backward_and_step, disable_deepspeed_clipping
from align.runtime.process import no_cpu_shm_op


class Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.policy, self.value = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.policy(x), self.value(x)


def counting(module, name: str, calls: dict[str, int]) -> None:
    """Count the calls of module.name (wrapped in place)."""
    original = getattr(module, name)

    def wrapper(*args, **kwargs):
        calls[name] = calls.get(name, 0) + 1
        return original(*args, **kwargs)

    setattr(module, name, wrapper)


def main(out: str) -> None:
    import importlib

    no_cpu_shm_op()  # as a stage process does: DeepSpeed on CPU compiles no shared-memory op

    calls: dict[str, int] = {}
    counting(importlib.import_module("deepspeed.utils"), "safe_get_full_grad", calls)
    # bound to each parameter when the optimiser links it (in prepare, below): patched where it is bound from
    counting(importlib.import_module("deepspeed.utils.mixed_precision_linkage"), "get_full_hp_grad", calls)
    state = PartialState(cpu=not torch.cuda.is_available())
    torch.manual_seed(1234)
    model = Pair()
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    groups = {"policy": list(model.policy.parameters()), "value": list(model.value.parameters())}
    opt = torch.optim.SGD([{"params": groups["policy"]}, {"params": groups["value"]}], lr=1.0)
    acc = Accelerator()
    plugin = acc.state.deepspeed_plugin
    if plugin is not None:
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 16 // state.num_processes
        if len(sys.argv) > 2:  # e.g. fp32: bf16 weights with fp32 gradient accumulation (DeepSpeed's BF16_Optimizer
            plugin.deepspeed_config["data_types"] = {"grad_accum_dtype": sys.argv[2]}  # under ZeRO-1)
    disable_deepspeed_clipping(acc)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(99))
    x = x.chunk(state.num_processes)[state.process_index]  # each process its share of one global batch
    x = x.to(next(acc.unwrap_model(model).parameters()).dtype)  # bf16 weights under DeepSpeed's bf16
    p, v = model(x)
    p, v = p.float(), v.float()
    loss = 0.01 * p.pow(2).mean() + 1000.0 * v.pow(2).mean()
    named = dict(acc.unwrap_model(model).named_parameters())
    groups = {k: [named[n] for n in names] for k, names in {"policy": ["policy.weight", "policy.bias"],
                                                           "value": ["value.weight", "value.bias"]}.items()}
    counting(torch.distributed, "all_reduce", calls)
    with acc.accumulate(model):
        norms = backward_and_step(acc, model, opt, loss, groups, 1.0)
    gathers = {k: calls.get(k, 0) for k in ("safe_get_full_grad", "get_full_hp_grad")}
    reduces = calls.pop("all_reduce", 0)
    after = full_state(acc, model)
    step = {g: sum(float((after[f"{g}.{n}"].float() - before[f"{g}.{n}"]).pow(2).sum()) for n in ("weight", "bias")) ** 0.5
            for g in ("policy", "value")}
    p, v = model(x)  # a non-finite loss: the step is skipped, whatever the backend
    with acc.accumulate(model):
        nan = backward_and_step(acc, model, opt, p.sum() * float("nan") + v.sum(), groups, 1.0)
    unchanged = all(torch.equal(full_state(acc, model)[k], after[k]) for k in after)
    if state.is_main_process:
        with open(out, "w") as fh:
            json.dump({"pre_norm": norms, "step_norm": step, "world": state.num_processes, "gathers": gathers,
                       "optimizer": type(getattr(model, "optimizer", opt)).__name__,
                       "dtype": str(next(acc.unwrap_model(model).parameters()).dtype),
                       "all_reduces_in_step": reduces, "nan_skipped": nan.get("skipped", 0.0),
                       "nan_weights_unchanged": unchanged}, fh)
    from align.runtime.process import leave_process_group  # as a stage process leaves (a rank can abort at exit)

    leave_process_group(0)


def full_state(acc, model) -> dict[str, torch.Tensor]:
    """The whole weights (gathered under ZeRO-3), copied."""
    unwrapped = acc.unwrap_model(model)
    params = list(unwrapped.parameters())
    if hasattr(params[0], "ds_id"):
        import deepspeed

        with deepspeed.zero.GatheredParameters(params):
            return {k: v.detach().clone() for k, v in unwrapped.state_dict().items()}
    return {k: v.detach().clone() for k, v in unwrapped.state_dict().items()}


if __name__ == "__main__":
    main(sys.argv[1])  # [grad_accum_dtype]
