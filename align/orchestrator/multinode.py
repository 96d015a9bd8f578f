"""Multi-node runs: one `align run` per machine against one run directory on a shared filesystem.

Node 0 writes everything (specs, manifests, outputs) and holds the run lock; other nodes launch their share of
each distributed stage (each writing only its own log there, `stage.node<R>.log`), skip stages that run on one
process, and wait for node 0 to record each stage.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from align.orchestrator import warm
from align.core.console import stream_stage
from align.orchestrator.launch import MultiNode, is_distributed, launch_command, stage_env
from align.orchestrator.plan import StagePlan
from align.core.errors import PipelineError
from align.core.fsutil import atomic_write_json
from align.core.rundir import MANIFEST, SPEC, StageSpec, is_complete, read_manifest

NODES = ".nodes"
"""The run directory's folder where the nodes of one multi-node `align run` agree on a token (`handshake`)."""
MARK = ".started"
"""A stage's record that node 0 started it in the run of a token ({"token": ...}), written after its spec; node 0
adds {"ended": why} when the stage fails or is stopped."""
TEARDOWN_S = 120.0
"""How long a worker whose processes failed waits for node 0 to record the stage completed before it fails: a rank
that aborts in the teardown after the stage completed (the process group's last barrier) does so within it."""
HEARTBEAT_SECONDS = 10.0
"""How often node 0 touches `.nodes/node0.json` while its run goes on (`agreed_run`)."""
SILENCE = 300.0
"""The least time without node 0's heartbeat after which a worker waiting on a one-process stage stops (a shared
filesystem may show another machine's change a minute late: NFS attribute caching); --rdzv-timeout if longer."""


@contextmanager
def agreed_run(run_dir: Path, multi: MultiNode, fingerprints: dict[str, str]) -> Iterator[str | None]:
    """A multi-node run's token (`handshake`; None on one node), node 0 touching its record every HEARTBEAT_SECONDS
    meanwhile: a worker waiting on a stage node 0 runs alone tells a node 0 that is gone (its host down, its runner
    killed) from one still at work (`wait_for_stage`)."""
    if multi.nodes == 1:
        yield None
        return
    token = handshake(run_dir, multi, fingerprints)
    if not multi.is_main:
        yield token
        return
    stop, beat = threading.Event(), run_dir / NODES / "node0.json"

    def touch() -> None:
        said = False
        while not stop.wait(HEARTBEAT_SECONDS):
            try:
                os.utime(beat)
            except OSError as exc:  # a hiccup: the next beat tries again (a worker waits out a long silence)
                if not said:
                    print(f"[align] warning: node 0 could not touch its heartbeat {beat} ({exc}); workers waiting "
                          "on a stage stop after a silence of --rdzv-timeout (at least 5 minutes)", flush=True)
                said = True

    thread = threading.Thread(target=touch, name="align-node0-heartbeat", daemon=True)
    thread.start()
    try:
        yield token
    finally:
        stop.set()
        thread.join()


