"""Faults end cleanly (issue 22, second part): Ctrl-C, a killed stage, a full disk, a faulty user judge, the
user's WANDB_MODE. Each ends with a message that names what happened and what to do, never a traceback; an
interrupted stage is recorded as such and `align status` reads the run."""

from __future__ import annotations

import errno
import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from conftest import REPO, align_cmd, complete_checkpoints, run_align

CARD = str(REPO / "data_cards" / "movie_review_snippets.yaml")
PIPELINE = {  # sft, long enough to be interrupted mid-training; a second one-process stage makes the run start
    # its stages warm (align/orchestrator/warm.py), so Ctrl-C and SIGKILL are tested on forked stage processes
    "name": "faults", "base_model": "builtin:tiny-llama", "seed": 5, "tracking": {"wandb": "disabled"},
    "builtin": {"vocab_size": 512, "hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64,
                "max_position_embeddings": 96},
    "stages": {"sft": {"data": CARD, "max_steps": 100000, "per_device_batch_size": 8, "max_length": 96,
                       "max_train_examples": 200, "max_truncated_fraction": 0.1, "logging_steps": 5,
                       "save_steps": 20, "eval_split": None},
               "preferences": {"policy": "sft", "prompts": CARD, "judge": "length", "max_prompts": 8,
                               "samples_per_prompt": 2, "drop_unfinished": False}},
}


# --------------------------------------------------------------------------------------------- judges
JUDGES = '''
import math
def good(prompts, responses): return [float(len(r)) for r in responses]
def raises(prompts, responses): raise RuntimeError("the scoring service is down")
def short(prompts, responses): return [1.0] * (len(responses) - 1)
def words(prompts, responses): return ["great" for _ in responses]
def nan(prompts, responses): return [math.nan if i == 2 else 1.0 for i, _ in enumerate(responses)]
def scalar(prompts, responses): return 3.0
def huge(prompts, responses): return [1e308 if i == 1 else 1.0 for i, _ in enumerate(responses)]
def numpy_scores(prompts, responses):
    import numpy
    return [numpy.float32(len(r)) for r in responses]
'''


@pytest.mark.parametrize("name, message", [
    ("raises", "judge 'userjudges:raises' raised RuntimeError: the scoring service is down (called with 4 responses)"),
    ("short", "judge 'userjudges:short' returned 3 scores for 4 responses"),
    ("words", "judge 'userjudges:words' returned 'great' (str) for response 0; every score must be a number"),
    ("nan", "judge 'userjudges:nan' returned nan for response 2 ('ccc'); every score must be a finite number"),
    ("scalar", "judge 'userjudges:scalar' returned a float; it must return a list of 4 numbers"),
    ("huge", "judge 'userjudges:huge' returned 1e+308 for response 1 ('bb'); every score must be a finite number "
             "within float32's range"),  # it was inf once a float32 tensor, and the error blamed a reward model
], ids=["raises", "short", "words", "nan", "scalar", "huge"])
def test_a_faulty_user_judge_is_named_with_its_fault(tmp_path, monkeypatch, name, message):
    from align.judges import JudgeFault, python_judge

    monkeypatch.chdir(tmp_path)  # the module sits in the working directory, which is not on sys.path
    monkeypatch.syspath_prepend(str(tmp_path / "elsewhere"))
    monkeypatch.delitem(sys.modules, "userjudges", raising=False)
    (tmp_path / "userjudges.py").write_text(JUDGES)
    responses = ["a", "bb", "ccc", "dddd"]
    assert python_judge("userjudges:good")(["p"] * 4, responses) == [1.0, 2.0, 3.0, 4.0]
    assert python_judge("userjudges:numpy_scores")(["p"] * 4, responses) == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(JudgeFault) as err:
        python_judge(f"userjudges:{name}")(["p"] * 4, responses)
    assert message in str(err.value)
    sys.modules.pop("userjudges", None)


def test_a_judge_module_that_is_nowhere_says_where_it_was_looked_for(tmp_path, monkeypatch):
    from align.judges import JudgeError, python_judge

    monkeypatch.chdir(tmp_path)
    with pytest.raises(JudgeError, match=f"looked in the working directory \\({tmp_path}\\) and on the Python path"):
        python_judge("nosuchjudges:score")


