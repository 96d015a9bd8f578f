"""DeepSpeed's ZeRO buffers sized from the model's width, as accelerate and transformers size them for `auto`.

accelerate builds a stage's DeepSpeed config from an accelerate YAML's `deepspeed_config:` section (as every config
in pipelines/accelerate/ does) without any bucket size, and fills a size only where a key says `auto`, so
DeepSpeed's own defaults applied: a gradient reduce bucket of 5e8 elements per trained model per GPU (ZeRO-3
allocates it when the engine starts: 1 GB in bf16; ZeRO-1/2 on the first backward, fp32 under ZeRO-1: 2 GB, twice
with `overlap_comm`), a 5e7-element prefetch bucket, and parameters under 1e5 elements kept whole on every GPU. Here
the keys a config leaves out are set to `auto` for the TRL stages (transformers' Trainer fills them from the model's
`hidden_size` h when it starts DeepSpeed: `HfTrainerDeepSpeedConfig.trainer_config_finalize`), and to the same
values for PPO's own loop, whose one engine serves two models (h: the wider of the two; accelerate's
`_prepare_deepspeed` would need a `config.hidden_size` on the module it prepares): reduce bucket h^2, prefetch
bucket 0.9 h^2, persistence threshold 10 h. At h = 4096 (Llama-3-8B) the reduce bucket is 16.8M elements (34 MB in
bf16) instead of 500M. A value the config sets, a number or `auto`, is left as it is.
"""

from __future__ import annotations

from typing import Any

# the keys transformers and accelerate size from the model's width when they say `auto`, and how
SIZED_BY_WIDTH = {
    "reduce_bucket_size": lambda h: h * h,
    "stage3_prefetch_bucket_size": lambda h: int(0.9 * h * h),
    "stage3_param_persistence_threshold": lambda h: 10 * h,
}


def width_sized(ds_config: dict[str, Any], hidden: int | None = None) -> list[str]:
    """Set each width-sized key that `ds_config["zero_optimization"]` leaves out: to `auto` (hidden None: the
    Trainer fills it), or to its value for width `hidden`, which also fills an `auto`. Returns the keys set."""
    zero = ds_config.setdefault("zero_optimization", {})
    unset = [k for k in SIZED_BY_WIDTH if k not in zero or (hidden is not None and zero[k] == "auto")]
    for key in unset:
        zero[key] = "auto" if hidden is None else SIZED_BY_WIDTH[key](hidden)
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
    """The buffer sizes a started DeepSpeed engine took (as DeepSpeed parsed its config), for the manifest; None for
    anything that is not a DeepSpeed engine."""
    if not hasattr(engine, "zero_reduce_bucket_size"):
        return None
    return {"reduce_bucket_size": int(engine.zero_reduce_bucket_size()),
            "prefetch_bucket_size": int(engine.zero_prefetch_bucket_size()),
            "param_persistence_threshold": int(engine.zero_param_persistence_threshold())}
