"""Multi-node runs: one `align run` per machine against one run directory on a shared filesystem.

Node 0 writes everything (specs, manifests, outputs) and holds the run lock; other nodes launch their share of
each distributed stage (each writing only its own log there, `stage.node<R>.log`), skip stages that run on one
process, and wait for node 0 to record each stage.
"""

from __future__ import annotations

import json
import socket
import time
import uuid
from pathlib import Path

from align.orchestrator import warm
from align.core.console import stream_stage
from align.orchestrator.launch import MultiNode, is_distributed, launch_command, stage_env
from align.orchestrator.plan import StagePlan
from align.core.errors import PipelineError
from align.core.fsutil import atomic_write_json
from align.core.rundir import MANIFEST, SPEC, StageSpec, is_complete, read_manifest

NODES = ".nodes"
"""The run directory's folder where the nodes of one `align run --force` or `--from` agree on a token (`handshake`)."""
MARK = ".started"
"""A forced stage's record that node 0 started it in the run of a token ({"token": ...}), written after its spec."""


def handshake(run_dir: Path, multi: MultiNode) -> str:
    """A token every node of this `align run` holds, for --force and --from: a forced stage's `completed` manifest
    from an earlier run (same fingerprint) cannot be told from node 0's rerun of it, and workers took it for done.
    Through `.nodes/` of the shared run directory: node 0 writes a fresh token; each worker writes its own beside the
    token it read; node 0 accepts the workers that read this run's, and says so; a worker holds node 0's token once
    node 0 has accepted its own (neither side's fresh token is in an earlier run's records). Within --rdzv-timeout."""
    folder = run_dir / NODES
    folder.mkdir(parents=True, exist_ok=True)
    mine, deadline, head = uuid.uuid4().hex, time.time() + multi.rdzv_timeout, {}
    while True:
        if multi.is_main:
            accepted = {str(r): rec["token"] for r in range(1, multi.nodes)
                        if (rec := _record(folder / f"node{r}.json")).get("saw") == mine and "token" in rec}
            atomic_write_json(folder / "node0.json", {"token": mine, "accepted": accepted})
            if len(accepted) == multi.nodes - 1:
                return mine
        else:
            head = _record(folder / "node0.json")
            atomic_write_json(folder / f"node{multi.node_rank}.json", {"token": mine, "saw": head.get("token")})
            if isinstance(head.get("accepted"), dict) and head["accepted"].get(str(multi.node_rank)) == mine:
                return str(head["token"])
        if time.time() > deadline:
            missing = ", ".join(str(r) for r in range(1, multi.nodes) if str(r) not in accepted) \
                if multi.is_main else "0"
            raise PipelineError(f"node {multi.node_rank}: with --force or --from every node agrees on the run first "
                                f"({folder}); node {missing} did not within --rdzv-timeout {multi.rdzv_timeout}s: "
                                "start every node with the same command, on a run directory all of them share")
        time.sleep(0.5)


def _record(path: Path) -> dict:
    """A small JSON record another node writes (atomically), or {} while it is absent or being replaced."""
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def mark_started(stage_dir: Path, token: str | None) -> None:
    """Node 0, after writing a forced stage's spec: the stage starts in the run of `token` (None: not forced)."""
    if token is not None:
        atomic_write_json(stage_dir / MARK, {"token": token})


def _this_run(stage_dir: Path, token: str | None, manifest: bool) -> bool:
    """Whether node 0 started the stage in the run of `token` (None: not forced, any run counts) and, with
    `manifest`, wrote its manifest since (both files are node 0's: one clock)."""
    if token is None:
        return True
    if _record(stage_dir / MARK).get("token") != token:
        return False
    try:
        return not manifest or (stage_dir / MANIFEST).stat().st_mtime_ns >= (stage_dir / MARK).stat().st_mtime_ns
    except OSError:
        return False


def _done(stage_dir: Path, fingerprint: str, token: str | None) -> bool:
    """Node 0 recorded the stage completed (with --force or --from: in this run, `token`)."""
    return is_complete(stage_dir, fingerprint) and _this_run(stage_dir, token, manifest=True)


def wait_for_master(multi: MultiNode, stage: str) -> None:
    """Worker nodes: wait until node 0 listens on the rendezvous port, or fail with the host and port after the
    timeout (instead of the silent hang of a rendezvous that never completes)."""
    deadline = time.time() + multi.rdzv_timeout
    last = ""
    while time.time() < deadline:
        try:
            with socket.create_connection((str(multi.master_addr), multi.master_port),
                                          timeout=min(5.0, max(0.1, deadline - time.time()))):
                return
        except OSError as exc:
            last = f"{type(exc).__name__}: {exc}"
            time.sleep(min(1.0, max(0.0, deadline - time.time())))
    raise PipelineError(
        f"node {multi.node_rank}: rendezvous for stage '{stage}' timed out after {multi.rdzv_timeout}s: the master "
        f"node {multi.master_addr}:{multi.master_port} could not be reached ({last}). Check --master-addr / "
        "--master-port (under SLURM: the first host of SLURM_JOB_NODELIST), that node 0 is running, and that the "
        "port is open between the nodes; --rdzv-timeout sets the wait.")


_WRITTEN = ("attempts", "status", "ended_at", "error")  # what node 0 rewrites at each attempt's start and end