# --------------------------------------------------------------------------------------------- W&B
@pytest.mark.parametrize("setting, env, mode", [
    ("auto", {"WANDB_MODE": "offline", "WANDB_API_KEY": "k" * 40}, "offline"),  # the user's word wins over a key
    ("online", {"WANDB_MODE": "offline"}, "offline"),
    ("auto", {"WANDB_MODE": "disabled", "WANDB_API_KEY": "k" * 40}, None),
    ("auto", {"WANDB_API_KEY": "k" * 40}, "online"),
    ("auto", {"WANDB_MODE": "online"}, "online"),
    ("auto", {}, "offline"),
    ("disabled", {"WANDB_MODE": "online"}, None),
])
def test_the_users_wandb_mode_is_respected(monkeypatch, setting, env, mode):
    from align.core.tracking import wandb_mode

    for key in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert wandb_mode(setting) == mode


# --------------------------------------------------------------------------------------------- exit codes, disk
@pytest.mark.parametrize("rc, needles", [
    (-9, ["SIGKILL", "out-of-memory killer", "per_device_batch_size", "resume: align run p.yaml"]),
    (137, ["SIGKILL", "out-of-memory killer"]),  # a launcher's 128 + 9
    (-15, ["SIGTERM", "time limit or preemption", "resume: align run p.yaml"]),
    (-11, ["SIGSEGV", "crashed"]),
])
def test_a_killed_stage_says_what_its_exit_code_means(rc, needles):
    from align.orchestrator.runner import exit_meaning

    text = exit_meaning(rc, 0, "p.yaml")
    for needle in needles:
        assert needle in text, text


def test_an_ordinary_failure_gets_no_signal_story():
    from align.orchestrator.runner import exit_meaning

    assert exit_meaning(1, 0, "p.yaml") == "" and exit_meaning(2, 0, "p.yaml") == ""


def test_a_full_disk_names_the_output_what_it_needs_and_what_is_free(tmp_path):
    from align.core.fsutil import disk_full

    old = tmp_path / "model"
    old.mkdir()
    (old / "model.safetensors").write_bytes(b"\0" * (3 << 20))
    exc = disk_full(OSError(errno.ENOSPC, "No space left on device", str(old / "x")), old, written=1 << 20)
    assert exc.errno == errno.ENOSPC and exc.filename == str(old / "x")
    text = exc.strerror
    assert "writing model/ needs more than 1.0 MiB (written before the disk filled)" in text
    assert "likely about 3.0 MiB (the output it replaces)" in text and "free there" in text
    assert "what was published before is unchanged" in text


# --------------------------------------------------------------------------------------------- Ctrl-C
def _wait_for(predicate, timeout: float, what: str) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _finish(proc: subprocess.Popen, timeout: float, what: str, stage_dir: Path) -> tuple[str, str]:
    """The runner's output once it exits; on a timeout, everything that says where it hung."""
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stuck = subprocess.run(["ps", "-o", "pid,ppid,stat,wchan:20,etime,cmd", "-g", str(proc.pid)],
                               capture_output=True, text=True).stdout
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        log = (stage_dir / "stage.log").read_text()[-3000:] if (stage_dir / "stage.log").is_file() else ""
        raise AssertionError(f"{what}: still running after {timeout}s\nprocesses:\n{stuck}\nstdout:\n{out[-3000:]}"
                             f"\nstderr:\n{err[-3000:]}\nstage.log:\n{log}") from None


def _sigint_as_at_a_terminal() -> None:
    """In the runner before it starts: SIGINT back to its default. A shell without job control starts
    background commands with SIGINT ignored, and Python then installs no KeyboardInterrupt handler (a CI run
    started with `&` hung here); at a terminal, Ctrl-C is never ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _stopped_run(cwd: Path, stage_dir: Path, ready, what: str, stop, after: str, wait_s: float = 120,
                 **popen) -> tuple[subprocess.Popen, str, str]:
    """`align run faults.yaml` in its own session: once `ready()` holds (`what`), `stop(proc)` sends the signal; the
    runner's output once it exits. A run still there at the end is killed with its whole group."""
    proc = subprocess.Popen(align_cmd("run", "faults.yaml"), cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True, **popen)
    try:
        _wait_for(ready, wait_s, what)
        stop(proc)
        out, err = _finish(proc, 120, after, stage_dir)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc, out, err


def _training(stage_dir: Path) -> bool:
    metrics = stage_dir / "metrics.jsonl"
    return metrics.is_file() and metrics.stat().st_size > 0


