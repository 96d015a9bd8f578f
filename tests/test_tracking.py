"""Experiment tracking and secrets (a probe of W&B, logs and secrets, 2026-11-30): a resumed stage started a second
W&B run, a failed stage showed as finished in W&B, WANDB_MODE=OFFLINE failed every stage at its start, a machine
without network failed every stage with a traceback instead of logging offline, sample tables kept a killed
attempt's rows and wrote bare NaN, and a judge's base_url with user:password@ printed the password. W&B itself is
a stand-in here (no network; the real offline run is tests/test_pipeline_e2e.py). Seed: SEED, printed."""

from __future__ import annotations

import json
import socket
import sys
import threading
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


def test_a_resumed_attempt_continues_its_wandb_run_and_a_fresh_attempt_starts_its_own(tmp_path, monkeypatch):
    calls = fake_wandb(monkeypatch)
    first = tracker(tmp_path)
    first.log({"loss": 1.0}, 1)
    assert first.finish()["id"] == calls[0]["id"]
    tracker(tmp_path, resume=True).finish()
    tracker(tmp_path, resume=False).finish()
    assert calls[1]["id"] == calls[0]["id"] and calls[1]["resume"] == "allow"  # W&B continues the same run
    assert calls[2]["id"] != calls[0]["id"]  # another config or --force: a new run
    assert calls[0]["config"]["api_key"] == "<redacted>"
    (tmp_path / "wandb" / "align_run_id").write_text("../../etc\n")  # a damaged record is not an id
    tracker(tmp_path, resume=True).finish()
    assert calls[3]["id"] not in (calls[2]["id"], "../../etc") and len(calls[3]["id"]) == 16


def test_no_network_logs_offline_and_a_wandb_that_cannot_start_leaves_local_metrics(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # `auto` with a key: online
    calls = fake_wandb(monkeypatch, fail_modes=("online",))
    t = tracker(tmp_path / "sft", "auto")
    assert [c["mode"] for c in calls] == ["online", "offline"] and t.finish()["mode"] == "offline"
    err = capsys.readouterr().err
    assert "W&B did not start online" in err and "WANDB_MODE=offline" in err and SECRET not in err

    calls = fake_wandb(monkeypatch)  # the run's next stage does not wait for an unreachable W&B again
    assert tracker(tmp_path / "dpo", "auto").finish()["mode"] == "offline" and [c["mode"] for c in calls] == ["offline"]
    assert "could not reach it" in capsys.readouterr().err

    calls = fake_wandb(monkeypatch, fail_modes=("online", "offline"))
    t = tracker(tmp_path / "ppo", "auto")
    t.log({"loss": 0.5}, 3)
    assert t.run is None and "no such host" in t.finish()["error"] and SECRET not in t.finish()["error"]
    assert json.loads((tmp_path / "ppo" / "metrics.jsonl").read_text())["loss"] == 0.5
    assert "metrics.jsonl only" in capsys.readouterr().err


def test_a_failed_stage_records_its_failure_first_then_ends_its_wandb_run_as_failed(tmp_path, monkeypatch, capsys):
    from align.runtime.process import _record_failure

    fake_wandb(monkeypatch, finish_error=ConnectionError("the network went"))
    order = []
    t = tracker(tmp_path)
    run = t.run
    run_finish = run.finish
    run.finish = lambda exit_code=None: (order.append(("finish", exit_code)), run_finish(exit_code))
    ctx = types.SimpleNamespace(tracker=t, dir=tmp_path,
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
    import os

    monkeypatch.setenv("WANDB_MODE", " Offline")
    calls = fake_wandb(monkeypatch)
    tracker(tmp_path, "auto").finish()
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


@pytest.mark.parametrize("url, needles", [
    ("http://alice:hunter2secret@127.0.0.1:9/v1", ["carries credentials in the URL", "http://***@127.0.0.1:9/v1"]),
    ("https://alice:hunter2secret@judge.example.com/v1", ["carries credentials in the URL"]),  # urllib: "nonnumeric port"
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
