"""What every stage process shares: its spec, run directory, manifest, tracker and checkpoint hygiene.

The runner writes `<stage>/spec.json` (align/core/rundir.py) and starts `accelerate launch -m align.cli stage
<spec>`; align/runtime/process.py `main()` runs in every process of that launch and builds this context. Only the
main process writes files; all
processes take part in saving (ZeRO-3 gathers the weights for the consolidated checkpoint).
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import gc
import json
import logging
import os
import shutil
import socket
import time
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

from align.modeling.compute import resolve as resolve_compute
from align.config import PipelineConfig, StageBase, from_dict, stage_from_dict
from align.core.console import emit_progress
from align.core.fsutil import (atomic_write_text, disk_full, output_digest, publish_dir, staging_dir, staging_path,
                          tree_bytes)
from align.core.checkpoints import choose_checkpoint, step_checkpoints
from align.data.hub import hub_revision
from align.core.rundir import Manifest, StageSpec, read_manifest, write_manifest
from align.templates import ChatTemplate
from align.core.tracking import Tracker, sweep_config

log = logging.getLogger("align")


COLLECTIVE_TIMEOUT = datetime.timedelta(hours=2)
"""How long a process waits in a collective for the others before the job fails (torch's default under NCCL and
DeepSpeed is 10 minutes; gloo's 30): some phases keep one process busy while the others wait (a judge's scoring and
a report written by the main process, held-out scoring, TRL's dataset preparation on the main process first), past
10 minutes at 8B scale. A process that fails still ends the job at once: the launcher stops the others."""
LAYOUT = "LAYOUT.json"  # in checkpoints/: the process layout that wrote them (StageContext.layout)


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN/inf loss; the last good checkpoint is kept."""


class StageError(RuntimeError):
    """A stage cannot give a meaningful result (it would train zero steps, has nothing to measure, or
    produced nothing); it is recorded as failed, never as completed."""


def checkpoint_step(ckpt: str | None) -> int:
    """The optimiser step a Trainer checkpoint `checkpoint-<step>` holds (0: none, a run from its start)."""
    return int(Path(ckpt).name.split("-")[-1]) if ckpt else 0


class StageContext:
    """Everything a stage's `run()` needs, built from spec.json."""

    def __init__(self, spec: StageSpec):
        import torch  # heavy: only stage processes build a context
        from accelerate import PartialState  # heavy: stage processes only

        self.spec = spec
        self.cfg: StageBase = stage_from_dict(spec.stage, spec.stage_name)
        self.pipeline: PipelineConfig = from_dict(
            PipelineConfig, {k: v for k, v in spec.pipeline.items() if k != "stages"}, "pipeline:")
        self.name = spec.stage_name
        self.dir = Path(spec.stage_dir)
        self.run_dir = self.dir.parent
        self.fingerprint = spec.fingerprint
        self.inputs: dict[str, str] = spec.inputs
        self.seed: int = self.cfg.seed if self.cfg.seed is not None else self.pipeline.seed
        # On CPU, PartialState must be told so: without `cpu=True` it reports 1 process on every rank under
        # the DeepSpeed launcher (measured with accelerate 1.15), and every rank would think it is the main one.
        self.state = PartialState(cpu=not torch.cuda.is_available(), timeout=COLLECTIVE_TIMEOUT)
        self.is_main = self.state.is_main_process
        self.compute = resolve_compute(self.pipeline.precision, self.pipeline.attn_implementation, self.state.device,
                                       zero3=os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") == "3")
        self.checkpoints = self.dir / "checkpoints"
        # The pipeline's chat template as planned (align/templates/): read here, never resolved again.
        self.chat_template: ChatTemplate | None = (ChatTemplate.from_dict(spec.chat_template)
                                                   if spec.chat_template else None)
        self.tracker: Tracker | None = None
        self.extra_manifest: dict[str, Any] = {}
        self.completed = False  # the manifest says completed: nothing after it may undo that (align/runtime/process.py)
        self.trained_from: str | None = None  # what the stage's trained model was loaded from (a LoRA adapter's base)
        self.trained_vocab = 0  # its embedding rows when loaded (a template that adds tokens grows them)
        self._resume_from: tuple[str | None] | None = None  # last_checkpoint's choice, made once

    # ------------------------------------------------------------------ inputs
    def input_dir(self, stage_name: str) -> Path:
        if stage_name not in self.inputs:
            raise KeyError(f"stage '{self.name}' has no input '{stage_name}' (inputs: {sorted(self.inputs)})")
        return Path(self.inputs[stage_name])

    def input_model(self, stage_name: str) -> str:
        return str(self.input_dir(stage_name) / "model")

    # ------------------------------------------------------------------ models
    def weights_dtype(self, frozen: bool, lora: bool = False) -> str:
        """The pipeline's `dtype`, with `auto` resolved for this process: bfloat16 where the stage computes in bf16
        on a GPU, for a frozen model (run forward only), a LoRA base (`lora`: frozen too; its adapters and whatever
        else it trains are fp32, align/modeling/lora.py fp32_trainables) and a model trained under DeepSpeed, whose
        optimiser keeps fp32 master weights; float32 for a model trained whole outside DeepSpeed (fp32 weights under
        bf16 autocast: mixed precision) and everywhere on a CPU."""
        if self.pipeline.dtype != "auto":
            return self.pipeline.dtype
        bf16 = self.compute.device.type == "cuda" and self.compute.mixed_precision == "bf16"
        deepspeed = str(self.state.distributed_type).endswith("DEEPSPEED")
        return "bfloat16" if bf16 and (frozen or lora or deepspeed) else "float32"

    def load_lm(self, path: str, device: bool = False, quantize: str = "none", frozen: bool = False,
                lora: bool = False):
        """A causal LM in the pipeline's dtype (`frozen`: only run forward; `lora`: the base of LoRA adapters; see
        `weights_dtype`) and attention kernel (moved to this process's device if asked: stages that do not hand the
        model to accelerate or a Trainer); `quantize: 4bit` for a QLoRA base."""
        from align.modeling.models import load_causal_lm  # heavy: stage processes only

        # QLoRA's base: loaded as a model trained whole, the 4-bit quantisation and peft's fp32 copies of the rest
        model = load_causal_lm(path, self.weights_dtype(frozen, lora and quantize == "none"),  # from its weights
                               self.pipeline.trust_remote_code, quantize, **self.compute.model_kwargs())
        return self._loaded(path, model, device, frozen)

    def _loaded(self, path: str, model, device: bool, frozen: bool):
        """A model just loaded: ZeRO-3's manifest notes if it came partitioned (zero.Init) or whole; trained: from where."""
        startup_done()
        if self.compute.distributed_zero3:
            partitioned = all(hasattr(p, "ds_id") for p in model.parameters())
            self.extra_manifest.setdefault("models_loaded", []).append({"path": path, "zero3_partitioned": partitioned})
        if not frozen:  # a hub base's snapshot read as it loaded (a shared cache's main may move before the save)
            self.trained_from, self.trained_vocab = path, model.get_input_embeddings().num_embeddings
            self.trained_revision = hub_revision(path)
        return model.to(self.compute.device) if device else model

    def load_tokenizer(self, path: str):
        """A tokenizer with the pipeline's trust_remote_code, as its model loads (`load_lm`, `load_scalar`)."""
        from align.modeling.models import load_tokenizer  # heavy: stage processes only
        return load_tokenizer(path, self.pipeline.trust_remote_code)

    def load_scalar(self, path: str, pad_token_id: int | None, device: bool = False, quantize: str = "none",
                    frozen: bool = False, lora: bool = False):
        """A scalar model (sequence classification, one output), like `load_lm`. A scalar head that the
        checkpoint does not hold (a scalar model started from a language model) is initialised
        from the stage's seed alone, on a forked RNG: the same seed gives the same head in every run, and the
        global random stream of the stage is left as it was."""
        import torch  # heavy: stage processes only

        from align.modeling.models import load_scalar_model  # heavy: stage processes only

        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            model = load_scalar_model(path, pad_token_id, self.weights_dtype(frozen, lora and quantize == "none"),
                                      self.pipeline.trust_remote_code, quantize, **self.compute.model_kwargs())
        return self._loaded(path, model, device, frozen)

    # ------------------------------------------------------------------ tracking
    def start_tracking(self, resume: bool = False) -> Tracker:
        tr, p = self.pipeline.tracking, self.pipeline
        self.tracker = Tracker(
            self.dir, main_process=self.is_main, wandb_setting=tr.wandb, project=tr.project,
            entity=tr.entity, group=f"{p.name}/{p.run_id}", name=self.name, job_type=self.cfg.type,
            config={"stage": self.spec.stage, "fingerprint": self.fingerprint,
                    "input_fingerprints": self.spec.input_fingerprints, "data_cards": self.spec.data_cards,
                    "pipeline": self.spec.pipeline, **sweep_config(self.name, p.variants)}, resume=resume)  # spec: no stages
        return self.tracker

    def log(self, metrics: dict[str, Any], step: int) -> None:
        assert self.tracker is not None
        self.tracker.log(metrics, step)

    def progress(self, n: int, total: int, **metrics: float) -> None:
        """Advance this stage's one console progress bar (align/core/console.py); main process only."""
        if self.is_main:
            emit_progress(n, total, **metrics)

    # ------------------------------------------------------------------ checkpoints
    def prepare_checkpoints(self) -> None:
        """Main process: make checkpoints/ belong to this fingerprint (checkpoints of another config are not
        resumable and are removed). Every process then waits for it."""
        stamp = self.checkpoints / "FINGERPRINT"
        if self.is_main:
            if self.checkpoints.exists() and (not stamp.is_file() or stamp.read_text() != self.fingerprint):
                shutil.rmtree(self.checkpoints)
            self.checkpoints.mkdir(parents=True, exist_ok=True)
            if not stamp.is_file():  # written once, whole (a stamp torn by a kill would cost every checkpoint)
                atomic_write_text(stamp, self.fingerprint)
            atomic_write_text(self.checkpoints / LAYOUT, json.dumps(self.layout()))
        self.state.wait_for_everyone()

    def layout(self) -> dict[str, Any]:
        """How this stage's processes are laid out: what a ZeRO checkpoint's per-rank states depend on."""
        zero = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE")
        return {"world_size": self.state.num_processes, "zero_stage": int(zero) if zero else None}

    def check_checkpoint_layout(self) -> None:
        """Before anything loads: checkpoints of this fingerprint written under another number of processes or
        another ZeRO stage cannot be resumed (DeepSpeed partitions optimiser states per rank; without ZeRO the global
        batch, the data position and each rank's RNG state depend on the number of processes); refuse with the fix
        instead of failing inside DeepSpeed, or silently training on another trajectory."""
        stamp = self.checkpoints / LAYOUT
        if not stamp.is_file() or (self.checkpoints / "FINGERPRINT").read_text() != self.fingerprint or not (
                step_checkpoints(self.checkpoints)) and not any(self.checkpoints.glob("iter-*")):
            return
        try:
            old = json.loads(stamp.read_text())
        except ValueError:
            return
        now = self.layout()
        if old == now:
            return
        raise StageError(
            f"stage '{self.name}': its checkpoints in {self.checkpoints} were written by {old.get('world_size')} "
            f"process(es) under ZeRO-{old.get('zero_stage') or 0}, and this run has {now['world_size']} under "
            f"ZeRO-{now['zero_stage'] or 0}: per-rank states (DeepSpeed's, the RNG's, the data position) do not "
            "resume under another layout. Rerun "
            f"with the same layout (stages.{self.name}.num_processes={old.get('world_size')}, or --num-processes / "
            f"the number of GPUs and nodes it had), or delete {self.checkpoints} to start the stage over")

    def last_checkpoint(self) -> str | None:
        """The Trainer checkpoint of this fingerprint to resume from (`checkpoints.choose_checkpoint`: the newest whole
        one; one killed mid-write is removed rather than resumed from). The main process chooses and tells the others
        (on a shared filesystem another node's listing may lag a deletion or a new checkpoint); once per attempt (a
        stage with an engine seeds it by the step before its trainer resumes)."""
        if self._resume_from is None:
            self.prepare_checkpoints()
            ckpt = self.main_decides(lambda: choose_checkpoint(self.checkpoints, self.state.num_processes, log))
            self._resume_from = (str(ckpt) if ckpt else None,)
        return self._resume_from[0]

    def main_decides(self, decide):
        """`decide()` run on the main process alone, its answer given to every process (a collective where there are
        several): one view of what only one should look at, such as a shared filesystem's listing."""
        answer = [decide() if self.is_main else None]
        if self.state.num_processes > 1:
            from accelerate.utils import broadcast_object_list  # heavy: stage processes only

            broadcast_object_list(answer, from_process=0)
        return answer[0]

    # ------------------------------------------------------------------ outputs
    def publish(self, name: str, write) -> None:
        """Build output `name` (e.g. model, data) in a staging dir with `write(path)` on every process (saving
        under ZeRO-3 is collective), then the main process renames it into place."""
        final = (self.dir / name).resolve()
        tmp = staging_path(final)
        try:
            if self.is_main:
                staging_dir(final)
            self.state.wait_for_everyone()
            write(tmp)
            self.state.wait_for_everyone()
            if self.is_main:
                publish_dir(tmp, final)
        except BaseException as exc:
            full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
            written = 0
            if full and self.is_main:
                with contextlib.suppress(OSError):
                    written = tree_bytes(tmp)
            if self.is_main:  # no half-written staging directory is left behind (e.g. a full disk)
                shutil.rmtree(tmp, ignore_errors=True)
            if full:
                raise disk_full(exc, final, written) from exc
            raise
        self.state.wait_for_everyone()
        if self.is_main:
            self.extra_manifest.setdefault("output_digests", {})[name] = output_digest(final)

    def save_trainer_model(self, trainer, tokenizer) -> None:
        """Consolidated HF checkpoint (ZeRO-3 gathered) + tokenizer, atomically as model/; with LoRA the adapters and
        the name of their base (`models.ADAPTER_BASE`), or with `lora.merge` (or a base built here, which no later
        stage could load) the adapters merged in."""

        def write(path: Path) -> None:
            model = trainer.model
            lora = getattr(self.cfg, "lora", None)
            adapters = hasattr(model, "merge_and_unload") and lora is not None and lora.enabled
            alone = adapters and not lora.merge and self.adapter_alone_suffices(model)
            if adapters:
                self.extra_manifest["lora_published"] = "adapter" if alone else "merged" if lora.merge else \
                    "merged: no loadable base, or the stage grew the embeddings (a template's new tokens)"
            if alone:
                trainer.save_model(str(path))  # peft: adapter_config.json and the adapter weights only
                if self.is_main:
                    self.write_adapter_base(path, model)
            elif adapters:
                from align.modeling.lora import merged_for_saving  # heavy (torch): stage processes only

                # LoRA: save full merged weights so the next stage loads a plain model with from_pretrained. Under
                # ZeRO-3 from the whole state, gathered by every process (a collective) onto the main one.
                zero3 = any(hasattr(p, "ds_id") for p in model.parameters())
                gathered = trainer.accelerator.get_state_dict(trainer.model_wrapped) if zero3 else None
                if self.is_main or not zero3:
                    merged = merged_for_saving(trainer.accelerator.unwrap_model(model), self.cfg.lora,
                                               self.weights_dtype(frozen=True), gathered, self.pipeline.trust_remote_code)
                if self.is_main:
                    merged.save_pretrained(path)
            else:
                trainer.save_model(str(path))
            if self.is_main:
                tokenizer.save_pretrained(path)

        self.publish("model", write)

    def adapter_alone_suffices(self, peft_model) -> bool:
        """Whether the adapters alone, on the model the stage loaded, give the trained model back: not when there is
        no loadable base (a builtin model built here) or the stage grew the embeddings (a chat template's new
        tokens: the base has no rows for them)."""
        from align.modeling.lora import plain_embeddings  # heavy (torch): stage processes only

        return self.trained_from is not None and \
            plain_embeddings(peft_model.get_base_model()).num_embeddings == self.trained_vocab

    def write_adapter_base(self, path: Path, peft_model) -> None:
        """Beside a saved adapter: the model it was trained on (as this stage loaded it), its task, and the token ids
        the stage set on the model's config (EOS / PAD / BOS: a chat template's end-of-turn token, a pad token)."""
        from align.modeling.models import ADAPTER_BASE  # heavy (torch): stage processes only

        config = peft_model.peft_config[peft_model.active_adapter]
        task = getattr(config.task_type, "value", config.task_type)
        base = peft_model.get_base_model()
        ids = ("eos_token_id", "pad_token_id", "bos_token_id")
        record = {"base_model": self.trained_from, "task": task, "config": {k: getattr(base.config, k, None) for k in ids},
                  "base_model_revision": getattr(self, "trained_revision", None),  # a hub base's (None: local)
                  "generation": {k: getattr(getattr(base, "generation_config", None), k, None) for k in ids}}
        (path / ADAPTER_BASE).write_text(json.dumps(record) + "\n")

    # ------------------------------------------------------------------ manifest
    def note_engine(self, engine, synced: bool = False) -> None:
        """Record a started rollout engine in the manifest (what its `describe()` says; nothing for one that describes
        nothing, the hf engine) and say on the main process that it started, and where its log is; `synced`: again
        after its first sync, which says how the weights travelled (said nowhere else)."""
        described = engine.describe()
        if not described:
            return
        self.note(engine=described)
        if self.is_main and not synced:
            print(f"[align] {self.name}: {engine.name} {described.get('version', '')} engine started in "
                  f"{described.get('startup_seconds', 0):.0f} s (log: {engine.log_path})", flush=True)

    def note(self, **values: Any) -> None:
        """Record values in the manifest now, while the stage runs (e.g. a score normalisation's gain and bias, so a
        killed attempt's manifest still says what it fixed)."""
        self.extra_manifest.update(values)
        self.write_manifest("running", new_attempt=False)

    def write_manifest(self, status: str, new_attempt: bool = True, **extra: Any) -> None:
        if not self.is_main:
            return
        old: Manifest = read_manifest(self.dir) or {}
        attempts = old.get("attempts", 0) + (1 if status == "running" and new_attempt else 0)
        spec = self.spec
        manifest: Manifest = {  # type: ignore[typeddict-item]  (stages add keys of their own)
            "stage": self.name, "type": self.cfg.type, "status": status, "fingerprint": self.fingerprint,
            "config": spec.stage, "inputs": {k: {"path": v, "fingerprint": spec.input_fingerprints[k]}
                                             for k, v in self.inputs.items()},
            "input_digests": spec.input_digests, "data_cards": spec.data_cards, "code_version": spec.code_version,
            "git_commit": spec.git_commit, "packages": package_versions(),
            "started_at": old.get("started_at") if status != "running" or not new_attempt
            else time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "attempts": attempts, "world_size": self.state.num_processes,
            "distributed_type": str(self.state.distributed_type).split(".")[-1],
            "zero_stage": int(os.environ["ACCELERATE_DEEPSPEED_ZERO_STAGE"])
            if os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE") else None,
            "process": {"pid": os.getpid(), "host": socket.gethostname(),
                        "start": "warm" if os.environ.get("ALIGN_WARM_STAGE") == "1" else "fresh"},
            **self.extra_manifest, **extra}
        if status != "running":
            manifest["ended_at"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
        write_manifest(self.dir, manifest)


def package_versions() -> dict[str, str]:
    out = {}
    for pkg in ("torch", "transformers", "trl", "accelerate", "deepspeed", "peft", "datasets", "wandb"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return out


# --------------------------------------------------------------------------------------------- start-up
def startup_done() -> None:
    """End the stage process's start-up window: the cyclic garbage collector, off since main() began, is turned
    back on, and what was imported so far is frozen out of its generations (never scanned again). Called when
    a stage loads its first model and when a Trainer's arguments are built, i.e. after the heavy imports
    (torch, transformers, trl, peft) and before training. Importing them with the collector on costs ~0.7 s
    per stage process (measured: 4.1-4.3 s vs 3.4-3.5 s to import torch, transformers and TRL's SFTTrainer,
    three runs each), nearly all of it collector passes over objects that live as long as the process. Frozen
    objects are still freed by reference counting when dropped; only a reference cycle among them would outlive
    its use, and what exists at this point (the libraries, the stage's first model) lives as long as the stage."""
    if not gc.isenabled():
        gc.enable()
        gc.freeze()
