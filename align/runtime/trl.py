"""Glue between align's stages and the TRL / transformers Trainers (SFT, reward, DPO, GRPO, RLOO): metric names, the
metrics callback, the shared TrainingArguments, the length check and resumable training."""

from __future__ import annotations

import math
import os
import time
from typing import Any, Callable

from align.config import TrainedStage
from align.core import faults
from align.core.console import verbose
from align.data.lengths import enforce
from align.core.checkpoints import durable_rows
from align.core.tracking import keep_metrics_until
from align.runtime.context import NonFiniteLossError, StageContext, StageError, checkpoint_step, startup_done
from align.runtime.resume import AlreadyTrained, durable_checkpoints, run_loss, stop_at_max_steps
from align.runtime.zero_buffers import in_use, widest, width_sized

# TRL's plural reward metrics under align's singular names (docs/ARCHITECTURE.md, "Metric names").
_PLURALS = {"rewards/margins": "rewards/margin", "rewards/accuracies": "rewards/accuracy"}
_RENAME = {"loss": "train/loss", "learning_rate": "train/learning_rate", "grad_norm": "train/grad_norm",
           "epoch": "train/epoch", **_PLURALS,
           # transformers' end-of-training mean loss covers this attempt's steps only (a resumed run's last ones):
           # a loss, not a performance figure (it was perf/loss); the run's mean is train/loss_final_avg
           "train_loss": "train/attempt_mean_loss"}


def metric_name(key: str) -> str:
    """Map TRL/transformers log keys to align's metric names (docs/ARCHITECTURE.md)."""
    if key in _RENAME:
        return _RENAME[key]
    if key.startswith("eval_"):  # trainer.evaluate()'s keys: the same singular names
        return "eval/" + _PLURALS.get(key[5:], key[5:])
    if key.startswith("train_"):
        return "perf/" + key[6:]
    return key if "/" in key else f"train/{key}"


# GRPO's and RLOO's own log keys (their stages only: SFT's `entropy`, for one, stays train/entropy).
_ONLINE_RL = {"reward": "objective/scores", "reward_std": "objective/scores_std", "kl": "objective/kl_per_token",
              "entropy": "policy/entropy", "completions/mean_length": "rollout/response_length"}


def online_rl_metric_name(key: str) -> str:
    """GRPO/RLOO log keys under align's names: TRL's `reward` (the weighted score) is objective/scores, its `kl`
    (mean per-token KL to the reference) objective/kl_per_token (not objective/kl: PPO's, in nats per response, ~100x
    larger at 100 tokens, and `align status` showed both as objective/kl_last), one
    judge's `rewards/<judge>/mean` objective/scores/<judge>; everything else as `metric_name`."""
    if key in _ONLINE_RL:
        return _ONLINE_RL[key]
    parts = key.split("/")
    if len(parts) == 3 and parts[0] == "rewards" and parts[2] in ("mean", "std"):
        return f"objective/scores{'_std' if parts[2] == 'std' else ''}/{parts[1]}"
    return metric_name(key)


def eval_metrics(ev: dict[str, float]) -> dict[str, float]:
    """`trainer.evaluate()`'s loss and reward metrics under align's names (eval/loss, eval/rewards/margin, ...), for
    the final metrics: the metrics callback has already logged them."""
    return {metric_name(k): v for k, v in ev.items() if k.startswith("eval_rewards/") or k == "eval_loss"}


def metrics_callback(ctx: StageContext, name: Callable[[str], str] = metric_name):
    """A TrainerCallback that writes every log to metrics.jsonl/W&B (keys renamed by `name`) and stops on a
    NaN/inf loss."""
    from transformers import TrainerCallback  # heavy: stage processes only

    class AlignMetrics(TrainerCallback):
        loss: float | None = None
        tokens: float | None = None  # TRL's running count of trained tokens (non-padding), at the last log
        started = None

        def __init__(self):
            self.marks: list = []  # each optimiser step's (begin, end): forward, backward and update; no save or eval

        @property
        def step_seconds(self) -> list[float]:
            return [_seconds(a, b) for a, b in self.marks]

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = _mark()

        def on_step_end(self, args, state, control, **kwargs):
            if self.started is not None:
                self.marks.append((self.started, _mark()))
            if state.is_world_process_zero:
                ctx.progress(state.global_step, state.max_steps, loss=self.loss)

        def on_log(self, args, state, control, logs=None, **kwargs):
            logs = logs or {}
            if "loss" in logs and faults.nan_loss(state.global_step):  # the crash-safety tests' switch
                logs["loss"] = float("nan")
            loss = logs.get("loss")
            if loss is not None and not math.isfinite(float(loss)):
                raise NonFiniteLossError(
                    f"stage '{ctx.name}': loss is {loss} at step {state.global_step}; stopping. The last good "
                    f"checkpoint is kept in {ctx.checkpoints} (lower the learning rate or check the data).")
            if loss is not None:
                self.loss = float(loss)
            if hasattr(getattr(kwargs.get("train_dataloader"), "collate_fn", None), "count_first"):
                logs.pop("num_tokens", None)  # TRL reads a packed row's width: train_with_resume counts instead
            if "num_tokens" in logs:
                self.tokens = float(logs["num_tokens"])
            if state.is_world_process_zero:
                ctx.log({name(k): v for k, v in logs.items() if isinstance(v, (int, float))},
                        step=state.global_step)

    return AlignMetrics()


