"""PPO's weight sync under DeepSpeed ZeRO-3 (align.stages.ppo.rollouts.sync_engine): the policy's parameters are sharded over
2 processes; every process writes its own partitions into the node's bucket (align/engines/node_bucket.py; a LoRA
policy's adapters are gathered, a collective) and each engine loads the whole policy from it. Rank 0's engine is
vLLM; rank 1's records the state it was given (read from the bucket as rank 0's engine reads it). Written to OUT (by rank 0): the engine-vs-model log-prob gap
and greedy agreement before and after the sync, and whether rank 1 received the whole, unsharded weights. With a
third argument `adapter`: the policy is a LoRA model (its base as the engine starts, its adapters not), synced with
the adapters alone (generation.lora_sync: adapter), gathered under ZeRO-3 as they are read.
Used by tests/test_vllm_engine.py under `accelerate launch --config_file pipelines/accelerate/zero3.yaml`."""

import json
import sys

import torch
from accelerate import Accelerator, PartialState

from align.runtime.process import no_cpu_shm_op

SEED = 4321


class Recorder:
    """Rank 1's engine: keeps what it was sent."""

    name = "recorder"
    holds_own_weights = True

    def __init__(self, adapter: bool):
        self.adapter = adapter

    def sync_weights(self, model) -> float:
        from align.engines import node_bucket
        from align.engines.weight_sync import adapter_state, policy_state_for_engine

        node = None if self.adapter else node_bucket.for_model(model, 0, 600.0, "/dev/shm")  # as rank 0's engine
        if node is None:  # gathered (a collective every process joins)
            self.state = adapter_state(model)[0] if self.adapter else policy_state_for_engine(model)
            return 0.0
        self.state, building = {}, {}
        for pieces, _ in node.pieces(node_bucket.shares(model)):  # whole in the bucket until the next barrier
            for name, dtype, shape, total, at, offset, size in pieces:
                whole = building.setdefault(name, torch.empty(total, dtype=torch.uint8))
                whole[at:at + size].copy_(node.buffer[offset:offset + size])
                if at + size == total:
                    self.state[name] = building.pop(name).view(getattr(torch, dtype)).reshape(shape)
        return 0.0

    def close(self):
        pass


def perturbed(path, adapter: bool):
    """The policy the engine must come to sample: the model with some weights moved, or (adapter) with LoRA adapters
    whose B is not zero."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(SEED)
    if adapter:
        from peft import LoraConfig, get_peft_model

        torch.manual_seed(SEED)
        model = get_peft_model(model, LoraConfig(r=8, lora_alpha=16, target_modules="all-linear")).eval()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if ("lora_B" in n) if adapter else ("embed_tokens" in n or "layers.5." in n):
                p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return model


def main(model_dir: str, out: str, adapter: bool = False) -> None:
    no_cpu_shm_op()  # as a stage process does: DeepSpeed on CPU compiles no shared-memory op
    from align.config import Generation
    from align.engines.base import logprob_gap
    from align.engines.hf import HFEngine
    from align.modeling.generation import response_logprobs
    from align.modeling.models import load_tokenizer
    from align.engines.vllm import VLLMEngine
    from align.stages.ppo.rollouts import sync_engine
    from align.stages.ppo.models import PolicyAndValue

    state = PartialState(cpu=not torch.cuda.is_available())
    tok = load_tokenizer(model_dir)
    # Loaded before the Accelerator exists: afterwards from_pretrained would partition under zero.Init, a collective.
    reference = perturbed(model_dir, adapter)  # the whole policy, outside DeepSpeed: what the engine must match
    policy = perturbed(model_dir, adapter)  # sharded by prepare() below, as PPO's policy is
    acc = Accelerator()
    acc.state.deepspeed_plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = 1
    model = PolicyAndValue(policy, torch.nn.Linear(4, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    model, opt = acc.prepare(model, opt)
    local = sum(p.numel() for p in acc.unwrap_model(model).policy.parameters())  # 0 when sharded
    prompts = ["The movie was", "I think this film", "Honestly, the acting", "What a"]
    gen = Generation(max_new_tokens=10, temperature=1.0)

    def agree(engine):
        r = engine.generate(prompts, gen, seed=0)
        with torch.no_grad():
            lp = response_logprobs(reference, r)
        greedy = engine.generate(prompts, gen, seed=0, greedy=True).texts(tok)
        return logprob_gap(r.engine_logprobs, lp, r.response_mask)["max"], greedy == HFEngine(reference, tok).generate(
            prompts, gen, seed=0, greedy=True).texts(tok)

    engine = (VLLMEngine(model_dir, tok, seed=SEED, log_path=out + ".engine.log", lora_rank=8 if adapter else None)
              if state.is_main_process else Recorder(adapter))
    try:
        before = agree(engine) if state.is_main_process else None
        sync_engine(engine, model, acc)  # every process: gather (collective), then its own engine
        after = agree(engine) if state.is_main_process else None
    finally:
        engine.close()
    whole = None
    if not state.is_main_process:
        if adapter:
            from peft import get_peft_model_state_dict

            full = get_peft_model_state_dict(reference)
        else:
            full = reference.state_dict()
            full.pop("lm_head.weight")
        whole = set(engine.state) == set(full) and all(torch.equal(engine.state[k], full[k]) for k in full)
    wholes = acc.gather_for_metrics([whole], use_gather_object=True)
    if state.is_main_process:
        with open(out, "w") as fh:
            json.dump({"world": state.num_processes, "local_params": local, "before": before, "after": after,
                       "rank1_received_whole_weights": wholes[1]}, fh)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], adapter=sys.argv[3:] == ["adapter"])