def test_ctrl_c_records_the_stage_as_interrupted_and_a_killed_stage_says_why(tmp_path):
    """Ctrl-C as a terminal sends it (SIGINT to the whole process group): exit 130, one paragraph with the
    resume command, no traceback, the stage `interrupted` (resumable), and `align status` reads the run that died
    in its first stage. Then the resumed stage is SIGKILLed, as the OOM killer would: the error says so."""
    (tmp_path / "faults.yaml").write_text(yaml.safe_dump(PIPELINE, sort_keys=False))
    run_dir = tmp_path / "runs" / "faults" / "main"
    proc, out, err = _stopped_run(tmp_path, run_dir / "sft", lambda: _training(run_dir / "sft"),
                                  "sft to log its first metrics", lambda p: os.killpg(p.pid, signal.SIGINT),
                                  "after Ctrl-C", preexec_fn=_sigint_as_at_a_terminal)
    assert proc.returncode == 130, out[-2000:] + err[-2000:]
    assert "Traceback" not in out + err, err[-3000:]
    assert "interrupted during stage 1/2 'sft'" in err and "Resume with: align run faults.yaml" in err, err
    manifest = json.loads((run_dir / "sft" / "manifest.json").read_text())
    assert manifest["status"] == "interrupted", manifest["status"]
    status = run_align("status", str(run_dir), cwd=tmp_path)
    assert status.returncode == 0 and "| sft | sft | interrupted |" in status.stdout, status.stdout + status.stderr

    def kill_the_stage(_runner) -> None:
        process = json.loads((run_dir / "sft" / "manifest.json").read_text())["process"]
        assert process["start"] == "warm"  # forked from the warm server (align/orchestrator/warm.py): its exit code is read too
        os.kill(process["pid"], signal.SIGKILL)

    proc, out, err = _stopped_run(tmp_path, run_dir / "sft",
                                  lambda: (json.loads((run_dir / "sft" / "manifest.json").read_text()).get("attempts")
                                           == 2 and _training(run_dir / "sft")),
                                  "the second attempt to start", kill_the_stage, "after the stage was killed")
    assert proc.returncode == 2 and "Traceback" not in err, err[-3000:]
    assert "SIGKILL: most often the kernel's out-of-memory killer" in err, err[-3000:]
    assert "resume: align run faults.yaml" in err
    assert "SIGKILL: most often the kernel's out-of-memory killer" in (run_dir / "sft" / "stage.log").read_text()
    killed = json.loads((run_dir / "sft" / "manifest.json").read_text())  # not `running`: worker nodes read it
    assert killed["status"] == "failed" and "exited with code" in killed["error"], killed.get("error")


