"""Multi-node launch on one machine: two runners ("nodes"), one process each, rendezvous on 127.0.0.1; a master
that cannot be reached fails within the rendezvous timeout and names host and port; launch.sh under SLURM."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from align.orchestrator.launch import free_port
from conftest import REPO, TINY, align_cmd, run_align

SFT = ["run", "pipelines/default.yaml", "--run-id", "nodes", "--only", "sft", "tracking.wandb=disabled", *TINY,
       "sft.max_steps=6", "sft.save_steps=5", "sft.max_train_examples=400", "sft.eval_max_examples=16",
       "sft.accelerate=zero2", "sft.num_processes=1"]


@pytest.mark.slow
@pytest.mark.distributed
def test_two_nodes_rendezvous_on_localhost_and_finish_a_stage(workdir):
    port = str(free_port())
    node = ["--nodes", "2", "--master-addr", "127.0.0.1", "--master-port", port, "--rdzv-timeout", "120"]
    worker = subprocess.Popen(align_cmd(*SFT, *node, "--node-rank", "1"), cwd=workdir, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, env=os.environ.copy())
    main = run_align(*SFT, *node, "--node-rank", "0", cwd=workdir, timeout=300)
    worker_out, _ = worker.communicate(timeout=120)
    assert main.returncode == 0, main.stdout[-3000:] + main.stderr[-3000:]
    assert worker.returncode == 0, worker_out[-3000:]
    assert "running on node 1 of 2" in worker_out
    stage = workdir / "runs" / "default" / "nodes" / "sft"
    manifest = json.loads((stage / "manifest.json").read_text())
    assert manifest["status"] == "completed" and manifest["world_size"] == 2 and manifest["global_step"] == 6
    worker_log = (stage / "stage.node1.log").read_text()  # on the shared run directory, not the worker's /tmp
    assert "train_runtime" in worker_log and "Traceback" not in worker_log, worker_log[-2000:]
    steps = [json.loads(x)["step"] for x in (stage / "metrics.jsonl").read_text().splitlines() if "train/loss" in x]
    assert steps == [5, 6]  # each logged once, by the global main process (6: the last step's loss window)
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(stage / "model")


def test_a_worker_without_node_zero_fails_within_the_timeout_naming_host_and_port(workdir):
    """No node 0 (its run directory never appears): the worker stops after --rdzv-timeout, naming node 0's address,
    and creates nothing of the run directory. Node 0 there (the handshake done) but its rendezvous port unreachable:
    the worker stops on the port. 192.0.2.1 is TEST-NET-1 (RFC 5737): never routed, so nothing answers there."""
    from align.core.errors import PipelineError
    from align.orchestrator.launch import MultiNode
    from align.orchestrator.multinode import wait_for_master

    t0 = time.time()
    proc = run_align(*SFT, "--nodes", "2", "--node-rank", "1", "--master-addr", "192.0.2.1", "--master-port", "29577",
                     "--rdzv-timeout", "4", cwd=workdir, timeout=120)
    elapsed = time.time() - t0
    assert proc.returncode == 2
    assert "node 0 (192.0.2.1:29577) did not within --rdzv-timeout 4s: is it running?" in proc.stderr, proc.stderr
    assert elapsed < 4 + 20  # the timeout plus CLI start-up, not a hang
    assert not (workdir / "runs").exists()  # a worker node writes nothing
    with pytest.raises(PipelineError, match=r"rendezvous for stage 'sft' timed out after 2s.*192\.0\.2\.1:29577"):
        wait_for_master(MultiNode(nodes=2, node_rank=1, master_addr="192.0.2.1", master_port=29577, rdzv_timeout=2),
                        "sft")


def test_launch_sh_derives_node_rank_and_master_from_slurm(tmp_path):
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "scontrol").write_text('#!/bin/sh\n[ "$1 $2" = "show hostnames" ] && printf "gpu-a17\\ngpu-a18\\n"\n')
    (fake / "scontrol").chmod(0o755)
    env = {**os.environ, "PATH": f"{fake}:{os.environ['PATH']}", "ALIGN_DRY_RUN": "1",
           "SLURM_JOB_NODELIST": "gpu-a[17-18]", "SLURM_NNODES": "2", "SLURM_NODEID": "1"}
    out = subprocess.run([str(REPO / "launch.sh"), "pipelines/hh_rlhf.yaml", "--rdzv-timeout", "900"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["align", "run", "pipelines/hh_rlhf.yaml", "--nodes", "2", "--node-rank", "1",
                                  "--master-addr", "gpu-a17", "--master-port", "29500", "--rdzv-timeout", "900"]


def test_launch_sh_starts_one_process_per_gpu_it_may_use(tmp_path):
    """launch.sh passes --num-processes for the GPUs the job may use: every GPU nvidia-smi lists, or those
    CUDA_VISIBLE_DEVICES names when it is set (a scheduler's share of a node; nvidia-smi lists them all), none for
    an empty or -1 list. A stand-in nvidia-smi lists 8."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "nvidia-smi").write_text('#!/bin/sh\nfor i in 0 1 2 3 4 5 6 7; do echo "GPU $i: NVIDIA H100 (UUID: GPU-$i)"; done\n')
    (fake / "nvidia-smi").chmod(0o755)
    base = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    base.update(PATH=f"{fake}:{os.environ['PATH']}", ALIGN_DRY_RUN="1")
    seen = {}
    for visible in (None, "0,1,2,3", "GPU-5,GPU-6", "", "-1", "0,1,-1,2", "0,1,9,2", "NoDevFiles", "3,3"):
        env = base if visible is None else {**base, "CUDA_VISIBLE_DEVICES": visible}
        out = subprocess.run([str(REPO / "launch.sh"), "pipelines/default.yaml"], capture_output=True, text=True,
                             env=env, timeout=60)
        assert out.returncode == 0, out.stderr
        seen[visible] = out.stdout.split()
    assert seen[None] == ["align", "run", "pipelines/default.yaml", "--num-processes", "8"]
    assert seen["0,1,2,3"][-2:] == ["--num-processes", "4"] and seen["GPU-5,GPU-6"][-2:] == ["--num-processes", "2"]
    assert seen[""] == seen["-1"] == seen["NoDevFiles"] == ["align", "run", "pipelines/default.yaml"]
    # as CUDA reads the list: up to the first entry that is not a GPU's index, a repeated one included
    assert seen["0,1,-1,2"][-1] == seen["0,1,9,2"][-1] == "2" and seen["3,3"][-1] == "1"


def test_launch_sh_under_a_slurm_step_on_part_of_the_job_names_the_steps_first_node(tmp_path):
    """A 4-node job running a 2-node srun step: the master is the step's first node, not the job's; where scontrol is
    missing (a container), ALIGN_MASTER_ADDR names it, and without it the launcher says so instead of exit 127."""
    env = {**os.environ, "ALIGN_DRY_RUN": "1", "PATH": f"{tmp_path}:/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "",
           "SLURM_JOB_NODELIST": "gpu[01-04]",
           "SLURM_NNODES": "4", "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "gpu[03-04]", "SLURM_NODEID": "1"}
    (tmp_path / "scontrol").write_text('#!/bin/sh\n[ "$3" = "gpu[03-04]" ] && printf "gpu03\\ngpu04\\n"\n')
    (tmp_path / "scontrol").chmod(0o755)
    out = subprocess.run(["bash", str(REPO / "launch.sh")], capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.split()[3:9] == ["--nodes", "2", "--node-rank", "1", "--master-addr", "gpu03"], out.stderr
    (tmp_path / "scontrol").unlink()
    out = subprocess.run(["bash", str(REPO / "launch.sh")], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 2 and "scontrol is not on PATH" in out.stderr and "ALIGN_MASTER_ADDR" in out.stderr
    out = subprocess.run(["bash", str(REPO / "launch.sh")], capture_output=True, text=True, timeout=60,
                         env={**env, "ALIGN_MASTER_ADDR": "gpu03"})
    assert out.returncode == 0 and "--master-addr gpu03" in out.stdout, out.stderr


def test_launch_sh_reads_a_pipeline_from_the_callers_directory_and_refuses_what_is_not_one(tmp_path):
    (tmp_path / "mine.yml").write_text("name: mine\n")
    env = {**os.environ, "ALIGN_DRY_RUN": "1", "ALIGN_VENV": str(tmp_path / "venv")}
    out = subprocess.run([str(REPO / "launch.sh"), "mine.yml"], cwd=tmp_path, capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.stdout.split()[:3] == ["align", "run", str(tmp_path / "mine.yml")], out.stderr
    out = subprocess.run([str(REPO / "launch.sh"), "notes.txt"], cwd=tmp_path, capture_output=True, text=True, env=env,
                         timeout=60)
    assert out.returncode == 2 and "'notes.txt' is not a pipeline file (*.yaml) or an override" in out.stderr
    for flag in ("--setup", "--vllm", "--tests"):  # a dry run sets nothing up
        out = subprocess.run([str(REPO / "launch.sh"), flag], cwd=tmp_path, capture_output=True, text=True, env=env,
                             timeout=60)
        assert out.returncode == 0 and ("dry run" in out.stdout or "pytest" in out.stdout), out.stdout + out.stderr
    assert not (tmp_path / "venv").exists()
    (tmp_path / "lr=1e-5.yaml").write_text("name: lr\n")  # a pipeline file whose name holds =, and an override
    out = subprocess.run([str(REPO / "launch.sh"), "lr=1e-5.yaml", "sft.data=cards/x.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.split()[:4] == ["align", "run", str(tmp_path / "lr=1e-5.yaml"), "sft.data=cards/x.yaml"]
    # `pipelines/default.yaml` named from a directory with a file of that name is the caller's (it was the checkout's
    # whatever the caller had); unnamed, the checkout's, by its absolute path (the run is started from the caller's
    # directory, where its runs/ and the paths it prints then are)
    out = subprocess.run([str(REPO / "launch.sh")], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=60)
    assert out.stdout.split()[:3] == ["align", "run", str(REPO / "pipelines" / "default.yaml")], out.stderr
    (tmp_path / "pipelines").mkdir()
    (tmp_path / "pipelines" / "default.yaml").write_text("name: mine\n")
    out = subprocess.run([str(REPO / "launch.sh"), "pipelines/default.yaml"], cwd=tmp_path, capture_output=True,
                         text=True, env=env, timeout=60)
    assert out.stdout.split()[:3] == ["align", "run", str(tmp_path / "pipelines" / "default.yaml")], out.stderr


def _worker_env(tmp_path, venv, wait: int) -> dict:
    return {**os.environ, "ALIGN_VENV": str(venv), "SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_NODEID": "1",
            "ALIGN_SETUP_WAIT_S": str(wait)}


def test_a_slurm_worker_node_never_installs_and_names_a_missing_venv(tmp_path):
    """Under SLURM only node 0 sets up .venv (all nodes share it); another node waits for node 0's install stamp
    and, when it never comes, says what is missing and the fix, without creating anything itself."""
    venv = tmp_path / "venv"
    t0 = time.time()
    out = subprocess.run([str(REPO / "launch.sh"), "--setup"], capture_output=True, text=True, timeout=60,
                         env=_worker_env(tmp_path, venv, 5))
    assert out.returncode == 2
    assert f"SLURM node 1: {venv} is not set up" in out.stderr and "./launch.sh --setup" in out.stderr
    assert "after 5 s" in out.stderr and time.time() - t0 >= 5
    assert not venv.exists()  # it did not start an install of its own into the shared directory


def test_a_slurm_worker_node_waits_for_node_zeros_install(tmp_path):
    """The worker starts before node 0 has finished: it waits, then goes on with the venv node 0 made."""
    import hashlib
    import threading

    venv = tmp_path / "venv"

    def node_zero_finishes():
        time.sleep(3)
        (venv / "bin").mkdir(parents=True)
        (venv / "bin" / "python").symlink_to(sys.executable)
        (venv / "bin" / "activate").write_text("# made by the test's node 0\n")
        digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()[:16]
        (venv / f".align-install-{digest}").touch()

    thread = threading.Thread(target=node_zero_finishes)
    thread.start()
    t0 = time.time()
    out = subprocess.run([str(REPO / "launch.sh"), "--setup"], capture_output=True, text=True, timeout=120,
                         env=_worker_env(tmp_path, venv, 60))
    thread.join()
    assert out.returncode == 0, out.stderr
    assert f"[launch] {venv} is set up" in out.stdout and time.time() - t0 >= 3
    assert "installing" not in out.stdout + out.stderr


def _raises_while(node0, match: str, wait) -> None:
    """`wait()` (a worker's) raises PipelineError matching `match` while `node0` writes the run directory."""
    import threading

    from align.core.errors import PipelineError

    thread = threading.Thread(target=node0)
    thread.start()
    try:
        with pytest.raises(PipelineError, match=match):
            wait()
    finally:
        thread.join()


def test_a_worker_waits_past_an_earlier_attempts_failure_and_stops_at_this_ones(tmp_path):
    """A rerun after node 0's stage failed (or was preempted): the worker finds that attempt's manifest (same
    fingerprint, failed) before node 0 has started the stage again; it waits instead of giving up at once, stops on
    the failure node 0 records in this run, and, left unchanged, stops on it after stale_after (never waits
    forever)."""

    from align.core.errors import PipelineError
    from align.core.rundir import write_manifest
    from align.orchestrator.multinode import wait_for_stage

    earlier = {"fingerprint": "f1", "status": "interrupted", "attempts": 1, "error": "SIGTERM",
               "ended_at": "2026-11-28T10:00:00+0000"}
    write_manifest(tmp_path, earlier)
    t0 = time.time()
    with pytest.raises(PipelineError, match="interrupted on node 0: SIGTERM"):  # left as it was: after stale_after
        wait_for_stage(tmp_path, "f1", "sft", timeout=None, stale_after=2.0)
    assert time.time() - t0 >= 2.0  # not at once: node 0 may be about to start it again

    def node0():  # starts the stage again, which fails
        time.sleep(1.5)
        write_manifest(tmp_path, {**earlier, "status": "running", "attempts": 2})
        time.sleep(1.5)
        write_manifest(tmp_path, {**earlier, "status": "failed", "attempts": 2, "error": "CUDA out of memory",
                                  "ended_at": "2026-11-28T11:00:00+0000"})

    _raises_while(node0, "stage 'sft' failed on node 0: CUDA out of memory",
                  lambda: wait_for_stage(tmp_path, "f1", "sft", timeout=None, stale_after=30.0))


def test_a_worker_stops_when_node_zero_runs_the_stage_under_another_config_or_never_starts_it(tmp_path):
    """A worker started with other overrides (or align code) than node 0 waited for ever on a one-process stage that
    node 0 ran under its own fingerprint; with no node 0 at all it waited for ever too. It now stops at once on a
    spec or manifest node 0 writes with another fingerprint, and after --rdzv-timeout on a stage nobody starts."""
    import threading
    from types import SimpleNamespace

    from align.core.errors import PipelineError
    from align.core.rundir import StageSpec, write_manifest
    from align.orchestrator.launch import MultiNode
    from align.orchestrator.multinode import await_start, wait_for_stage

    plan = SimpleNamespace(name="sft", fingerprint="ours")
    multi = MultiNode(nodes=2, node_rank=1, master_addr="127.0.0.1", rdzv_timeout=2)
    t0 = time.time()
    with pytest.raises(PipelineError, match=r"did not start stage 'sft' within 2s .*is node 0 running\?"):
        await_start(plan, tmp_path, multi)
    assert 2.0 <= time.time() - t0 < 10
    (tmp_path / "spec.json").write_text('{"stage_name": "sft", "fing')  # torn: waited out, never a traceback

    def node0(fingerprint):
        time.sleep(0.8)
        StageSpec("sft", str(tmp_path), fingerprint, {}, {}).write(tmp_path / "spec.json")

    for fingerprint, outcome in (("theirs", "fails"), ("ours", "starts")):
        thread = threading.Thread(target=node0, args=(fingerprint,))
        thread.start()
        multi.rdzv_timeout = 30
        t0 = time.time()
        try:
            if outcome == "fails":
                with pytest.raises(PipelineError, match="node 0 runs it with fingerprint theirs, this node planned "
                                                        "ours: .*start every node with the same command"):
                    await_start(plan, tmp_path, multi)
            else:
                assert await_start(plan, tmp_path, multi) == tmp_path / "spec.json"
        finally:
            thread.join()
        assert time.time() - t0 < 10  # at once, not after the timeout

    write_manifest(tmp_path, {"fingerprint": "older", "status": "completed", "outputs": ["model"]})  # a last run's

    def node0_runs_theirs():
        time.sleep(0.8)
        write_manifest(tmp_path, {"fingerprint": "theirs", "status": "running", "attempts": 1})

    _raises_while(node0_runs_theirs, "node 0 runs it with fingerprint theirs, this node planned ours",
                  lambda: wait_for_stage(tmp_path, "ours", "sft", timeout=None, stale_after=30.0))


def test_a_process_group_made_without_a_timeout_waits_as_long_as_the_default_one(tmp_path):
    """DeepSpeed makes ZeRO-3's process group (a clone of the world) without a timeout, and torch gives such a group
    its backend's default (30 minutes under gloo, 10 under NCCL) rather than the 2 hours the stage's default group
    waits: a stage process sets the default (runtime/process.long_group_timeouts), so a group made afterwards
    waits COLLECTIVE_TIMEOUT. In a subprocess: the defaults are process-wide."""
    code = (
        "import datetime, os, torch, torch.distributed as dist\n"
        "from align.runtime.context import COLLECTIVE_TIMEOUT\n"
        "from align.runtime.process import long_group_timeouts\n"
        "os.environ.update(MASTER_ADDR='127.0.0.1', MASTER_PORT=str(29500 + os.getpid() % 1000))\n"
        "dist.init_process_group('gloo', rank=0, world_size=1, timeout=COLLECTIVE_TIMEOUT)\n"
        "cpu = torch.device('cpu')\n"
        "before = dist.new_group([0])._get_backend(cpu).options._timeout\n"
        "long_group_timeouts()\n"
        "after = dist.new_group([0])._get_backend(cpu).options._timeout\n"
        "print(before.total_seconds(), after.total_seconds(), COLLECTIVE_TIMEOUT.total_seconds())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    before, after, wanted = map(float, out.stdout.split())
    assert before < wanted and after == wanted == 7200.0


def test_with_force_a_worker_waits_for_node_zeros_rerun_not_the_last_runs_completed_stage(tmp_path):
    """`align run --force` (or --from) on two nodes: a forced stage's `completed` manifest from the last run has this
    run's fingerprint, and a worker took it for done, moving on (a one-process stage) or launching from the last
    run's spec while node 0 was still on earlier stages. The nodes agree on a token first (`handshake`, earlier
    runs' records in `.nodes/` told apart); node 0 marks each forced stage started in its run after writing the spec,
    and the worker waits for that spec and for a manifest written since."""
    import threading
    from types import SimpleNamespace

    from align.core.errors import PipelineError
    from align.core.rundir import StageSpec, write_manifest
    from align.orchestrator.launch import MultiNode
    from align.orchestrator.multinode import NODES, await_start, handshake, mark_started, wait_for_stage

    nodes = tmp_path / NODES
    nodes.mkdir()
    (nodes / "node0.json").write_text(json.dumps({"token": "last", "accepted": {"1": "w-last"}}))  # the last run's
    (nodes / "node1.json").write_text(json.dumps({"token": "w-last", "saw": "last"}))
    tokens = {}

    def node(rank):
        tokens[rank] = handshake(tmp_path, MultiNode(nodes=2, node_rank=rank, master_addr="127.0.0.1", rdzv_timeout=30))

    threads = [threading.Thread(target=node, args=(r,)) for r in (1, 0)]  # the worker first: it reads a stale record
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert tokens[0] == tokens[1] and tokens[0] not in ("last", "w-last")

    stage = tmp_path / "sft"
    (stage / "model").mkdir(parents=True)
    last = {"fingerprint": "f1", "status": "completed", "outputs": ["model"], "attempts": 1}
    write_manifest(stage, last)
    StageSpec("sft", str(stage), "f1", {}, {}).write(stage / "spec.json")
    plan = SimpleNamespace(name="sft", fingerprint="f1")
    multi = MultiNode(nodes=2, node_rank=1, master_addr="127.0.0.1", rdzv_timeout=30)
    assert await_start(plan, stage, multi) == stage / "spec.json"  # without a token: the last run's counts at once
    with pytest.raises(PipelineError, match=r"spec.json is an earlier run's \(no .*\.started of this run\)"):
        await_start(plan, stage, MultiNode(nodes=2, node_rank=1, master_addr="127.0.0.1", rdzv_timeout=1), tokens[1])
    events = {}

    def node0():
        time.sleep(1.0)
        StageSpec("sft", str(stage), "f1", {}, {}).write(stage / "spec.json")
        time.sleep(1.0)  # the spec rewritten, the mark not yet (a lagging filesystem): no "another config" error
        mark_started(stage, tokens[0])
        events["started"] = time.time()
        time.sleep(1.0)
        write_manifest(stage, {**last, "status": "running", "attempts": 2})
        time.sleep(1.0)
        write_manifest(stage, {**last, "attempts": 2})
        events["completed"] = time.time()

    thread = threading.Thread(target=node0)
    thread.start()
    try:
        await_start(plan, stage, multi, tokens[1])
        events["worker_saw_start"] = time.time()
        wait_for_stage(stage, "f1", "sft", timeout=30, stale_after=30, token=tokens[1])
        events["worker_done"] = time.time()
    finally:
        thread.join()
    assert events["worker_saw_start"] >= events["started"] and events["worker_done"] >= events["completed"], events


def _agreed(tmp_path, plans: dict) -> dict:
    """Both nodes' handshake in threads: {rank: token or the PipelineError it raised}."""
    import threading

    from align.core.errors import PipelineError
    from align.orchestrator.launch import MultiNode
    from align.orchestrator.multinode import handshake

    out = {}

    def node(rank):
        try:
            out[rank] = handshake(tmp_path, MultiNode(nodes=len(plans), node_rank=rank, master_addr="127.0.0.1",
                                                      rdzv_timeout=20), plans[rank])
        except PipelineError as exc:
            out[rank] = exc

    threads = [threading.Thread(target=node, args=(r,)) for r in sorted(plans, reverse=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def test_nodes_that_planned_different_pipelines_both_stop_at_the_handshake(tmp_path):
    """A worker started with other overrides skipped a stage as up to date while node 0 reran it (node 0 then hung in
    the rendezvous); the nodes now compare every stage's fingerprint when they agree on the run, and both stop,
    naming the stage. The same plans agree on one token."""
    same = _agreed(tmp_path, {0: {"sft": "a", "dpo": "b"}, 1: {"sft": "a", "dpo": "b"}})
    assert isinstance(same[0], str) and same[0] == same[1]
    other = _agreed(tmp_path, {0: {"sft": "a", "dpo": "b"}, 1: {"sft": "a", "dpo": "c"}})
    for rank in (0, 1):
        assert "stage 'dpo': node 0 planned fingerprint b, node 1 planned c" in str(other[rank]), other
    fewer = _agreed(tmp_path, {0: {"sft": "a", "dpo": "b"}, 1: {"sft": "a"}})
    assert "stage 'dpo': node 0 planned fingerprint b, node 1 planned None" in str(fewer[1]), fewer
    t0 = time.time()  # three nodes, one of them another pipeline: every node stops at once, the matching one too
    three = _agreed(tmp_path, {0: {"sft": "a"}, 1: {"sft": "a"}, 2: {"sft": "z"}})
    assert all("node 0 planned fingerprint a, node 2 planned z" in str(three[r]) for r in (0, 1, 2)), three
    assert time.time() - t0 < 15  # not after --rdzv-timeout (20 s)


def test_a_worker_stops_at_once_when_node_zero_records_its_attempt_failed_over_a_last_runs_completed_manifest(
        tmp_path):
    """Node 0's stage process died before writing its manifest (a segfault at import, SIGKILL), over the last run's
    `completed` one: node 0 exited, the worker waited for ever. Node 0 now marks the attempt ended (`mark_ended`, as
    the runner does on any failure or stop) and the worker stops at once, with node 0's reason; a mark of another
    run's token is not this run's end."""
    from types import SimpleNamespace

    from align.core.rundir import StageSpec, write_manifest
    from align.orchestrator.launch import MultiNode
    from align.orchestrator.multinode import await_start, mark_ended, mark_started, wait_for_stage

    stage = tmp_path / "prefs"
    (stage / "data").mkdir(parents=True)
    write_manifest(stage, {"fingerprint": "f1", "status": "completed", "outputs": ["data"], "attempts": 1})
    StageSpec("prefs", str(stage), "f1", {}, {}).write(stage / "spec.json")
    mark_started(stage, "last-run")
    mark_ended(stage, "this-run", "failed on node 0: not this run's")  # not this run's mark: nothing written
    assert json.loads((stage / ".started").read_text()) == {"token": "last-run"}

    def node0():
        time.sleep(1.0)
        StageSpec("prefs", str(stage), "f1", {}, {}).write(stage / "spec.json")
        mark_started(stage, "this-run")
        time.sleep(1.0)
        mark_ended(stage, "this-run", "failed on node 0: the stage process exited with code -9")

    multi = MultiNode(nodes=2, node_rank=1, master_addr="127.0.0.1", rdzv_timeout=60)
    t0 = time.time()

    def worker():
        await_start(SimpleNamespace(name="prefs", fingerprint="f1"), stage, multi, "this-run")
        wait_for_stage(stage, "f1", "prefs", None, stale_after=60, token="this-run", silence=60)

    _raises_while(node0, r"stage 'prefs' failed on node 0: the stage process exited with code -9", worker)
    assert time.time() - t0 < 15  # at once, not after stale_after


def test_a_worker_stops_when_node_zeros_heartbeat_falls_silent_and_waits_while_it_beats(tmp_path, monkeypatch):
    """Node 0's host went down during a one-process stage (its manifest left `running`): the worker waited for ever.
    While node 0's run goes on it touches `.nodes/node0.json` (agreed_run); a worker waiting on a stage stops after
    `silence` seconds without a touch, and waits on while the touches come."""
    import threading

    import align.orchestrator.multinode as mn
    from align.core.rundir import write_manifest
    from align.orchestrator.launch import MultiNode

    monkeypatch.setattr(mn, "HEARTBEAT_SECONDS", 0.2)
    stage = tmp_path / "prefs"
    (stage / "data").mkdir(parents=True)
    mn.mark_started(stage, "tok")
    write_manifest(stage, {"fingerprint": "f1", "status": "running", "attempts": 1})
    done = {}

    def node0():
        with mn.agreed_run(tmp_path, MultiNode(nodes=2, node_rank=0, master_addr="127.0.0.1", rdzv_timeout=20),
                           {"prefs": "f1"}):
            time.sleep(4.0)  # beating: longer than the worker's silence
            write_manifest(stage, {"fingerprint": "f1", "status": "completed", "outputs": ["data"], "attempts": 1})
            done["at"] = time.time()

    thread = threading.Thread(target=node0)
    thread.start()
    try:
        token = mn.handshake(tmp_path, MultiNode(nodes=2, node_rank=1, master_addr="127.0.0.1", rdzv_timeout=20),
                             {"prefs": "f1"})
        mn.mark_started(stage, token)  # as node 0's runner does once it starts the stage
        mn.wait_for_stage(stage, "f1", "prefs", None, stale_after=60, token=token, silence=1.5)
    finally:
        thread.join()
    assert "at" in done  # it waited past 1.5 s of the stage for the completed record
    write_manifest(stage, {"fingerprint": "f1", "status": "running", "attempts": 2})
    mn.mark_started(stage, token)
    t0 = time.time()
    with pytest.raises(mn.PipelineError, match=r"node 0 has not touched its heartbeat .*node0\.json for 2s"):
        mn.wait_for_stage(stage, "f1", "prefs", None, stale_after=60, token=token, silence=2.0)
    assert 2.0 <= time.time() - t0 < 10


def test_a_worker_whose_processes_fail_after_node_zero_completed_the_stage_goes_on_as_node_zero_does(
        tmp_path, monkeypatch, capsys):
    """Node 0 accepts a stage whose processes exit non-zero after its manifest says completed (a rank aborting in the
    last barrier): the worker failed the run there, and node 0 then waited out the next stage's rendezvous for it. A
    worker whose processes fail before node 0 completes the stage still fails, naming its log."""
    from types import SimpleNamespace

    from align.core.errors import PipelineError
    from align.core.rundir import write_manifest
    from align.orchestrator import multinode
    from align.orchestrator.launch import MultiNode

    stage = tmp_path / "sft"
    (stage / "model").mkdir(parents=True)
    for name, value in {"is_distributed": lambda cfg, src: True, "wait_for_master": lambda m, n: None,
                        "await_start": lambda *a: stage / "spec.json", "launch_command": lambda *a: [],
                        "stream_stage": lambda start, log, name: 1, "TEARDOWN_S": 2.0}.items():
        monkeypatch.setattr(multinode, name, value, raising=False)
    plan = SimpleNamespace(name="sft", fingerprint="f1", cfg=SimpleNamespace(accelerate="zero3.yaml"))
    multi = MultiNode(nodes=2, node_rank=1, master_addr="127.0.0.1", rdzv_timeout=30)
    multinode.mark_started(stage, "this-run")
    with pytest.raises(PipelineError, match=r"stage 'sft' failed on node 1 \(exit code 1\); log: .*stage\.node1\.log"):
        multinode.follow_stage(plan, stage, "[1/1] sft", "p.yaml", 2, multi, "this-run")  # node 0 never completed it
    write_manifest(stage, {"fingerprint": "f1", "status": "completed", "outputs": ["model"], "attempts": 1})
    multinode.follow_stage(plan, stage, "[1/1] sft", "p.yaml", 2, multi, "this-run")
    assert "exited with code 1 after node 0 recorded the stage completed" in capsys.readouterr().out


def test_nodes_started_with_other_stage_selections_both_stop_at_the_handshake(tmp_path):
    """Node 0 with --force (or --from) and a worker without it, every stage done in an earlier run: the worker found
    them all up to date and exited, and node 0 reran one and waited out its rendezvous. The nodes compare what each
    runs whatever it finds, and what it leaves out."""
    from types import SimpleNamespace

    from align.orchestrator.multinode import node_plans

    plans = [SimpleNamespace(name="sft", fingerprint="a"), SimpleNamespace(name="dpo", fingerprint="b")]
    plain = node_plans(plans, {"sft", "dpo"}, set())
    assert plain == {"sft": "a", "dpo": "b"}
    forced = node_plans(plans, {"sft", "dpo"}, {"sft"})
    other = _agreed(tmp_path, {0: forced, 1: plain})
    for rank in (0, 1):
        assert "stage 'sft': node 0 planned fingerprint a (forced: --force or --from), node 1 planned a " in \
            str(other[rank]) and "stage selections" in str(other[rank]), other
    only = _agreed(tmp_path, {0: node_plans(plans, {"dpo"}, set()), 1: plain})
    assert "stage 'sft': node 0 planned fingerprint a (not selected: --only or --from)" in str(only[1]), only
