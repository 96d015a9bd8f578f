"""How a stage is launched: its accelerate config, its process count, and the command line.

Each stage runs as its own `accelerate launch -m align.cli stage <spec.json>` process group with the stage's
accelerate config (pipelines/accelerate/*.yaml); a stage on one plain process skips the launcher.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from align.config import StageBase
from align.core.console import verbose
from align.orchestrator.memory import enabled_lora
from align.orchestrator.plan import REPO_DIR, StagePlan
from align.core.errors import PipelineError
from align.core.rundir import read_manifest

ACCELERATE_TYPES = ("NO", "MULTI_GPU", "MULTI_CPU", "DEEPSPEED", "FSDP")


@dataclass
class MultiNode:
    """Where this `align run` sits in a multi-node job (one runner per machine; see launch.sh)."""

    nodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int = 29500
    rdzv_timeout: int = 600

    def check(self) -> None:
        if self.nodes < 1:
            raise PipelineError(f"--nodes {self.nodes}: must be >= 1")
        if not 0 <= self.node_rank < self.nodes:
            raise PipelineError(f"--node-rank {self.node_rank}: must be in 0..{self.nodes - 1} for --nodes {self.nodes}")
        if self.nodes > 1 and not self.master_addr:
            raise PipelineError("--nodes > 1 needs --master-addr (the address of node 0; launch.sh sets it from "
                                "SLURM_JOB_NODELIST under SLURM)")
        if self.rdzv_timeout < 1:
            raise PipelineError(f"--rdzv-timeout {self.rdzv_timeout}: must be >= 1 second")
        if not 1 <= self.master_port <= 65535:
            raise PipelineError(f"--master-port {self.master_port}: not a TCP port; give 1 to 65535")
        if self.nodes > 1:  # before any stage runs: an unknown host otherwise surfaced after the stages before it
            import socket

            try:
                socket.getaddrinfo(self.master_addr, self.master_port)
            except (OSError, UnicodeError) as exc:
                raise PipelineError(f"--master-addr {self.master_addr}: cannot be resolved from this machine "
                                    f"({exc}); give node 0's hostname or IP address") from None

    @property
    def is_main(self) -> bool:
        return self.node_rank == 0


# --------------------------------------------------------------------------------------------- configs
def accelerate_config(name: str, source: str | Path) -> Path:
    """A config name (beside the pipeline under accelerate/, else pipelines/accelerate/) or a path: relative to the
    pipeline file, as a data card's is (else to the working directory, where it was read from before)."""
    here = Path(source).resolve().parent
    if "/" in name or name.endswith((".yaml", ".yml")):
        for candidate in (here / name, Path(name)):
            if candidate.is_file():
                return candidate.resolve()
        raise PipelineError(f"accelerate config '{name}' not found: a path is read relative to the pipeline file "
                            f"({here / name})")
    for candidate in (here / "accelerate" / f"{name}.yaml", REPO_DIR / "pipelines" / "accelerate" / f"{name}.yaml"):
        if candidate.is_file():
            return candidate.resolve()
    raise PipelineError(f"accelerate config '{name}' not found (pipelines/accelerate/{name}.yaml, or a path to a "
                        "file relative to the pipeline)")


def yaml_load(path: Path) -> Any:
    """An accelerate config as plain YAML."""
    return yaml.safe_load(path.read_text(encoding="utf-8"))


