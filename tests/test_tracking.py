"""Experiment tracking and secrets (a probe of W&B, logs and secrets, 2026-11-30): a resumed stage started a second
W&B run, a failed stage showed as finished in W&B, WANDB_MODE=OFFLINE failed every stage at its start, a machine
without network failed every stage with a traceback instead of logging offline, sample tables kept a killed
attempt's rows and wrote bare NaN, and a judge's base_url with user:password@ printed the password. W&B itself is
a stand-in here (no network; the real offline run is tests/test_pipeline_e2e.py). Seed: SEED, printed."""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import types

import pytest

from conftest import REPO, refused, validate

DEFAULT = str(REPO / "pipelines" / "default.yaml")
SEED = 20261130
SECRET = "sk-test-" + "9" * 24  # a key-shaped value in an environment variable named like a key


class FakeRun:
    def __init__(self, kwargs):
        self.id, self.entity, self.project = kwargs["id"], "team", kwargs["project"]
        self.dir = str(kwargs["dir"]) + "/wandb/run/files"
        self.settings = types.SimpleNamespace(mode=kwargs["mode"])
        self.summary, self.logged, self.exit_code = {}, [], None

    def log(self, row, step):
        self.logged.append((step, row))

    def finish(self, exit_code=None):
        self.exit_code = exit_code


def fake_wandb(monkeypatch, fail_modes=(), finish_error=None):
    """A stand-in `wandb` module: init fails for the modes in `fail_modes` (as wandb does without network), and
    records every call."""
    calls = []

    def init(**kwargs):
        calls.append(kwargs)
        if kwargs["mode"] in fail_modes:
            raise RuntimeError(f"CommError: no such host (key {SECRET})")
        run = FakeRun(kwargs)
        if finish_error:
            run.finish = lambda exit_code=None: (_ for _ in ()).throw(finish_error)
        return run

    module = types.SimpleNamespace(init=init, Settings=lambda **kw: kw, Table=dict, Image=str)
    monkeypatch.setitem(sys.modules, "wandb", module)
    return calls


def tracker(tmp_path, setting="offline", resume=False):
    from align.core.tracking import Tracker

    return Tracker(tmp_path, main_process=True, wandb_setting=setting, project="p", entity=None, group="g/r",
                   name="ppo", job_type="ppo", config={"api_key": SECRET}, resume=resume)


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for key in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_DISABLED"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("MY_JUDGE_KEY", SECRET)
    print("seed", SEED)


def test_a_resumed_attempt_continues_its_wandb_run_past_its_steps_else_starts_one_holding_metrics_jsonl(tmp_path,
                                                                                                     monkeypatch):
    """W&B drops a step at or below the last one a run holds: an attempt resumed from the checkpoint before the kill
    logs steps again, so it starts a new run that first gets metrics.jsonl's rows; one resumed past every logged step
    continues the run. A fresh attempt (another config, --force) starts its own."""
    from align.core.tracking import keep_metrics_until

    calls = fake_wandb(monkeypatch)
    first = tracker(tmp_path)
    for step in (1, 2, 3):
        first.log({"loss": 1.0 / step}, step)
    first_id = first.finish()["id"]  # killed after step 3, its last checkpoint at 3
    second = tracker(tmp_path, resume=True)
    second.log({"loss": 0.25}, 4)
    assert calls[1]["id"] == first_id and calls[1]["resume"] == "allow" and second.run.logged == [(4, {"loss": 0.25})]
    second.finish()
    third = tracker(tmp_path, resume=True)  # killed after step 4, its last checkpoint at 2: the stage trims
    keep_metrics_until(tmp_path / "metrics.jsonl", 2)  # metrics.jsonl after the tracker starts (runtime/trl.py)
    third.log({"loss": float("nan")}, 3)
    assert calls[2]["id"] != first_id and calls[2]["config"]["resumed_from"] == first_id and "resume" not in calls[2]
    assert [s for s, _ in third.run.logged] == [1, 2, 3]  # the new run holds what metrics.jsonl holds
    assert third.run.logged[0] == (1, {"loss": 1.0}) and third.run.logged[2][1]["loss"] != third.run.logged[2][1]["loss"]
    assert third.finish()["id"] == calls[2]["id"] and calls[2]["config"]["api_key"] == "<redacted>"
    fresh = tracker(tmp_path, resume=False)
    fresh.log({"loss": 1.0}, 1)
    assert calls[3]["id"] not in (calls[2]["id"], first_id) and "resumed_from" not in calls[3]["config"]
    (tmp_path / "wandb" / "align_run_id").write_text("../../etc\n")  # a damaged record is not an id
    damaged = tracker(tmp_path, resume=True)
    damaged.log({"loss": 1.0}, 9)
    assert calls[4]["id"] != "../../etc" and len(calls[4]["id"]) == 16


