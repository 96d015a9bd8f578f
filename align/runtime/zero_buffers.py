"""DeepSpeed's ZeRO buffers sized from the model's width, as accelerate and transformers size them for `auto`.

accelerate builds a stage's DeepSpeed config from an accelerate YAML's `deepspeed_config:` section (as every config
in pipelines/accelerate/ does) without any bucket size, and fills a size only where a key says `auto`, so
DeepSpeed's own defaults applied: a gradient reduce bucket of 5e8 elements per trained model per GPU (ZeRO-3
allocates it when the engine starts: 1 GB in bf16; ZeRO-1/2 on the first backward, fp32 under ZeRO-1: 2 GB, twice
with `overlap_comm`), a 5e7-element prefetch bucket, and parameters under 1e5 elements kept whole on every GPU. Here
the keys a config leaves out (or sets to `auto`) get the values transformers and accelerate give `auto`, from the
trained model's width h (the wider of PPO's two models, which share one engine): reduce bucket h^2 and, under ZeRO-3,
prefetch bucket 0.9 h^2 and persistence threshold 10 h. They are set once the model is loaded and before DeepSpeed
starts (TRL stages: `train_with_resume`, before `Trainer.train`; PPO: before `prepare`), as numbers, so neither
library has to find a width itself (accelerate cannot in a vision-language model's config). At h = 4096
(Llama-3-8B) the reduce bucket is 16.8M elements (34 MB in bf16) instead of 500M. A value the config sets, under
either of DeepSpeed's spellings, is left as it is; a model with no width keeps DeepSpeed's defaults.
"""

from __future__ import annotations

from typing import Any

# the keys transformers and accelerate size from the model's width when they say `auto`, how, and DeepSpeed's other
# spelling of each (a config may use either; both at once is an error in DeepSpeed)
SIZED_BY_WIDTH = {
    "reduce_bucket_size": (lambda h: h * h, None),
    "stage3_prefetch_bucket_size": (lambda h: int(0.9 * h * h), "prefetch_bucket_size"),
    "stage3_param_persistence_threshold": (lambda h: 10 * h, "param_persistence_threshold"),
}


def width_sized(ds_config: dict[str, Any], hidden: int | None) -> list[str]:
    """Set each width-sized key that `ds_config["zero_optimization"]` leaves out or sets to `auto` to its value for
    width `hidden` (the stage-3 keys only under ZeRO-3); nothing when `hidden` is None. Returns the keys set."""
    if hidden is None:
        return []
    zero = ds_config.setdefault("zero_optimization", {})
    wanted = [k for k in SIZED_BY_WIDTH if k == "reduce_bucket_size" or str(zero.get("stage")) == "3"]
    unset = [k for k in wanted if zero.get(k, "auto") == "auto" and SIZED_BY_WIDTH[k][1] not in zero]
    for key in unset:
        zero[key] = SIZED_BY_WIDTH[key][0](hidden)
    return unset


def width(config) -> int | None:
    """A model config's width as transformers reads it for `auto`: `hidden_size`, the largest of `hidden_sizes`, or
    the same of a composite model's `text_config`; None when it has none."""
    for c in (config, getattr(config, "text_config", None)):
        if isinstance(getattr(c, "hidden_size", None), int):
            return c.hidden_size
        if getattr(c, "hidden_sizes", None):
            return max(c.hidden_sizes)
    return None


def widest(*models) -> int | None:
    """The largest width among the models' configs (a peft wrapper reads through to its base's), None when none has
    one (then DeepSpeed's defaults stay)."""
    sizes = [h for m in models if m is not None and (h := width(getattr(m, "config", None))) is not None]
    return max(sizes) if sizes else None


def in_use(engine) -> dict[str, int] | None:
    """The buffer sizes a started DeepSpeed engine took (as DeepSpeed parsed its config; the stage-3 ones under ZeRO-3
    only), for the manifest; None for anything that is not a DeepSpeed engine."""
    if not hasattr(engine, "zero_reduce_bucket_size"):
        return None
    sizes = {"reduce_bucket_size": int(engine.zero_reduce_bucket_size())}
    if engine.zero_optimization_stage() == 3:
        sizes.update(prefetch_bucket_size=int(engine.zero_prefetch_bucket_size()),
                     param_persistence_threshold=int(engine.zero_param_persistence_threshold()))
    return sizes