def wait_for_stage(stage_dir: Path, fingerprint: str, name: str, timeout: float | None,
                   stale_after: float | None = None, token: str | None = None) -> None:
    """Worker nodes: wait until node 0 has recorded the stage as completed (or failed); a forced stage (`token`:
    `handshake`'s) in this run. A failed or interrupted manifest already there when the wait began (same
    fingerprint) may be an earlier attempt's, which node 0 is about to retry (its attempt count changes when it
    starts): it counts at once only when rewritten, else after `stale_after` seconds unchanged (node 0 may have
    failed this run's attempt before this node looked)."""
    t0 = time.time()
    before = read_manifest(stage_dir) or {}
    while not _done(stage_dir, fingerprint, token):
        m = read_manifest(stage_dir) or {}
        if m.get("fingerprint") not in (None, fingerprint) and m != before:  # node 0 ran it under another config
            raise PipelineError(_other_config(name, m["fingerprint"], fingerprint))
        if m.get("fingerprint") == fingerprint and m.get("status") in ("failed", "interrupted"):
            unchanged = [m.get(k) for k in _WRITTEN] == [before.get(k) for k in _WRITTEN]
            if not unchanged or (stale_after is not None and time.time() - t0 > stale_after):
                raise PipelineError(f"stage '{name}' {m['status']} on node 0: {m.get('error', 'see its log')}")
        if timeout is not None and time.time() - t0 > timeout:
            raise PipelineError(f"stage '{name}': node 0 did not record it as completed within {timeout:.0f}s "
                                f"({stage_dir / MANIFEST})")
        time.sleep(1.0)


def _other_config(name: str, theirs: str, ours: str) -> str:
    return (f"stage '{name}': node 0 runs it with fingerprint {theirs}, this node planned {ours}: the nodes run "
            "different pipeline files, overrides or align versions; start every node with the same command")


def _stamp(path: Path) -> tuple[float, int] | None:
    try:
        st = path.stat()
        return st.st_mtime, st.st_size
    except OSError:
        return None


def await_start(plan: StagePlan, stage_dir: Path, multi: MultiNode, token: str | None = None) -> Path:
    """Worker nodes: wait until node 0 starts the stage (writes its spec.json with this node's fingerprint; a forced
    stage, `token`: in this run) or has completed it, for at most --rdzv-timeout; a spec node 0 writes meanwhile
    with another fingerprint fails at once. Returns the spec's path. A spec still being written (or torn on a
    lagging filesystem) is waited out."""
    spec_path = stage_dir / SPEC
    t_wait, before, theirs = time.time(), _stamp(spec_path), None
    while not _done(stage_dir, plan.fingerprint, token):
        try:
            theirs = StageSpec.read(spec_path).fingerprint if spec_path.is_file() else None
        except (OSError, ValueError):
            theirs = None
        if theirs == plan.fingerprint and _this_run(stage_dir, token, manifest=False):
            break
        if theirs not in (None, plan.fingerprint) and _stamp(spec_path) != before:  # (ours rewritten: node 0's rerun
            raise PipelineError(_other_config(plan.name, theirs, plan.fingerprint))  # of a forced stage, its mark next)
        if time.time() - t_wait > multi.rdzv_timeout:
            seen = "; is the run directory on a filesystem all nodes share, and is node 0 running?"
            if theirs == plan.fingerprint:  # a forced stage's last run: this run's mark never came
                seen = f"; {spec_path} is an earlier run's (no {stage_dir / MARK} of this run){seen}"
            elif theirs:
                seen = f"; it holds fingerprint {theirs}: " + _other_config(plan.name, theirs, plan.fingerprint)
            raise PipelineError(f"node {multi.node_rank}: node 0 ({multi.master_addr}:{multi.master_port}) did not "
                                f"start stage '{plan.name}' within {multi.rdzv_timeout}s (no {spec_path} of this run "
                                f"with fingerprint {plan.fingerprint}){seen}")
        time.sleep(0.5)
    return spec_path


def follow_stage(plan: StagePlan, stage_dir: Path, header: str, source: str | Path, num_processes: int | None,
                 multi: MultiNode, token: str | None = None) -> None:
    """A worker node's part of one stage: launch its processes for a distributed stage (reading the spec node 0
    wrote), or wait while node 0 runs a one-process stage. Writes nothing under the run directory but its log,
    `stage.node<R>.log` beside node 0's stage.log (every node sees it there; it was in the node's own /tmp)."""
    if not is_distributed(plan.cfg, source):
        print(f"{header}: runs on node 0 only ({plan.cfg.accelerate}); waiting for it", flush=True)
        await_start(plan, stage_dir, multi, token)  # a stage node 0 never starts is not waited for without end
        wait_for_stage(stage_dir, plan.fingerprint, plan.name, None, stale_after=multi.rdzv_timeout, token=token)
        return
    wait_for_master(multi, plan.name)
    spec_path = await_start(plan, stage_dir, multi, token)
    print(f"{header}: running on node {multi.node_rank} of {multi.nodes}", flush=True)
    log = stage_dir / f"stage.node{multi.node_rank}.log"
    cmd = launch_command(plan, spec_path, source, num_processes, multi)
    rc = stream_stage(lambda: warm.start_stage(cmd, stage_env(), warm_start=False, stage_dir=str(stage_dir)),
                      log, plan.name)
    if rc != 0:
        raise PipelineError(f"stage '{plan.name}' failed on node {multi.node_rank} (exit code {rc}); log: {log}")
    wait_for_stage(stage_dir, plan.fingerprint, plan.name, multi.rdzv_timeout, stale_after=multi.rdzv_timeout,
                   token=token)