def handshake(run_dir: Path, multi: MultiNode, fingerprints: dict[str, str] | None = None) -> str:
    """A token every node of this `align run` holds: a stage's `completed` manifest from an earlier run (same
    fingerprint: forced by --force or --from, or rerun because an input was republished) cannot be told from node
    0's rerun of it, and workers took it for done. Through `.nodes/` of the shared run directory: node 0 writes a
    fresh token; each worker writes its own beside the token it read; node 0 accepts the workers that read this
    run's, and says so; a worker holds node 0's token once node 0 has accepted its own (neither side's fresh token is
    in an earlier run's records). Within --rdzv-timeout. Each side also writes its stages' `fingerprints`: once every
    worker is there node 0 answers all of them at once, accepted, or refused when a node planned another pipeline
    (other files, overrides or code), and then every node stops, naming a stage. Node 0 makes the folder; a worker
    writes into it once it is there (it creates nothing of the run directory)."""
    folder = run_dir / NODES
    if multi.is_main:
        folder.mkdir(parents=True, exist_ok=True)
    mine, deadline, head = uuid.uuid4().hex, time.time() + multi.rdzv_timeout, {}
    plans = fingerprints or {}
    while True:
        if multi.is_main:
            found = {str(r): rec for r in range(1, multi.nodes)
                     if (rec := _record(folder / f"node{r}.json")).get("saw") == mine and "token" in rec}
            record: dict = {"token": mine, "plans": plans}
            if len(found) == multi.nodes - 1:  # every worker: one answer to all of them
                refused = next(filter(None, (_other_plans(plans, rec.get("plans"), int(r))
                                             for r, rec in sorted(found.items()))), None)
                record["answer"] = {"tokens": {r: rec["token"] for r, rec in found.items()}, "refused": refused}
            atomic_write_json(folder / "node0.json", record)
            if "answer" in record:
                if record["answer"]["refused"]:
                    raise PipelineError(record["answer"]["refused"])
                return mine
        elif folder.is_dir():
            head = _record(folder / "node0.json")
            atomic_write_json(folder / f"node{multi.node_rank}.json",
                              {"token": mine, "saw": head.get("token"), "plans": plans})
            answer = head.get("answer") if isinstance(head.get("answer"), dict) else {}
            if isinstance(answer.get("tokens"), dict) and answer["tokens"].get(str(multi.node_rank)) == mine:
                if answer.get("refused"):  # this run's refusal (it names this node's fresh token)
                    raise PipelineError(str(answer["refused"]))
                return str(head["token"])
        if time.time() > deadline:
            missing = ", ".join(str(r) for r in range(1, multi.nodes) if str(r) not in found) \
                if multi.is_main else f"0 ({multi.master_addr}:{multi.master_port})"
            raise PipelineError(f"node {multi.node_rank}: every node agrees on the run first, through {folder}; node "
                                f"{missing} did not within --rdzv-timeout {multi.rdzv_timeout}s: is it running? Start "
                                "every node with the same command, on a run directory all of them share")
        time.sleep(0.5)


def node_plans(plans: list, selected: set[str], forced: set[str]) -> dict[str, str]:
    """What a node compares in `handshake`: each stage's fingerprint, and whether this node runs it whatever it
    finds (--force, --from) or not at all (--only, --from): a worker started without node 0's --force found every
    stage up to date and exited while node 0 reran one and waited out its rendezvous."""
    return {p.name: p.fingerprint + ("" if p.name in selected and p.name not in forced else
                                     " (forced: --force or --from)" if p.name in selected else
                                     " (not selected: --only or --from)") for p in plans}


def _other_plans(node0: object, worker: object, rank: int) -> str | None:
    """Why node 0's stages and a worker's (name -> fingerprint) differ; None when they agree."""
    ours, theirs = node0 if isinstance(node0, dict) else {}, worker if isinstance(worker, dict) else {}
    for name in sorted(set(ours) | set(theirs)):
        if ours.get(name) != theirs.get(name):
            return (f"stage '{name}': node 0 planned fingerprint {ours.get(name)}, node {rank} planned "
                    f"{theirs.get(name)} (None: not in its pipeline): the nodes run different pipeline files, "
                    "overrides, stage selections or align versions; start every node with the same command")
    return None


def _record(path: Path) -> dict:
    """A small JSON record another node writes (atomically), or {} while it is absent or being replaced."""
    try:
        rec = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def mark_started(stage_dir: Path, token: str | None) -> None:
    """Node 0, after writing a stage's spec: the stage starts in the run of `token` (None: a one-node run)."""
    if token is not None:
        atomic_write_json(stage_dir / MARK, {"token": token})


def mark_ended(stage_dir: Path, token: str | None, why: str) -> None:
    """Node 0, when a stage it started in the run of `token` fails or is stopped (`why`): its workers stop at once,
    whether or not the stage's process recorded it in its manifest (killed before it could, or a last run's
    `completed` one still there)."""
    if token is not None and _record(stage_dir / MARK).get("token") == token:
        atomic_write_json(stage_dir / MARK, {"token": token, "ended": why})


def _ended(stage_dir: Path, name: str, token: str | None) -> None:
    """Raise node 0's `mark_ended` record of this run's attempt at the stage, if it wrote one."""
    rec = _record(stage_dir / MARK) if token is not None else {}
    if rec.get("token") == token and "ended" in rec:
        raise PipelineError(f"stage '{name}' {rec['ended']}")