def test_sigterm_stops_a_stage_as_ctrl_c_does_and_the_next_run_resumes(tmp_path):
    """SIGTERM, what schedulers (a time limit, preemption) and `systemctl stop` send, to the runner alone: it passes
    it on, the stage records itself `interrupted` naming SIGTERM, the runner exits 143 with the resume command and
    no traceback; the next run resumes the stage."""
    (tmp_path / "faults.yaml").write_text(yaml.safe_dump(PIPELINE, sort_keys=False))
    run_dir = tmp_path / "runs" / "faults" / "main"
    proc, out, err = _stopped_run(tmp_path, run_dir / "sft",
                                  lambda: complete_checkpoints(run_dir / "sft" / "checkpoints"), "sft's first checkpoint",
                                  lambda p: os.kill(p.pid, signal.SIGTERM),  # the runner only: it must pass it on
                                  "after SIGTERM", wait_s=180)
    assert proc.returncode == 143, out[-2000:] + err[-2000:]
    assert "Traceback" not in out + err, err[-3000:]
    assert "stopped by SIGTERM during stage 1/2 'sft'" in err and "Resume with: align run faults.yaml" in err, err
    manifest = json.loads((run_dir / "sft" / "manifest.json").read_text())
    assert manifest["status"] == "interrupted" and "SIGTERM" in manifest["error"], manifest.get("error")
    kept = complete_checkpoints(run_dir / "sft" / "checkpoints")
    assert kept, "SIGTERM lost the stage's checkpoints"
    again = subprocess.Popen(align_cmd("run", "faults.yaml"), cwd=tmp_path, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    try:  # (the stage trains for 100000 steps: it is stopped once it has resumed)
        _wait_for(lambda: "resuming from" in (run_dir / "sft" / "stage.log").read_text(errors="replace"), 180,
                  "the second run to resume")
    finally:
        os.killpg(again.pid, signal.SIGKILL)
        again.wait()
    log = (run_dir / "sft" / "stage.log").read_text(errors="replace")
    assert f"(step {kept[-1]})" in log.split("resuming from")[-1].splitlines()[0], log[-2000:]
    assert json.loads((run_dir / "sft" / "manifest.json").read_text())["attempts"] == 2


def test_a_save_that_filled_the_disk_inside_a_library_is_one_line_naming_the_directory(tmp_path):
    """torch.save and safetensors report a full disk as a RuntimeError (no OSError, no path): the stage says where,
    how much is free, and the fix; any other error is left to the traceback in the manifest."""
    from align.core.fsutil import write_failure

    torch_full = RuntimeError("[enforce fail at inline_container.cc:603] . PytorchStreamWriter failed writing file "
                              "data/3: file write failed")
    message = write_failure(torch_full, tmp_path)
    assert message.startswith(f"{tmp_path}: a save failed (RuntimeError: [enforce fail")
    assert "GiB free there now" in message and "save_total_limit" in message and "resumes from its last complete checkpoint" in message
    assert write_failure(RuntimeError("Error while serializing: IoError(No space left on device)"), tmp_path)
    assert write_failure(RuntimeError("basic_ios::clear: iostream error"), tmp_path)  # torch's stream writer, full tmpfs
    assert write_failure(RuntimeError("CUDA out of memory"), tmp_path) is None
    assert write_failure(OSError(28, "No space left on device"), tmp_path) is None  # an OSError names its own path


def test_a_full_disk_in_a_helper_process_is_one_line_naming_the_path(tmp_path, monkeypatch):
    """A conversion into a full cache (`align model`) writes in the helper process: its ENOSPC comes back as a
    refusal naming the file and the free space, not the helper's traceback."""
    from align.orchestrator import helper

    target = tmp_path / "hf"
    monkeypatch.setenv("PYTHONPATH", str(Path(__file__).parent))  # where the helper finds its test target
    with pytest.raises(helper.PipelineError) as err:
        helper.call("tests_helper_full_disk:save", target=str(target))
    message = str(err.value)
    assert message.startswith(f"{target / 'model.safetensors'}: No space left on device while writing (")
    assert "GiB free there now" in message and "ALIGN_CACHE" in message and "Traceback" not in message


def test_the_resume_command_is_the_command_as_typed(monkeypatch):
    """A run started with --run-id or overrides resumes only with them: the runner's messages (Ctrl-C, SIGTERM, a
    killed stage) give the command line as it was typed (less --force, which would restart what is done), not a bare
    `align run PIPELINE` that would start another run at the pipeline's own settings."""
    from align import cli
    from align.orchestrator import runner

    assert runner.resume_command("p.yaml") == "align run p.yaml"  # outside a command: the pipeline alone
    seen = []
    monkeypatch.setattr(cli, "_command", lambda args: seen.append(runner.exit_meaning(-9, 0, "p.yaml")) or 0)
    assert cli.main(["run", "p.yaml", "--run-id", "r1", "--force", "sft.max_steps=3", "ppo.note=a b"]) == 0
    assert "SIGKILL" in seen[0]
    assert "resume: align run p.yaml --run-id r1 sft.max_steps=3 'ppo.note=a b' (the stage restarts" in seen[0], seen[0]
    assert runner.resume_command("p.yaml") == "align run p.yaml"  # the command's scope ended with it
    seen.clear()  # --from restarts a completed stage from scratch: a resume leaves it out (the forced stage is
    # interrupted, and resumes unasked, or completed by the time the message shows)
    monkeypatch.setattr(cli, "_command", lambda args: seen.append((runner.exit_meaning(-9, 0, "p.yaml"),
                                                                   runner.rerun_from("p.yaml", "reward"))) or 0)
    assert cli.main(["run", "p.yaml", "--from", "sft", "--run-id", "r1", "--only=dpo", "x.y=1"]) == 0
    assert "resume: align run p.yaml --run-id r1 --only=dpo x.y=1 (the stage" in seen[0][0], seen[0][0]
    assert seen[0][1] == "align run p.yaml --run-id r1 x.y=1 --from reward"  # a damaged stage's rerun: same run
    assert cli.main(["run", "p.yaml", "--from=sft", "--only", "dpo"]) == 0
    assert "resume: align run p.yaml --only dpo (the stage" in seen[1][0] and seen[1][1] == (
        "align run p.yaml --from reward")


def test_rebuilding_a_report_keeps_the_runs_own_command_in_its_record(tmp_path):
    """`align report runs/p/r1` wrote its own command into pipeline.json's `resume`, from which `align status` builds
    its hints: a damaged stage's rerun then came out as `align run p.yaml --from X`, without --run-id r1 (another
    run). The record keeps the `align run` it had, or names the run."""
    from align.orchestrator.commands import resume_as, run_command

    (tmp_path / "pipeline.json").write_text(json.dumps({"resume": "align run p.yaml --run-id r1 x.y=1"}))
    with resume_as("align report runs/p/r1"):
        assert run_command(tmp_path, "p.yaml", "r1") == "align run p.yaml --run-id r1 x.y=1"
        (tmp_path / "pipeline.json").write_text("{not json")
        assert run_command(tmp_path, "p.yaml", "r1") == "align run p.yaml --run-id r1"
    with resume_as("align run p.yaml --run-id r1 --only dpo"):  # a run's own command is recorded as typed
        assert run_command(tmp_path, "p.yaml", "r1") == "align run p.yaml --run-id r1 --only dpo"


def test_a_forced_stage_stopped_before_it_began_is_named_in_the_resume_command(tmp_path):
    """--from X stopped before X's process wrote `running`: X still reads `completed` (its earlier run), so the plain
    resume would skip it; the message reruns it by name. A stage that began (or was not forced) resumes plainly."""
    from align.core.rundir import write_manifest
    from align.orchestrator import runner
    from align.orchestrator.commands import resume_as

    write_manifest(tmp_path / "dpo", {"stage": "dpo", "status": "completed", "fingerprint": "f", "outputs": ["model"]})
    (tmp_path / "dpo" / "model").mkdir()
    write_manifest(tmp_path / "ppo", {"stage": "ppo", "status": "interrupted", "fingerprint": "f"})
    with resume_as("align run p.yaml --run-id r1"):
        assert runner._again("dpo", {"dpo", "ppo"}, tmp_path / "dpo", "p.yaml") == "align run p.yaml --run-id r1 --from dpo"
        assert runner._again("ppo", {"dpo", "ppo"}, tmp_path / "ppo", "p.yaml") == "align run p.yaml --run-id r1"
        assert runner._again("dpo", set(), tmp_path / "dpo", "p.yaml") == "align run p.yaml --run-id r1"


def test_a_stage_that_failed_before_its_context_existed_still_resumes_its_checkpoints(tmp_path):
    """A stage stopped while its process group formed (preemption, an NCCL error) is recorded from its spec alone:
    with the inputs it was to read, so the next run still resumes its checkpoints (`resumes` compares them)."""
    from align.core.rundir import read_manifest
    from align.runtime.process import _record_failure, resumes

    digests = {"sft": {"content": "c1", "publication": "p1"}}
    spec = {"stage_dir": str(tmp_path), "stage_name": "dpo", "fingerprint": "f1", "input_digests": digests}
    _record_failure(None, spec, "interrupted while the process group formed", status="interrupted")
    assert resumes(read_manifest(tmp_path), "f1", digests)


# --------------------------------------------------------------------------------------------- orphans
CHILD = """
import os, sys, time
from align.core.errors import die_with_parent, terminate_as_interrupt, Terminated
terminate_as_interrupt()
assert die_with_parent()
open(sys.argv[1] + ".ready", "w").close()
try:
    time.sleep(120)
except Terminated:
    open(sys.argv[1] + ".tmp", "w").write("terminated")
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])  # whole or absent: the test may look at any moment
"""
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], start_new_session=True)
print(child.pid, flush=True)
time.sleep(120)
"""


def _kill_the_starter(starter: str, child: str, marker: Path, **popen) -> int:
    """Run `starter` (it starts `child`, which writes `marker` on SIGTERM, and prints the child's pid), SIGKILL the
    starter once the child has its signal handlers (it says so in `<marker>.ready`; a fixed wait was too short on a
    loaded CI machine), and wait up to 30 s for the marker, which the child writes whole. Returns the pid."""
    parent = subprocess.Popen([sys.executable, "-c", starter, child, str(marker)], stdout=subprocess.PIPE, text=True,
                              **popen)
    child_pid = int(parent.stdout.readline())
    ready, deadline = Path(f"{marker}.ready"), time.time() + 120
    while not ready.exists() and time.time() < deadline:
        time.sleep(0.1)
    assert ready.exists(), f"process {child_pid} did not start within 120 s"
    parent.kill()
    parent.wait()
    deadline = time.time() + 30
    while not marker.exists() and time.time() < deadline:
        time.sleep(0.1)
    return child_pid


def test_a_stage_process_does_not_outlive_its_launcher(tmp_path):
    """A process that called die_with_parent (every stage process does) is sent SIGTERM, which it records as an
    interrupt, when the process that started it is SIGKILLed, even in a session of its own (as torchrun starts its
    workers, out of reach of a kill of the run's process group)."""
    marker = tmp_path / "child.txt"
    child_pid = _kill_the_starter(PARENT, CHILD, marker)
    assert marker.read_text() == "terminated"
    deadline = time.time() + 10
    while time.time() < deadline:  # gone, or a zombie nobody reaps (its parent is dead)
        try:
            if Path(f"/proc/{child_pid}/stat").read_text().split(") ")[1][0] == "Z":
                break
        except FileNotFoundError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"process {child_pid} still runs after its parent was killed")


LAUNCHER = """
import os, sys, time
from align.core.errors import terminate_as_interrupt, Terminated
terminate_as_interrupt()  # no die_with_parent: accelerate's launcher calls none
open(sys.argv[1] + ".ready", "w").close()
try:
    time.sleep(120)
except Terminated:
    open(sys.argv[1] + ".tmp", "w").write("terminated")
    os.replace(sys.argv[1] + ".tmp", sys.argv[1])  # whole or absent: the test may look at any moment
"""
RUNNER = """
import os, sys, time
from align.orchestrator import warm
launcher = warm.start_stage([sys.executable, "-c", sys.argv[1], sys.argv[2]], dict(os.environ), warm_start=False)
print(launcher.pid, flush=True)
time.sleep(120)
"""


def test_a_stage_launcher_does_not_outlive_a_sigkilled_runner(tmp_path):
    """`kill -9` of `align run` alone signals no process group and releases the run's lock: the stage's launcher
    (accelerate launch, which starts the stage's processes and calls no die_with_parent) is started to receive
    SIGTERM when the runner dies, so it cannot train on beside the next run of the same stage."""
    marker = tmp_path / "launcher.txt"
    launcher_pid = _kill_the_starter(RUNNER, LAUNCHER, marker, cwd=REPO)
    assert marker.exists() and marker.read_text() == "terminated", f"launcher {launcher_pid} outlived its runner"


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664), (0o077, 0o600)])
def test_a_published_output_is_as_readable_as_the_umask_allows(tmp_path, umask, mode):
    """transformers writes model.safetensors 0600 whatever the umask: a model published on a shared cluster
    filesystem was unreadable to the user's own group. Publishing gives each file what the umask allows, and takes
    nothing away (an executable bit stays)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from align.core.fsutil import publish_dir, staging_dir

    final = tmp_path / "model"
    old = os.umask(umask)
    try:
        tmp = staging_dir(final)
        LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                     num_attention_heads=2, num_key_value_heads=2)).save_pretrained(tmp)
        (tmp / "run.sh").write_text("#!/bin/sh\n")
        (tmp / "run.sh").chmod(0o700)
        (tmp / "extra.bin").write_bytes(b"x")
        (tmp / "extra.bin").chmod(0o600)  # as transformers leaves model.safetensors (a newer one may mend it)
        publish_dir(tmp, final)
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in final.iterdir()}
    assert modes.pop("run.sh") == 0o700 | mode
    assert set(modes) >= {"model.safetensors", "config.json", "extra.bin"} and set(modes.values()) == {mode}, modes


def test_a_signal_between_the_two_renames_of_a_publication_puts_the_old_output_back(tmp_path, monkeypatch):
    """SIGTERM arrives as an exception: raised right after the old output was renamed aside and before the new one
    was renamed in, it left no output at all (the stage's handler then removed the staging directory)."""
    from align.core import fsutil
    from align.core.errors import Terminated

    final = tmp_path / "model"
    final.mkdir()
    (final / "weights").write_text("old")
    tmp = fsutil.staging_dir(final)
    (tmp / "weights").write_text("new")
    real, calls = os.replace, []

    def replace(src, dst):
        real(src, dst)
        calls.append(Path(dst).name)
        if len(calls) == 1:  # the old output is aside now: the signal lands here
            raise Terminated("SIGTERM")

    monkeypatch.setattr(fsutil.os, "replace", replace)
    with pytest.raises(Terminated):
        fsutil.publish_dir(tmp, final)
    assert (final / "weights").read_text() == "old" and not tmp.exists()
    os.replace(final, tmp_path / ".model.old")  # SIGKILLed there instead: only the aside copy is left
    again = fsutil.staging_dir(final)
    (again / "weights").write_text("newer")
    calls.clear()  # the next publication fails too, after its first rename: the old output is back, not deleted
    with pytest.raises(Terminated):
        fsutil.publish_dir(again, final)
    assert (final / "weights").read_text() == "old"


def test_a_report_of_a_run_whose_pipeline_file_moved_says_how_to_rebuild_it(tmp_path):
    """`align report` of a run whose pipeline file is gone said so and stopped there: it names the fix."""
    from align.core.errors import PipelineError
    from align.orchestrator.report import rebuild

    run = tmp_path / "runs" / "p" / "main"
    run.mkdir(parents=True)
    gone = tmp_path / "moved.yaml"
    (run / "pipeline.json").write_text(json.dumps({"stages": [], "config": {}, "source": str(gone)}))
    with pytest.raises(PipelineError, match=rf"the pipeline file this run came from \({re.escape(str(gone))}\) is "
                                            r"gone; put it \(and the data cards beside it\) back there"):
        rebuild(run)



def test_a_report_accepts_a_stage_that_published_a_lora_adapter_and_names_both_forms_when_neither_is_whole(tmp_path):
    """`align report` required a whole model's config.json and weights: every stage of a LoRA pipeline publishes its
    adapter alone, so the report of pipelines/smollm2_hh.yaml was refused with a fix (--from sft) that never helped."""
    from align.core.errors import PipelineError
    from align.core.rundir import write_manifest
    from align.orchestrator.report import check_model_dir

    model = tmp_path / "sft" / "model"
    model.mkdir(parents=True)
    write_manifest(tmp_path / "sft", {"stage": "sft", "status": "completed"})
    for name in ("adapter_config.json", "align_adapter.json"):
        (model / name).write_text("{}")
    with pytest.raises(PipelineError, match="neither a model's config.json and weights nor a LoRA adapter's"):
        check_model_dir(tmp_path, "sft")
    (model / "adapter_model.safetensors").write_bytes(b"\0")
    check_model_dir(tmp_path, "sft")  # an adapter with its weights is a model the evaluate stage loads


def test_a_reused_stage_says_when_this_run_would_start_it_on_another_process_count(tmp_path):
    """A completed stage's fingerprint covers its settings, not where it ran: reused under another process count
    (its global batch differs), the skip line says so and how to retrain it."""
    import yaml

    from align.config import parse_pipeline
    from align.core.rundir import write_manifest
    from align.orchestrator.launch import world_change
    from align.orchestrator.plan import build_plan

    source = REPO / "pipelines" / "default.yaml"
    raw = yaml.safe_load(source.read_text())
    raw["stages"]["dpo"].update(accelerate="zero2", num_processes=2)
    plans = {p.name: p for p in build_plan(parse_pipeline(raw, str(source)), source)}
    for stage, world in (("sft", 1), ("dpo", 2), ("reward", 4)):
        write_manifest(tmp_path / stage, {"stage": stage, "status": "completed", "world_size": world})
    assert world_change(plans["sft"], tmp_path, source, None, 1) == ""
    assert world_change(plans["dpo"], tmp_path, source, None, 1) == ""
    assert "trained on 2 processes, this run would start 4" in world_change(plans["dpo"], tmp_path, source, None, 2)
    note = world_change(plans["reward"], tmp_path, source, None, 1)
    assert "trained on 4 processes, this run would start 1 (another global batch)" in note and "--from reward" in note


def test_a_copied_or_renamed_runs_command_names_its_own_run_id():
    """`cp -a runs/p/r1 runs/p/r1copy`: status and a rebuilt report kept the command typed for r1, so the rerun they
    named retrained the intact original (after a `mv`, started an empty run) instead of this one."""
    from align.orchestrator.commands import recorded_run

    for typed, expected in (("align run p.yaml --run-id r1 x.y=1", "align run p.yaml --run-id r1copy x.y=1"),
                            ("align run p.yaml --run-id=r1 --only dpo", "align run p.yaml --run-id r1copy --only dpo"),
                            ("align run p.yaml x.y=1", "align run p.yaml x.y=1 --run-id r1copy"),
                            ("align run p.yaml --run-id r1copy", "align run p.yaml --run-id r1copy"),
                            (None, "align run p.yaml --run-id r1copy")):
        assert recorded_run(typed, "p.yaml", "r1copy") == expected, typed


def test_a_failure_of_another_process_reaches_the_manifest_not_interrupted(tmp_path, monkeypatch):
    """Only the main process writes the manifest; when process 3 of 8 failed (an OOM on one GPU, a judge's error on
    its share), the launcher stopped the main one with SIGTERM and the manifest said `interrupted` (stopped by
    SIGTERM), the real error only in the log. The failing process records it (failed.rank3.json) and the main one,
    stopped, records that failure; the main process removes an earlier attempt's record as the next one starts."""
    from types import SimpleNamespace

    from align.runtime import process
    from align.runtime.process import _record_failure, rank_failure

    other = SimpleNamespace(is_main=False, dir=tmp_path, state=SimpleNamespace(process_index=3), tracker=None,
                            write_manifest=lambda *a, **k: None)  # not the main process: writes no manifest
    main = SimpleNamespace(is_main=True, dir=tmp_path)
    assert rank_failure(main) is None
    _record_failure(other, {}, "CUDA out of memory. Tried to allocate 2.00 GiB")
    assert rank_failure(main) == "process 3: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert rank_failure(other) is None  # only the main process reads them
    # the runner, where the main process was SIGKILLed (NCCL, mid-CUDA call): those written since the launch
    from align.core.errors import recorded_failure

    assert recorded_failure(tmp_path, since=time.time() - 60) == rank_failure(main)
    assert recorded_failure(tmp_path, since=time.time() + 60) is None  # an earlier launch's

    class Next(Exception):
        pass

    def barrier(*args):  # the next attempt's start, up to its first barrier: stop there
        raise Next

    ctx = SimpleNamespace(is_main=True, dir=tmp_path, fingerprint="f", spec=SimpleNamespace(input_digests={}),
                          checkpoints=tmp_path / "checkpoints", state=SimpleNamespace(wait_for_everyone=barrier))
    monkeypatch.setattr(process, "resumes", lambda *a: False)
    with pytest.raises(Next):
        process._run(ctx)
    assert rank_failure(main) is None  # the earlier attempt's record went as the next attempt started
    _record_failure(other, {}, "stopped", status="interrupted")  # an interrupt is not a failure to pass on
    assert rank_failure(main) is None


def test_a_reports_rebuild_tells_a_damaged_input_to_rerun_in_its_own_run(tmp_path, monkeypatch):
    """`align report runs/p/r2` ran evaluate under the command typed (`align report ...`): a damaged input's fix then
    read `align run p.yaml --from X`, without --run-id r2 or the run's overrides, and retrained X in runs/p/main."""
    from types import SimpleNamespace

    from align.config.contract import REPORT
    from align.orchestrator import report
    from align.orchestrator.commands import rerun_from, resume_as

    run = tmp_path / "runs" / "p" / "r2"
    run.mkdir(parents=True)
    source = tmp_path / "p.yaml"
    source.write_text("name: p\n")
    (run / "pipeline.json").write_text(json.dumps({"stages": [], "config": {}, "source": str(source),
                                                   "resume": f"align run {source} --run-id r2 dpo.beta=0.3"}))
    evaluate = SimpleNamespace(PRODUCES=REPORT, references=lambda role: [])
    monkeypatch.setattr(report, "parse_pipeline", lambda config, src: SimpleNamespace(stages={"eval": evaluate}))
    hints = []
    monkeypatch.setattr(report, "run", lambda cfg, src, **kw: hints.append(rerun_from(src, "dpo")))
    with resume_as("align report runs/p/r2"):
        report.rebuild(run)
    assert hints == [f"align run {source} --run-id r2 dpo.beta=0.3 --from dpo"], hints


def test_status_reads_a_pipeline_path_with_an_equals_sign_and_resumes_without_another_stages_only():
    """`align status` took a pipeline named `pipelines/lr=1e-3.yaml` (launch.sh takes such names) for an override, and
    the run no longer planned; its resume hint for an interrupted stage kept the last command's `--only dpo`, which
    never resumes that stage."""
    from align.orchestrator.commands import without_only
    from align.orchestrator.status import recorded_overrides

    assert recorded_overrides("align run 'pipelines/lr=1e-3.yaml' dpo.beta=0.2 --run-id r1") == ["dpo.beta=0.2"]
    assert recorded_overrides("align run --run-id r1 p.yaml a.b=1") == ["a.b=1"]
    assert without_only("align run p.yaml --only dpo --run-id r1 x.y=1") == "align run p.yaml --run-id r1 x.y=1"
    assert without_only("align run p.yaml --only=dpo") == "align run p.yaml"
    assert without_only("align run p.yaml --only dpo x=1", "dpo") == "align run p.yaml --only dpo x=1"  # its own
    assert without_only("align run p.yaml --only dpo x=1", "ppo") == "align run p.yaml x=1"
