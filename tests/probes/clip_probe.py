"""Run one PPO optimiser step (align.stages.ppo.optim.backward_and_step) on seeded tiny models and write, per
parameter group, the pre-clip gradient norm and the norm of the step taken (SGD, lr 1: the clipped gradient).
Used by tests/test_ppo_update.py on one CPU process and under `accelerate launch` with DeepSpeed ZeRO-2."""

import json
import sys

import torch
from accelerate import Accelerator, PartialState

from align.stages.ppo.optim import backward_and_step, disable_deepspeed_clipping


class Pair(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.policy, self.value = torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)

    def forward(self, x):
        return self.policy(x), self.value(x)


def main(out: str) -> None:
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
    disable_deepspeed_clipping(acc)
    model, opt = acc.prepare(model, opt)
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(99))
    x = x.chunk(state.num_processes)[state.process_index]  # each process its share of one global batch
    p, v = model(x)
    loss = 0.01 * p.pow(2).mean() + 1000.0 * v.pow(2).mean()
    with acc.accumulate(model):
        norms = backward_and_step(acc, model, opt, loss, {k: [dict(acc.unwrap_model(model).named_parameters())[n]
                                                                for n in names] for k, names in
                                                           {"policy": ["policy.weight", "policy.bias"],
                                                            "value": ["value.weight", "value.bias"]}.items()}, 1.0)
    after = acc.unwrap_model(model).state_dict()
    step = {g: sum(float((after[f"{g}.{n}"].float() - before[f"{g}.{n}"]).pow(2).sum()) for n in ("weight", "bias")) ** 0.5
            for g in ("policy", "value")}
    if state.is_main_process:
        with open(out, "w") as fh:
            json.dump({"pre_norm": norms, "step_norm": step, "world": state.num_processes}, fh)
    from align.runtime.process import leave_process_group  # as a stage process leaves (a rank can abort at exit)

    leave_process_group(0)


if __name__ == "__main__":
    main(sys.argv[1])