def _mark():
    """A point in the step's time: on a GPU a CUDA event recorded on the current stream (a step's kernels run after
    its Python returns; an event times them without making the host wait, as a synchronize per step would), else
    time.perf_counter()."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event
    return time.perf_counter()


def _seconds(begin, end) -> float:
    """Seconds between two `_mark`s (read once training is over: the events have long completed)."""
    if isinstance(begin, float):
        return end - begin
    end.synchronize()
    return begin.elapsed_time(end) / 1000.0


def step_metrics(step_seconds: list[float]) -> dict[str, float]:
    """perf/step_seconds: the mean optimiser step after the first (which compiles kernels: Liger's Triton, autotuning)
    as `metrics_callback` timed it, from step begin to step end: checkpoint saves, evaluations and logging left out,
    and so is fetching and collating the step's batches (transformers does it before the step begins); the steady rate
    MFU is taken at (benchmarks/gpu.py). perf/first_step_seconds beside it. Nothing with fewer than two steps."""
    if len(step_seconds) < 2:
        return {}
    rest = step_seconds[1:]
    return {"perf/step_seconds": sum(rest) / len(rest), "perf/first_step_seconds": step_seconds[0]}


def trainer_kwargs(cfg: TrainedStage, ctx: StageContext) -> dict[str, Any]:
    """The TRL/transformers TrainingArguments that every trained stage shares."""
    import torch  # heavy: stage processes only

    startup_done()  # the imports are done (a builtin model is built, not loaded through the context)
    cfg.check_steps()  # the same check `align validate` runs, in case the stage is started directly
    liger = liger_on(cfg.liger, ctx.compute.device)
    ctx.note(kernels={"liger": liger, "torch_compile": cfg.torch_compile})  # as resolved for this machine
    return dict(
        output_dir=str(ctx.checkpoints), learning_rate=cfg.learning_rate, lr_scheduler_type=cfg.lr_scheduler,
        warmup_steps=cfg.warmup_ratio, weight_decay=cfg.weight_decay, num_train_epochs=cfg.epochs,
        max_steps=cfg.max_steps if cfg.max_steps is not None else -1, per_device_train_batch_size=cfg.per_device_batch_size,
        per_device_eval_batch_size=cfg.per_device_batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps, logging_steps=cfg.logging_steps,
        max_grad_norm=cfg.max_grad_norm if cfg.max_grad_norm is not None else 0.0,
        # transformers' own rotation (save_total_limit) removes older checkpoints on the main process as soon as it
        # has written, before the others have and before anything reached the disk: `durable_checkpoints` rotates.
        save_strategy="steps", save_steps=cfg.save_steps, save_total_limit=None, report_to="none", seed=ctx.seed,
        data_seed=ctx.seed, use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0,
        disable_tqdm=not verbose(),  # the runner draws one bar per stage from ctx.progress (align/core/console.py)
        # The pipeline's `precision` (align/modeling/compute.py; TRL's own default, bf16 everywhere, is ~6x slower on CPUs
        # without bf16 units).
        bf16=ctx.compute.mixed_precision == "bf16", fp16=ctx.compute.mixed_precision == "fp16",
        max_length=cfg.max_length, logging_first_step=False,
        # transformers replaces a non-finite step loss with the running average (0.0 right after a log): the NaN stop
        # (metrics_callback) never saw one, and the NaN weights trained on and were checkpointed over the good ones
        logging_nan_inf_filter=False,
        # TRL >= 1.16 turns gradient checkpointing on in every config; align leaves it to the stage setting
        # (off: the demo's SFT steps take about half the time without recomputation).
        activation_checkpointing=cfg.gradient_checkpointing,
        use_liger_kernel=liger, torch_compile=cfg.torch_compile,
    )


def liger_on(setting: str, device) -> bool:
    """Whether the stage's `liger` setting (auto | on | off) turns Liger kernels on for this process: auto on a CUDA
    device with liger-kernel installed; on refused where Triton cannot run them."""
    from importlib.util import find_spec

    installed = find_spec("liger_kernel") is not None
    if setting == "on" and (device.type != "cuda" or not installed):
        raise StageError("liger: on, but Liger's Triton kernels need a CUDA GPU and the liger-kernel package "
                         f"(device {device}, liger-kernel {'installed' if installed else 'not installed'}); set "
                         "liger: auto (on where they can run) or off")
    return setting == "on" or (setting == "auto" and device.type == "cuda" and installed)


def training_args(config_cls, cfg: TrainedStage, ctx: StageContext, drop: tuple[str, ...] = (), **extra: Any):
    """The TRL config of the stage, built before any model is loaded: under DeepSpeed it registers the stage's
    DeepSpeed config with transformers, so under ZeRO-3 every model loaded after it is partitioned as it loads
    (deepspeed.zero.Init: each rank holds 1/N of the weights, never a whole copy in host RAM; a model loaded
    before would be materialised whole by every rank first). `drop`: shared arguments the trainer does not take."""
    kwargs = trainer_kwargs(cfg, ctx)
    for key in drop:
        del kwargs[key]
    args = config_cls(**kwargs, **extra)
    share_process_group_with_deepspeed()
    return args


def _padding_metrics(trainer) -> tuple[dict[str, float], float]:
    """perf/padding_fraction (of the tokens computed, padding) and perf/padding_fraction_unpacked (of the same
    batches padded), summed over processes: from SFT's row collator (the batches trained on: the data loader
    fetches one ahead) or from the policy backbone's packed forwards (install_padding_free); and the real
    (non-padding) tokens among them (0 when nothing was packed)."""
    import torch  # heavy: stage processes only

    from align.modeling.packing import backbone_counts

    if hasattr(trainer.data_collator, "count_first"):
        local = trainer.data_collator.count_first(trainer.state.global_step * trainer.args.gradient_accumulation_steps)
    else:
        local = backbone_counts(trainer.model)
    if local is None:
        return {}, 0.0
    real, computed, padded = trainer.accelerator.reduce(
        torch.tensor(local, dtype=torch.float64, device=trainer.accelerator.device), "sum").tolist()
    if not computed:
        return {}, 0.0
    return {"perf/padding_fraction": 1.0 - real / computed, "perf/padding_fraction_unpacked": 1.0 - real / padded}, real


def share_process_group_with_deepspeed() -> None:
    """Under ZeRO-3, models load inside deepspeed.zero.Init, which reads the world size from DeepSpeed's own comm
    layer; on CPU (gloo) nobody has initialised it, so it would count 1 process (and keep whole weights). Hand it
    the process group accelerate already made."""
    if os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") != "3":
        return
    import deepspeed  # heavy: only under ZeRO-3

    if not deepspeed.comm.is_initialized():
        deepspeed.init_distributed()


def check_lengths(ctx: StageContext, rows: list[dict[str, Any]], tokenizer) -> None:
    """Count examples longer than max_length after templating (align/data/lengths.py, by the stage type's
    LENGTH_RULE, over its `length_rows`), before any training step; record the counts in the manifest and stop
    when too many would be truncated or dropped."""
    cfg: TrainedStage = ctx.cfg  # type: ignore[assignment]
    report = cfg.LENGTH_RULE.measure(ctx.name, cfg.length_rows(rows), tokenizer, cfg.max_length)
    ctx.extra_manifest["length_check"] = report.as_dict()
    if ctx.is_main:
        print(f"[align] length check {report.summary()}", flush=True)
    enforce(report, cfg.max_truncated_fraction)


def train_with_resume(ctx: StageContext, trainer) -> dict[str, Any]:
    """trainer.train(), resuming from the last complete checkpoint of this fingerprint if there is one."""
    ckpt = ctx.last_checkpoint()
    resumed_from = checkpoint_step(ckpt)
    if ckpt and ctx.is_main:
        print(f"[align] {ctx.name}: resuming from {ckpt} (step {resumed_from})", flush=True)
    ctx.extra_manifest["resumed_from_step"] = resumed_from
    if ctx.is_main:  # rows a killed attempt logged after its last checkpoint are logged again from there
        keep_metrics_until(ctx.dir / "metrics.jsonl", resumed_from, durable_rows(ckpt))
    plugin = trainer.accelerator.state.deepspeed_plugin
    if plugin is not None:  # buckets sized from the model, not DeepSpeed's 5e8 (align/runtime/zero_buffers.py)
        width_sized(plugin.deepspeed_config, widest(trainer.model))
    if hasattr(trainer.model, "peft_config"):  # LoRA: its rule, before train() builds the optimiser
        from align.modeling.lora import fp32_trainables, upcasts_trainables  # heavy: stage processes only
        if upcasts_trainables(ctx.compute.dtype, plugin, getattr(trainer.model, "is_loaded_in_4bit", False)):
            fp32_trainables(trainer.model)
    trainer.add_callback(stop_at_max_steps(ctx.name))
    trainer.add_callback(durable_checkpoints(ctx, ctx.cfg.save_total_limit))
    start = time.monotonic()
    try:
        out = trainer.train(resume_from_checkpoint=ckpt)
        loss_since, seconds = out.training_loss, out.metrics["train_runtime"]
    except AlreadyTrained:  # resumed from a checkpoint at max_steps: its weights are loaded, nothing is left to train
        trainer.callback_handler.on_train_end(trainer.args, trainer.state, trainer.control)
        loss_since, seconds = 0.0, time.monotonic() - start
    ctx.extra_manifest["global_step"] = trainer.state.global_step
    if (buffers := in_use(trainer.deepspeed)) is not None:
        ctx.extra_manifest["deepspeed_buffers"] = buffers
    if trainer.state.global_step == 0:
        raise StageError(f"stage '{ctx.name}' trained 0 optimiser steps (no examples, or epochs/max_steps too "
                         "small for the batch size); nothing is published")
    loss = run_loss(trainer.state.log_history, resumed_from, loss_since, trainer.state.global_step)
    final = {"train/global_step": trainer.state.global_step, "perf/train_seconds": seconds}
    if loss is not None:
        final["train/loss_final_avg"] = loss
    tokens = next((cb.tokens for cb in trainer.callback_handler.callbacks if getattr(cb, "tokens", None)), None)
    final.update(step_metrics(next((cb.step_seconds for cb in trainer.callback_handler.callbacks
                                    if hasattr(cb, "step_seconds")), [])))
    padding, real = _padding_metrics(trainer)
    final.update(padding)
    if hasattr(trainer.data_collator, "count_first"):  # RowPackingCollator's own count (TRL's: a row's width)
        tokens = real or None
    if tokens and not resumed_from:  # after a resume TRL counts from zero again: no honest total
        final["perf/train_tokens"] = tokens
        final["perf/tokens_per_s"] = tokens / seconds
    return final


def padding_free(ctx: StageContext, model, reference=None, left_padded: bool = False) -> None:
    """The stage's `padding_free` setting applied to `model` and to a frozen `reference` copy when there is one
    (install_padding_free), and what came of it for `model` in the manifest. A `left_padded` stage's batches (GRPO's,
    RLOO's prompts) leave SDPA for eager attention on a GPU where `model`'s forwards run padded
    (compute.leave_sdpa_if_padded)."""
    from align.modeling.compute import leave_sdpa_if_padded
    from align.modeling.packing import install_padding_free, set_padding_free

    on = ctx.cfg.padding_free  # type: ignore[attr-defined]
    set_padding_free(on)  # align's own forwards too (GRPO's check, reward judges, held-out scoring)
    packs = on and install_padding_free(model)
    if packs:
        ctx.extra_manifest["padding_free"] = "packed inside the backbone's forward"
    else:
        why_not = "padding_free: false" if not on else f"{type(model).__name__} does not read packed positions"
        ctx.extra_manifest["padding_free"] = f"off ({why_not})"
    if on and reference is not None:
        install_padding_free(reference)
    if left_padded and (why := leave_sdpa_if_padded(model, ctx.compute.device.type, packs, ctx.name)):
        ctx.note(attention_left_sdpa=why)
        if ctx.is_main:
            print(f"[align] {ctx.name}: {why}", flush=True)


def policy_and_reference(ctx: StageContext, path: str, lora_settings):
    """An offline preference stage's (DPO, KTO) trained policy, its frozen reference and TRL's LoRA config: with LoRA
    the reference is the policy's base with its adapters disabled (None here), otherwise a frozen copy; both padding-
    free. Call after the TRL config: under ZeRO-3 they are partitioned as they load."""
    from align.modeling.lora import peft_config

    model = ctx.load_lm(path, quantize=lora_settings.quantize, lora=lora_settings.enabled)
    lora = peft_config(lora_settings, "CAUSAL_LM")
    ref = None if lora is not None else ctx.load_lm(path, frozen=True)
    padding_free(ctx, model, ref)
    return model, ref, lora