def test_an_attempt_after_two_kills_does_not_continue_a_wandb_run_holding_its_steps(tmp_path, monkeypatch):
    """The W&B run's last step was read from metrics.jsonl, which a resume trims to its checkpoint: an attempt killed
    before it logged left the trimmed file, and the next one continued the run that held the dropped steps, so W&B
    silently dropped its re-logged ones and kept the killed attempt's values."""
    from align.core.tracking import keep_metrics_until

    calls = fake_wandb(monkeypatch)
    first = tracker(tmp_path)
    for step in (5, 10, 15):
        first.log({"loss": 1.0 / step}, step)
    first_id = first.finish()["id"]  # killed after step 15, its checkpoint at 10
    tracker(tmp_path, resume=True)  # the second attempt trims metrics.jsonl, then is killed before it logs
    keep_metrics_until(tmp_path / "metrics.jsonl", 10)
    third = tracker(tmp_path, resume=True)
    keep_metrics_until(tmp_path / "metrics.jsonl", 10)
    third.log({"loss": 0.5}, 15)
    assert calls[-1]["id"] != first_id and calls[-1]["config"]["resumed_from"] == first_id
    assert third.run.logged == [(5, {"loss": 0.2}), (10, {"loss": 0.1}), (15, {"loss": 0.5})]
    third.log({"loss": 0.4}, 20)
    third.finish()
    fourth = tracker(tmp_path, resume=True)  # resumed past every step the new run holds: it continues that one
    fourth.log({"loss": 0.3}, 25)
    assert calls[-1]["id"] == calls[-2]["id"] and calls[-1]["resume"] == "allow"