def check_accelerate(plan: StagePlan, source: str | Path, precision: str = "auto") -> None:
    """The stage's accelerate config exists, is one, and sets none of the stage's own settings to another value
    (checked here, not when the stage launches)."""
    where = f"{source}: stages.{plan.name}.accelerate"
    try:
        path = accelerate_config(plan.cfg.accelerate, source)
    except PipelineError as exc:
        raise PipelineError(f"{where}: {exc}") from None
    try:
        raw = yaml_load(path)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise PipelineError(f"{where}: {path} is not a readable YAML file ({type(exc).__name__})") from None
    if isinstance(raw, dict) and raw.get("distributed_type") is False:  # YAML reads a bare NO as false
        raise PipelineError(f"{where}: {path}: distributed_type: NO unquoted is YAML's false; write "
                            "`distributed_type: 'NO'` (quoted)")
    if not isinstance(raw, dict) or str(raw.get("distributed_type", "")).upper() not in ACCELERATE_TYPES:
        raise PipelineError(f"{where}: {path} is not an accelerate config (it needs `distributed_type:` one of "
                            f"{', '.join(ACCELERATE_TYPES)}); name one of pipelines/accelerate/*.yaml")
    if raw["distributed_type"] not in ACCELERATE_TYPES:  # accelerate reads it case-sensitively, at launch only
        raise PipelineError(f"{where}: {path}: distributed_type: {raw['distributed_type']!r}; accelerate takes it "
                            f"as written and refuses this when the stage launches: write "
                            f"{str(raw['distributed_type']).upper()}")
    try:  # first: its ZeRO stage is read as a number below
        mode, _ = accelerate_mode(path)
    except PipelineError as exc:
        raise PipelineError(f"{where}: {exc}") from None
    problems = owned_setting_problems(plan, path, raw, precision, source) + _placement_keys(raw, path)
    lora = enabled_lora(plan.cfg)
    if lora is not None and lora.quantize != "none" and mode.startswith("zero3"):
        problems.append(f"lora.quantize: {lora.quantize} under ZeRO-3 ({path.name}): transformers loads a 4-bit base "
                        "onto each process's GPU with a device map, which ZeRO-3's partitioning refuses as the model "
                        "loads; the 4-bit base is small: use accelerate: zero2 (or ddp)")
    problem = plan.cfg.mode_problem(mode)  # a stage type's own rule for a mode
    if problem:
        problems.append(problem)
    if (n := plan.cfg.num_processes) and n > 1 and getattr(type(plan.cfg), "ONE_PROCESS", False):
        problems.append(f"num_processes: {n}, but a {plan.cfg.type} stage runs one process whatever its accelerate "
                        "config (it trains nothing to distribute); set num_processes: 1 (or leave it unset)")
    elif n and n > 1 and str(raw["distributed_type"]).upper() == "NO":
        problems.append(f"num_processes: {n} with accelerate: {plan.cfg.accelerate} ({path.name}), which runs one "
                        "process (distributed_type NO): the others would never start; use accelerate: ddp, zero2 or "
                        "zero3 for several processes, or num_processes: 1")
    if problems:
        raise PipelineError(f"{source}: stages.{plan.name}: " + "; ".join(problems))


# The pipeline's `precision` as accelerate's `mixed_precision` spells it (auto: decided in the stage process).
_MIXED_PRECISION = {"float32": "no", "bfloat16": "bf16", "float16": "fp16"}