def _this_run(stage_dir: Path, token: str | None, manifest: bool) -> bool:
    """Whether node 0 started the stage in the run of `token` (None: a one-node run, any run counts) and, with
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
    """Node 0 recorded the stage completed (multi-node: in this run, `token`)."""
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
                   stale_after: float | None = None, token: str | None = None, silence: float | None = None) -> None:
    """Worker nodes: wait until node 0 has recorded the stage as completed (or failed); in a multi-node run
    (`token`: `handshake`'s) in this run, and stopping at node 0's `mark_ended` record. A failed or interrupted
    manifest already there when the wait began (same fingerprint) may be an earlier attempt's, which node 0 is about
    to retry (its attempt count changes when it starts): it counts at once only when rewritten, else after
    `stale_after` seconds unchanged (node 0 may have failed this run's attempt before this node looked). With
    `silence`, node 0's heartbeat (`agreed_run`) unchanged that long, by this node's clock, stops the wait too."""
    t0 = time.time()
    before = read_manifest(stage_dir) or {}
    beat = stage_dir.parent / NODES / "node0.json"
    heard = (_stamp(beat), t0)
    while not _done(stage_dir, fingerprint, token):
        _ended(stage_dir, name, token)
        if silence is not None and token is not None:
            heard = _heard(beat, heard, silence, name)
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


def _heard(beat: Path, last: tuple, silence: float, name: str) -> tuple:
    """(node 0's heartbeat file's stamp, when this node last saw it change); raises after `silence` seconds
    without a change (mtimes are only compared with each other: no two clocks meet)."""
    stamp = _stamp(beat)
    if stamp != last[0]:
        return stamp, time.time()
    if time.time() - last[1] > silence:
        raise PipelineError(f"stage '{name}': node 0 has not touched its heartbeat {beat} for {silence:.0f}s (it "
                            f"does every {HEARTBEAT_SECONDS:.0f}s while it runs): its runner stopped, or its host "
                            "is down, without recording the stage. Check node 0's console and the stage's log, then "
                            "start every node again with the same command")
    return last


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
    """Worker nodes: wait until node 0 starts the stage (writes its spec.json with this node's fingerprint; with
    `token`: in this run) or has completed it, for at most --rdzv-timeout; a spec node 0 writes meanwhile
    with another fingerprint fails at once. Returns the spec's path. A spec still being written (or torn on a
    lagging filesystem) is waited out."""
    spec_path = stage_dir / SPEC
    t_wait, before, theirs = time.time(), _stamp(spec_path), None
    while not _done(stage_dir, plan.fingerprint, token):
        _ended(stage_dir, plan.name, token)
        try:
            theirs = StageSpec.read(spec_path).fingerprint if spec_path.is_file() else None
        except (OSError, ValueError):
            theirs = None
        if theirs == plan.fingerprint and _this_run(stage_dir, token, manifest=False):
            break
        if theirs not in (None, plan.fingerprint) and _stamp(spec_path) != before:  # (ours rewritten: node 0's rerun
            raise PipelineError(_other_config(plan.name, theirs, plan.fingerprint))  # of a stage, its mark next)
        if time.time() - t_wait > multi.rdzv_timeout:
            seen = "; is the run directory on a filesystem all nodes share, and is node 0 running?"
            if theirs == plan.fingerprint:  # the stage's last run: this run's mark never came
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
        wait_for_stage(stage_dir, plan.fingerprint, plan.name, None, stale_after=multi.rdzv_timeout, token=token,
                       silence=max(multi.rdzv_timeout, SILENCE))
        return
    wait_for_master(multi, plan.name)
    spec_path = await_start(plan, stage_dir, multi, token)
    print(f"{header}: running on node {multi.node_rank} of {multi.nodes}", flush=True)
    log = stage_dir / f"stage.node{multi.node_rank}.log"
    cmd = launch_command(plan, spec_path, source, num_processes, multi)
    rc = stream_stage(lambda: warm.start_stage(cmd, stage_env(), warm_start=False, stage_dir=str(stage_dir)),
                      log, plan.name)
    if rc != 0:
        try:  # node 0 takes a stage that completed before a process failed in its teardown (its last barrier) as
            # done (runner._completed): so does this node, else it stops and node 0 waits at the next rendezvous
            wait_for_stage(stage_dir, plan.fingerprint, plan.name, min(multi.rdzv_timeout, TEARDOWN_S),
                           stale_after=min(multi.rdzv_timeout, TEARDOWN_S), token=token)
        except PipelineError:
            raise PipelineError(f"stage '{plan.name}' failed on node {multi.node_rank} (exit code {rc}); log: "
                                f"{log}") from None
        print(f"{header}: warning: this node's processes exited with code {rc} after node 0 recorded the stage "
              f"completed (see {log}); its outputs stand", flush=True)
        return
    wait_for_stage(stage_dir, plan.fingerprint, plan.name, multi.rdzv_timeout, stale_after=multi.rdzv_timeout,
                   token=token)