def test_no_network_logs_offline_and_a_wandb_that_cannot_start_leaves_local_metrics(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # `auto` with a key: online
    calls = fake_wandb(monkeypatch, fail_modes=("online",))
    t = tracker(tmp_path / "sft", "auto")
    t.log({"loss": 1.0}, 1)
    assert [c["mode"] for c in calls] == ["online", "offline"] and t.finish()["mode"] == "offline"
    err = capsys.readouterr().err
    assert "W&B did not start online" in err and "WANDB_MODE=offline" in err and SECRET not in err

    calls = fake_wandb(monkeypatch)  # the run's next stage does not wait for an unreachable W&B again
    mark = tmp_path / ".wandb_unreachable"
    first_mark = mark.read_text()
    os.utime(mark, (mark.stat().st_atime - 1800, mark.stat().st_mtime - 1800))  # marked half an hour ago
    t = tracker(tmp_path / "dpo", "auto")
    t.summary({"done": 1})
    assert t.finish()["mode"] == "offline" and [c["mode"] for c in calls] == ["offline"]
    assert "could not reach it" in capsys.readouterr().err
    assert mark.read_text() == first_mark and time.time() - mark.stat().st_mtime > 1700  # not renewed by a skip
    os.utime(mark, (0, 0))  # an hour and more ago: the next stage tries online again
    calls = fake_wandb(monkeypatch)
    tracker(tmp_path / "reward", "auto").summary({"done": 1})
    assert [c["mode"] for c in calls] == ["online"]

    calls = fake_wandb(monkeypatch, fail_modes=("online", "offline"))
    t = tracker(tmp_path / "ppo", "auto")  # failing online now re-marks the run
    t.log({"loss": 0.5}, 3)
    assert t.run is None and "no such host" in t.finish()["error"] and SECRET not in t.finish()["error"]
    assert json.loads((tmp_path / "ppo" / "metrics.jsonl").read_text())["loss"] == 0.5
    assert "metrics.jsonl only" in capsys.readouterr().err


def test_a_failed_stage_records_its_failure_first_then_ends_its_wandb_run_as_failed(tmp_path, monkeypatch, capsys):
    from align.runtime.process import _record_failure

    fake_wandb(monkeypatch, finish_error=ConnectionError("the network went"))
    order = []
    t = tracker(tmp_path)
    t.log({"loss": 1.0}, 1)
    run = t.run
    run_finish = run.finish
    run.finish = lambda exit_code=None: (order.append(("finish", exit_code)), run_finish(exit_code))
    ctx = types.SimpleNamespace(tracker=t, dir=tmp_path, is_main=True,
                                write_manifest=lambda status, **kw: order.append((status, kw["wandb"]["id"])))
    where = _record_failure(ctx, {}, "boom")
    assert order == [("failed", run.id), ("finish", 1)] and "manifest" in where
    assert "did not close cleanly" in capsys.readouterr().err  # the W&B error is a warning, not a second failure


@pytest.mark.parametrize("env, mode", [
    ({"WANDB_MODE": " OFFLINE "}, "offline"),
    ({"WANDB_DISABLED": "true", "WANDB_API_KEY": "k" * 40}, None),  # the transformers convention
    ({"WANDB_DISABLED": "false", "WANDB_API_KEY": "k" * 40}, "online"),
])
def test_wandb_mode_in_any_case_and_wandb_disabled_are_read(monkeypatch, env, mode):
    from align.core.tracking import wandb_mode

    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert wandb_mode("auto") == mode


def test_the_environments_wandb_mode_is_handed_to_wandb_as_it_accepts_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", " Offline")
    calls = fake_wandb(monkeypatch)
    tracker(tmp_path, "auto").finish(failed=True)  # a stage that failed before it logged anything still shows
    assert os.environ["WANDB_MODE"] == "offline" and calls[0]["mode"] == "offline"


def test_a_wandb_mode_wandb_refuses_is_said_at_validate(monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "bogus")
    rc, out = validate(capsys, DEFAULT)
    refused(out, rc, "tracking.wandb", "WANDB_MODE is 'bogus'", "online, offline, dryrun, disabled")
    rc, out = validate(capsys, DEFAULT, "tracking.wandb=disabled")  # W&B off: the variable is not read
    assert rc == 0, out[-2000:]


def test_sample_tables_write_nan_as_json_does_and_a_resume_drops_a_killed_attempts_rows(tmp_path, monkeypatch):
    from align.stages.ppo.checkpoint import restore_history

    fake_wandb(monkeypatch)
    t = tracker(tmp_path)
    for step in (1, 2, 3):
        t.table("samples", ["prompt", "response", "score"], [["p", "r", float("nan") if step == 2 else 0.5]], step)
        t.log({"objective/scores": 0.5}, step)

    def strict(text):
        return [json.loads(line, parse_constant=lambda c: pytest.fail(f"bare {c}")) for line in text.splitlines()]

    rows = strict((tmp_path / "samples.jsonl").read_text())
    assert rows[1]["score"] == "nan"
    ctx = types.SimpleNamespace(dir=tmp_path, is_main=True, state=types.SimpleNamespace(wait_for_everyone=lambda: None))
    assert len(restore_history(ctx, 2)) == 2  # resumed from the checkpoint of iteration 2
    assert [r["step"] for r in strict((tmp_path / "samples.jsonl").read_text())] == [1, 2]


def test_scrub_removes_credentials_written_into_urls():
    from align.core.tracking import scrub

    text = scrub({"cmd": f"judge at https://alice:hunter2secret@judge.example.com/v1?api_key=abc123&model=m {SECRET}",
                  "url": "http://svc.local:8000/v1?token=tok999"})
    assert "hunter2secret" not in text["cmd"] and "abc123" not in text["cmd"] and SECRET not in text["cmd"]
    assert "judge.example.com/v1" in text["cmd"] and "model=m" in text["cmd"] and "tok999" not in text["url"]
    assert "pa/ss" not in scrub("http://bob:pa/ss@host/v1") and "sig123" not in scrub("s3://b/k?X-Amz-Signature=sig123")
    kept = ["hf://datasets/org/name@rev", "git+https://github.com/org/pkg@v1.2", "git@github.com:org/repo",
            "alice@example.com", "max_new_tokens=32"]
    assert [scrub(x) for x in kept] == kept


@pytest.mark.parametrize("url, needles", [
    ("http://alice:hunter2secret@127.0.0.1:9/v1", ["carries credentials in the URL", "http://***@127.0.0.1:9/v1"]),
    ("https://alice:hunter2secret@judge.example.com/v1", ["carries credentials in the URL"]),  # urllib: "nonnumeric port"
    ("http://alice:hunter2/secret@127.0.0.1:9/v1", ["carries credentials in the URL", "http://***@127.0.0.1:9/v1"]),
    ("http://alice:hunter2?secret@127.0.0.1/v1", ["carries credentials in the URL"]),
    ("http://127.0.0.1:eighty/v1", ["is not a URL", "http://host:8000/v1"]),
])
def test_a_judge_url_with_credentials_or_a_bad_port_is_refused_without_echoing_them(url, needles, capsys):
    rc, out = validate(capsys, DEFAULT, f"preferences.pairwise={{name: j, model: m, base_url: '{url}'}}",
                       "preferences.samples_per_prompt=2")
    refused(out, rc, "stages.preferences", "pairwise.base_url", *needles)
    assert "hunter2secret" not in out


def test_a_server_that_does_not_speak_http_is_not_reachable_not_a_traceback():
    from align.core.endpoints import endpoint_problem

    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def answer():
        conn, _ = server.accept()
        conn.sendall(b"SSH-2.0-OpenSSH_9.6\r\n")
        conn.close()

    threading.Thread(target=answer, daemon=True).start()
    problem = endpoint_problem(f"http://127.0.0.1:{server.getsockname()[1]}/v1", SECRET, 5.0, "judge")
    server.close()
    assert problem.startswith("not reachable (") and SECRET not in problem


def test_trainer_log_keys_get_aligns_names_evaluation_and_end_of_training_alike():
    """TRL's plural reward keys were renamed only outside evaluation (eval/rewards/margins was logged beside the
    stage's eval/rewards/margin), and transformers' end-of-training mean loss, over one attempt's steps, was logged
    as perf/loss."""
    from align.runtime.trl import eval_metrics, metric_name

    assert metric_name("rewards/margins") == "rewards/margin"
    assert metric_name("eval_rewards/margins") == "eval/rewards/margin"
    assert metric_name("eval_rewards/accuracies") == "eval/rewards/accuracy"
    assert metric_name("train_loss") == "train/attempt_mean_loss" and metric_name("train_runtime") == "perf/runtime"
    assert eval_metrics({"eval_loss": 0.5, "eval_rewards/margins": 0.1, "eval_runtime": 3.0}) == {
        "eval/loss": 0.5, "eval/rewards/margin": 0.1}


def test_auto_is_online_for_a_user_who_ran_wandb_login(tmp_path, monkeypatch):
    """`wandb login` keeps the key in ~/.netrc, not in the environment: `auto` logged such a user offline without a
    word. The key is looked up for the W&B host named by WANDB_BASE_URL."""
    from align.core.tracking import wandb_mode

    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    monkeypatch.setenv("NETRC", str(netrc))
    assert wandb_mode("auto") == "online"
    monkeypatch.setenv("WANDB_BASE_URL", "https://wandb.example.com")  # a key for another host is not this one's
    assert wandb_mode("auto") == "offline"
    netrc.write_text("machine wandb.example.com login user password\n")  # an entry without a key
    assert wandb_mode("auto") == "offline"
    netrc.write_text("machine wandb.example.com login\n")  # one netrc cannot parse
    assert wandb_mode("auto") == "offline"


def test_a_killed_attempts_half_line_is_cut_before_the_next_attempt_appends(tmp_path):
    """A stage killed mid-write left `{"step": 0, "eval/b/va`: the resumed attempt's row was appended onto it, the
    glued line read as torn, and the new row was lost (metrics.jsonl and a table's file alike)."""
    from align.core.tracking import _rows, table_file

    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "eval/a/vader/mean": 0.5}\n{"step": 0, "eval/b/va')
    (tmp_path / table_file("samples")).write_text('{"step": 1, "text": "whole"}\n{"step": 1, "te')
    t = tracker(tmp_path, "disabled", resume=True)
    t.log({"eval/a/vader/mean": 0.6}, 0)
    t.table("samples", ["text"], [["new"]], 2)
    assert [row.get("eval/a/vader/mean") for _, row in _rows(tmp_path / "metrics.jsonl")] == [0.5, 0.6]
    assert [json.loads(x)["text"] for x in (tmp_path / table_file("samples")).read_text().splitlines()] == ["whole", "new"]