def _deepspeed_values(path: Path, raw: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """The DeepSpeed settings an accelerate config fixes, and where they are written: its `deepspeed_config:`
    section, or the JSON file its `deepspeed_config_file` names (DeepSpeed's own spelling, `auto` = not fixed)."""
    ds = raw.get("deepspeed_config") or {}
    file = ds.get("deepspeed_config_file") if isinstance(ds, dict) else None
    if not file:
        ds = ds if isinstance(ds, dict) else {}
        return {**ds, "zero3_saves_whole": int(ds.get("zero_stage", 0) or 0) != 3 or
                ds.get("zero3_save_16bit_model") in (True, "true", "True")}, str(path)
    conf, json_path = _deepspeed_json(path, file)
    values = {k: conf[k] for k in ("gradient_accumulation_steps", "gradient_clipping") if k in conf}
    zero = conf.get("zero_optimization") if isinstance(conf.get("zero_optimization"), dict) else {}
    values["zero3_saves_whole"] = zero.get("stage") != 3 or zero.get("stage3_gather_16bit_weights_on_model_save") is True
    # ("auto" takes accelerate's zero3_save_16bit_model, false unless the accelerate config sets it)
    for kind in ("bf16", "fp16"):
        if isinstance(conf.get(kind), dict) and conf[kind].get("enabled") not in (None, "auto", False):
            values["mixed_precision"] = kind
    return values, str(json_path)


def _deepspeed_json(path: Path, file: str) -> tuple[dict[str, Any], Path]:
    """The DeepSpeed JSON an accelerate config's `deepspeed_config_file` names (relative to the config), and its path."""
    json_path = Path(file) if Path(file).is_absolute() else path.parent / file
    try:
        conf = json.loads(json_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise PipelineError(f"{path}: deepspeed_config_file: {json_path} is not a readable JSON file "
                            f"({type(exc).__name__})") from None
    if not isinstance(conf, dict):
        raise PipelineError(f"{path}: deepspeed_config_file: {json_path} holds no mapping of DeepSpeed settings")
    return conf, json_path


def owned_setting_problems(plan: StagePlan, path: Path, raw: dict[str, Any], precision: str,
                           source: str | Path) -> list[str]:
    """Settings the stage owns (accumulation and clipping: `StageBase.deepspeed_settings`; precision: the
    pipeline's `precision`) that its accelerate config fixes to another value. DeepSpeed would refuse the launch
    (or silently take the config's value), so `align validate` says it first, naming both files and values."""
    if str(raw.get("distributed_type", "")).upper() != "DEEPSPEED" and raw.get("mixed_precision") in (None, "no"):
        return []
    fixed, where = _deepspeed_values(path, raw) if str(raw.get("distributed_type", "")).upper() == "DEEPSPEED" \
        else ({}, str(path))
    problems = []
    stage_key = {"gradient_accumulation_steps": "gradient_accumulation_steps", "gradient_clipping": "max_grad_norm"}
    for key, mine in plan.cfg.deepspeed_settings().items():
        value = fixed.get(key)
        if value in (None, "auto"):
            continue
        same = (mine is None and float(value) == 0) if key == "gradient_clipping" else False
        if not same and (mine is None or float(value) != float(mine)):
            problems.append(f"{where} sets {key}: {value}, but the stage's {stage_key[key]} is {mine} (in {source}); "
                            f"remove {key} from {Path(where).name} (DeepSpeed then takes the stage's value) or set "
                            f"stages.{plan.name}.{stage_key[key]}: {value}")
    if not fixed.get("zero3_saves_whole", True):
        problems.append(f"{where}: ZeRO-3 without zero3_save_16bit_model: true (stage3_gather_16bit_weights_on_model_"
                        "save in a DeepSpeed JSON): model/ would hold DeepSpeed's shards, which no later stage can "
                        "load, and the stage would still complete; set it to true")
    mixed = fixed.get("mixed_precision") or raw.get("mixed_precision")
    if mixed not in (None, "no", "auto") and _MIXED_PRECISION.get(precision) != mixed:
        problems.append(f"{where} sets mixed_precision {mixed}, but the pipeline's precision is {precision!r} (in "
                        f"{source}); precision is the pipeline's setting: remove it from {Path(where).name} and set "
                        f"`precision: {'bfloat16' if mixed == 'bf16' else 'float16'}` in the pipeline if you want it")
    return problems


def accelerate_mode(path: Path) -> tuple[str, int | None]:
    """(mode, num_processes) that an accelerate config file describes: its ZeRO stage and offloads, written in its
    `deepspeed_config:` (a stage not written there is accelerate's default, 2) or in the DeepSpeed JSON its
    `deepspeed_config_file` names (DeepSpeed's default there: 0). FSDP is not a mode align sizes."""
    raw = yaml_load(path) or {}
    n = raw.get("num_processes")
    dist = str(raw.get("distributed_type", "NO")).upper()
    if dist == "FSDP":
        raise PipelineError(f"{path}: distributed_type: FSDP; align's memory estimate, checkpoints and weight syncs "
                            "are built and tested on DeepSpeed ZeRO: use pipelines/accelerate/zero3.yaml (or zero2)")
    if dist != "DEEPSPEED":
        return ("ddp", n)
    ds = raw.get("deepspeed_config") or {}
    ds = ds if isinstance(ds, dict) else {}
    if ds.get("deepspeed_config_file"):
        conf, where = _deepspeed_json(path, ds["deepspeed_config_file"])
        zero = conf.get("zero_optimization") if isinstance(conf.get("zero_optimization"), dict) else {}
        stage = zero.get("stage", 0)
        optimizer = str((zero.get("offload_optimizer") or {}).get("device", "none")) != "none"
        params = str((zero.get("offload_param") or {}).get("device", "none")) != "none"
    else:
        stage, where = ds.get("zero_stage", 2), path
        optimizer = str(ds.get("offload_optimizer_device", "none")) != "none"
        params = str(ds.get("offload_param_device", "none")) != "none"
    if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage <= 3:
        raise PipelineError(f"{where}: ZeRO stage {stage!r}: align sizes memory and plans checkpoints by the stage; "
                            "write 0, 1, 2 or 3")
    if stage <= 0:
        return ("ddp", n)
    if stage == 1:
        return ("zero1", n)
    if stage == 3 and optimizer and not params:  # the parameters' shards stay on the GPUs
        return ("zero3_offload_optimizer", n)
    return (f"zero{stage}_offload" if optimizer or params else f"zero{stage}", n)


# --------------------------------------------------------------------------------------------- processes
def is_distributed(stage: StageBase, source: str | Path) -> bool:
    """Whether the stage runs under a distributed accelerate config: any but one of `distributed_type: NO` (`cpu`,
    by name or by path, or a user's one-GPU config), which accelerate runs as one process whatever --num_processes
    says (a config that cannot be read is refused by validate: taken as distributed here)."""
    if stage.accelerate == "cpu":
        return False
    try:
        raw = yaml_load(accelerate_config(stage.accelerate, source)) or {}
    except (PipelineError, OSError, ValueError, yaml.YAMLError):
        return True
    return _runs_distributed(raw)


def _runs_distributed(raw: Any) -> bool:
    """An accelerate config's rule: anything but `distributed_type: NO` starts a distributed launch."""
    return not isinstance(raw, dict) or str(raw.get("distributed_type", "NO")).upper() != "NO"


def _placement_keys(raw: dict[str, Any], path: Path) -> list[str]:
    """Keys of an accelerate config that place processes where align does not count them: a num_processes that is
    not a count, and gpu_ids (accelerate then sets CUDA_VISIBLE_DEVICES to them: several processes on one GPU,
    which align's placement check, counting every GPU visible, would not see). num_machines and machine_rank are
    set on every launch (align's --nodes), whatever the file says."""
    problems = []
    n = raw.get("num_processes")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        problems.append(f"{path} sets num_processes: {n!r}, not a count of processes; give a whole number (one per "
                        "GPU), or remove it and let --num-processes or the stage's num_processes decide")
    if raw.get("gpu_ids") not in (None, "all"):
        problems.append(f"{path} sets gpu_ids: {raw['gpu_ids']!r}, which align does not count when it places the "
                        "processes; remove it and choose the GPUs with CUDA_VISIBLE_DEVICES instead")
    return problems


def processes_per_node(stage: StageBase, num_processes: int | None, source: str | Path) -> int | None:
    """Processes per machine: the stage's own setting, else the pipeline-wide count (`--num-processes`, one per
    GPU) for distributed configs only (a stage on `cpu` stays one process unless it asks for more); None
    leaves it to the accelerate config."""
    return stage.num_processes or (num_processes if is_distributed(stage, source) else None)


def node_processes(plan: StagePlan, source: str | Path, num_processes: int | None) -> int:
    """The processes the stage starts on each machine: its own count or --num-processes (processes_per_node), else
    its accelerate config's."""
    n = processes_per_node(plan.cfg, num_processes, source)
    return n or int((yaml_load(accelerate_config(plan.cfg.accelerate, source)) or {}).get("num_processes") or 1)


def placement_problem(plan: StagePlan, source: str | Path, num_processes: int | None, gpus: int) -> str | None:
    """Why the stage's processes or rollout engines cannot be placed on a node of `gpus` GPUs (0: a machine without
    GPUs): more processes than GPUs, or engines that do not fit the processes the stage launches there
    (tensor_parallel_size not dividing them, separate engines with no GPU left; by the function the stage itself
    runs, align/engines/placement.py), or None: said before anything is launched."""
    from align.engines import placement_problem as engine_placement_problem

    n = node_processes(plan, source, num_processes)
    # more processes than GPUs: two on one GPU fail NCCL's first collective (a config on the CPU takes none)
    raw = (yaml_load(accelerate_config(plan.cfg.accelerate, source)) or {}) if gpus and n > gpus else {}
    if raw and not raw.get("use_cpu") and str(raw.get("distributed_type", "NO")).upper() not in ("NO", "MULTI_CPU"):
        return (f"stages.{plan.name}: {n} processes per node (stages.{plan.name}.num_processes, --num-processes or the "
                f"accelerate config '{plan.cfg.accelerate}'), but this machine has {gpus} GPUs visible (one each); set "
                f"--num-processes {gpus} or stages.{plan.name}.num_processes: {gpus}")
    gen = plan.cfg.generation_settings()
    if gen is None:
        return None
    problem = engine_placement_problem(gen, n, gpus)
    return f"stages.{plan.name}.generation: {problem} ({n} processes per node, {gpus} GPUs on this machine)" \
        if problem else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_plain_process(plan: StagePlan, source: str | Path, num_processes: int | None) -> bool:
    """Whether the stage runs as one plain process (no launcher): the only kind align/orchestrator/warm.py can fork."""
    raw = yaml_load(accelerate_config(plan.cfg.accelerate, source)) or {}
    n = processes_per_node(plan.cfg, num_processes, source)
    return not _runs_distributed(raw) and (n or raw.get("num_processes", 1)) == 1


def world_change(plan: StagePlan, run_dir: Path, source: str | Path, num_processes: int | None, nodes: int) -> str:
    """What a completed stage that is reused should say when this run would start it on another number of processes
    than trained it ("" when the same): its fingerprint covers its settings, not where it ran, but the global batch
    is per_device_batch_size x gradient_accumulation_steps x processes."""
    trained = (read_manifest(run_dir / plan.name) or {}).get("world_size")
    now = 1 if one_plain_process(plan, source, num_processes) else \
        node_processes(plan, source, num_processes) * (nodes if is_distributed(plan.cfg, source) else 1)
    if not isinstance(trained, int) or trained == now:
        return ""
    return (f"; note: it was trained on {trained} process{'es' * (trained != 1)}, this run would start {now} (another "
            f"global batch); to retrain it here: --from {plan.name}")


def launch_command(plan: StagePlan, spec: Path, source: str | Path, num_processes: int | None,
                   multi: MultiNode | None = None) -> list[str]:
    """The command that starts the stage's processes on this machine (all of them, or this node's share)."""
    config = accelerate_config(plan.cfg.accelerate, source)
    n = processes_per_node(plan.cfg, num_processes, source)
    raw = yaml_load(config) or {}
    if one_plain_process(plan, source, num_processes):
        # One plain process: accelerate launch would only add ~2.6 s of imports (measured) before starting it.
        return [sys.executable, "-m", "align.cli", "stage", str(spec)]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    if multi is not None and multi.nodes > 1 and is_distributed(plan.cfg, source):
        per_node = node_processes(plan, source, num_processes)
        # accelerate counts processes over all machines; torchrun (DeepSpeed's `standard` multi-node launcher,
        # no ssh/pdsh needed) starts per_node of them here and meets the others at the master's port.
        cmd += ["--num_processes", str(per_node * multi.nodes), "--num_machines", str(multi.nodes),
                "--machine_rank", str(multi.node_rank), "--main_process_ip", str(multi.master_addr),
                "--main_process_port", str(multi.master_port), "--rdzv_backend", "static",
                "--rdzv_conf", f"timeout={multi.rdzv_timeout}", "--max_restarts", "0"]
        if raw.get("distributed_type") == "DEEPSPEED":
            cmd += ["--deepspeed_multinode_launcher", "standard"]
    else:
        if n:
            cmd += ["--num_processes", str(n)]
        # one machine, whatever the file says (a config copied from a cluster with num_machines: 2 made this node
        # wait for a second one until the rendezvous timed out)
        cmd += ["--num_machines", "1", "--machine_rank", "0", "--main_process_port", str(free_port())]
    # No `--cpu` flag: accelerate then ignores a DeepSpeed config and runs one plain process. cpu.yaml says
    # use_cpu itself, and DeepSpeed picks its CPU accelerator (gloo) when no GPU is present.
    cmd += ["-m", "align.cli", "stage", str(spec)]
    return cmd


def stage_env() -> dict[str, str]:
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1"}
    if not verbose():
        env["TQDM_DISABLE"] = "1"  # library bars off; the runner draws one bar per stage (align/core/console.py)
    return env
