"""Pairwise LLM judges (issue 24): strict verdicts, both orders, the report's statistics against hand-computed
values, and the two backends on the packaged SmolLM2-135M-Instruct: the local model in the test process and the
same model behind an OpenAI-compatible test server (tests/servers/openai_compatible.py) give the same verdicts; an
evaluation with the endpoint judge writes the key nowhere, and one killed mid-judging and rerun asks the server
only what it had not answered. Seeds: the pipeline's (17); the random key is printed."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import math

import pytest

from conftest import REPO, TINY, run_align

SERVER = REPO / "tests" / "servers" / "openai_compatible.py"


# --------------------------------------------------------------------------------------------- verdicts and stats
def test_verdicts_are_parsed_strictly_and_never_guessed():
    from align.judges.pairwise import parse_verdict

    for answer, verdict in [("A", "A"), (" b \n", "B"), ("Tie", "tie"), ("A.", "A"), ("**B**", "B"), ('"tie"', "tie"),
                            ("**A**.", "A"), ('"A".', "A"), ("`B`.", "B"), ("**Tie**.", "tie"), ('"A."', "A")]:
        assert parse_verdict(answer) == verdict, answer
    for answer in ["Response A", "A or B", "AB", "", "I think A", "tied", "A, because it is positive", "A..", "*A*.."]:
        assert parse_verdict(answer) is None, answer


def test_one_invalid_answer_rule_for_preferences_and_evaluate(capsys):
    """check_invalid, the rule both callers apply: at most max_invalid_fraction of the outcomes may be invalid; above
    it the stage ends naming the judge, the count and the fix, and the first answers go to the log."""
    from align.config.settings import PairwiseJudge
    from align.judges.pairwise import InvalidVerdicts, check_invalid

    settings = PairwiseJudge(name="smol", model="judge", max_invalid_fraction=0.25)
    results = [{"outcome": "win", "answers": ["A", "B"]}] * 3 + [{"outcome": "invalid", "answers": ["Maybe", "B"]}]
    check_invalid(results, settings, "evaluate", "pairs of ppo vs sft")  # 1 of 4 = 0.25: at the bound, accepted
    check_invalid([], settings, "evaluate", "pairs")  # nothing judged: nothing to refuse
    with pytest.raises(InvalidVerdicts) as err:
        check_invalid(results[1:], settings, "preferences", "prompts")  # 1 of 3 = 33.3%
    assert str(err.value).startswith("stage 'preferences': pairwise judge 'smol' gave invalid answers (not exactly A, "
                                     "B or tie) for 1 of 3 prompts (33.3%), above max_invalid_fraction 0.25")
    assert isinstance(err.value, ValueError)  # a refusal the stage reports in one line, not a crash
    assert "['Maybe', 'B']" in capsys.readouterr().out


def test_a_verdict_that_flips_with_the_order_is_a_tie():
    from align.judges.pairwise import outcome

    # first: the policy's response is A; second: it is B
    assert outcome("A", "B") == "win" and outcome("B", "A") == "loss" and outcome("tie", "tie") == "tie"
    assert outcome("A", "A") == "tie" and outcome("B", "B") == "tie"  # position bias: flips with the order
    assert outcome("A", "tie") == "tie" and outcome(None, "B") == "invalid" and outcome("A", None) == "invalid"


def test_length_controlled_win_rate_against_hand_computed_values():
    """8 pairs where the policy is longer (6 wins, 2 losses) and 4 where it is shorter (1 win, 3 losses): the raw win
    rate is 7/12, but the fitted logistic curve has P(win) = 3/4 at +1 sd and 1/4 at -1 sd, so at equal length
    sigmoid(a) = 1/2 (a = (logit 3/4 + logit 1/4) / 2 = 0). With no length difference it is the plain win rate."""
    from align.report.stats import length_controlled_win_rate

    values = [1.0] * 6 + [0.0] * 2 + [1.0] + [0.0] * 3
    diff = [5.0] * 8 + [-5.0] * 4
    assert sum(values) / len(values) == pytest.approx(7 / 12)
    assert length_controlled_win_rate(values, diff) == pytest.approx(0.5, abs=2e-3)
    assert length_controlled_win_rate([1, 1, 0, 0.5], [0, 0, 0, 0]) == pytest.approx(0.625, abs=1e-3)
    # every win where the policy is longer (perfect separation): nothing says what happens at equal length; the
    # ridge's finite fit (0.5 to 0.62 here, 0.22 to 0.97 over seeds elsewhere) was the penalty's, not the data's
    assert math.isnan(length_controlled_win_rate([1, 1, 0], [3, 3, -3]))


def test_pairwise_summary_counts_what_the_report_says():
    from align.report.stats import pairwise_summary

    results = [{"verdicts": v, "outcome": o} for v, o in [
        (["A", "B"], "win"), (["A", "B"], "win"), (["B", "A"], "loss"), (["A", "A"], "tie"),  # the 4th flips
        (["tie", "tie"], "tie"), ([None, "B"], "invalid")]]
    vader = ([0.9, 0.8, 0.1, 0.5, 0.5, 0.0], [0.1, 0.2, 0.6, 0.5, 0.5, 0.0])  # policy, baseline
    s = pairwise_summary(results, [10, 12, 8, 9, 9, 9], [9, 9, 9, 9, 9, 9], gold={"vader": vader})
    assert s["pairs"] == 6 and s["valid"] == 5 and s["invalid_rate"] == pytest.approx(1 / 6)
    assert s["win_rate"] == pytest.approx((1 + 1 + 0 + 0.5 + 0.5) / 5)
    assert s["tie_rate"] == pytest.approx(2 / 5) and s["consistency"] == pytest.approx(4 / 5)
    assert s["policy_length"] == pytest.approx(57 / 6) and s["baseline_length"] == 9
    # decided by both judges: pairs 1, 2 (LLM win, vader better) and 3 (LLM loss, vader worse): all agree
    assert s["agreement/vader"] == 1.0 and s["agreement/vader/pairs"] == 3
    assert s["win_rate_ci"][0] <= s["win_rate"] <= s["win_rate_ci"][1]
    # the invalid pair (an endpoint's content filter refusing the policy's reply, say) as a loss, and as a win:
    # 3 / 6 and 4 / 6 over all six pairs, on either side of the 0.6 the valid five give
    assert s["win_rate_bounds"] == [pytest.approx(3 / 6), pytest.approx(4 / 6)]


# --------------------------------------------------------------------------------------------- backends
@pytest.fixture(scope="module")
def smollm2() -> str:
    from align.core.packaged import resolve

    return resolve("packaged:smollm2")  # fetched by ./launch.sh --tests before the suite


class Server:
    def __init__(self, model: str, tmp: Path, key_env: str | None = None, delay: float = 0.0, env=None,
                 rule: str | None = None, max_requests: int = 2000):
        port_file = tmp / f"port-{secrets.token_hex(4)}"
        cmd = [sys.executable, str(SERVER), "--port-file", str(port_file), "--idle-timeout", "300",
               "--delay", str(delay), "--max-requests", str(max_requests)] + \
            (["--require-key-env", key_env] if key_env else []) + \
            (["--rule", rule] if rule else ["--model", model])
        self.proc = subprocess.Popen(cmd, env={**os.environ, **(env or {})}, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 180
        while not port_file.exists():
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(f"test server did not start: {self.proc.stderr.read()[-2000:]}")
            time.sleep(0.2)
        self.url = f"http://127.0.0.1:{port_file.read_text()}/v1"

    def completions(self) -> int:
        import urllib.request

        with urllib.request.urlopen(self.url.replace("/v1", "/stats"), timeout=10) as resp:
            return json.loads(resp.read())["completions"]

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=30)


PROMPTS = ["The movie was", "I expected more from this", "A quiet little film that"]
GOOD = [" a joy from start to finish.", " and got a wonderful surprise.", " stays with you, beautifully made."]
BAD = [" a dull, lifeless mess.", " and it was a boring waste of time.", " bores you to tears."]


def test_the_endpoint_and_the_local_model_give_the_same_verdicts(smollm2, tmp_path):
    """The same pairs, both orders, judged by SmolLM2 in this process (batched, left-padded) and through the test
    server (one request at a time, over HTTP): the same raw answers, so the same verdicts."""
    import torch

    from align.config.settings import PairwiseJudge
    from align.modeling.models import load_causal_lm, load_tokenizer
    from align.judges.endpoint import EndpointBackend
    from align.judges.pairwise import DEFAULT_TEMPLATE, JudgeCache, LocalBackend, PairwiseLLMJudge

    torch.manual_seed(17)
    template = DEFAULT_TEMPLATE.read_text()
    server = Server(smollm2, tmp_path)
    try:
        settings = PairwiseJudge(name="e", model="judge", base_url=server.url, max_new_tokens=8)
        endpoint = PairwiseLLMJudge(settings, EndpointBackend(server.url, "judge", None, 8, 60, 1, 2), template,
                                    JudgeCache(tmp_path / "e.jsonl"))
        remote = endpoint.compare(PROMPTS, GOOD, BAD)
        assert server.completions() == 2 * len(PROMPTS)  # both orders, nothing twice
    finally:
        server.stop()
    local_settings = PairwiseJudge(name="l", model=smollm2, max_new_tokens=8, batch_size=4)
    backend = LocalBackend(load_causal_lm(smollm2).eval(), load_tokenizer(smollm2), 4, 8)
    local = PairwiseLLMJudge(local_settings, backend, template, JudgeCache(tmp_path / "l.jsonl")).compare(
        PROMPTS, GOOD, BAD)
    print("answers:", [r["answers"] for r in local])
    assert [r["answers"] for r in local] == [r["answers"] for r in remote]
    assert [r["outcome"] for r in local] == [r["outcome"] for r in remote]


# --------------------------------------------------------------------------------------------- in a pipeline
JUDGED = 10  # prompts judged per policy (of the tiny run's 24)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory) -> Path:
    """The tiny default pipeline, run once; each test evaluates a copy of it with its own judge (`--only evaluate`:
    the judge is a setting of evaluate alone, upstream stages stay up to date)."""
    root = tmp_path_factory.mktemp("pairwise")
    for name in ("pipelines", "data_cards"):
        (root / name).symlink_to(REPO / name)
    proc = run_align("run", "pipelines/default.yaml", "tracking.wandb=disabled", *TINY, cwd=root)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root / "runs"


@pytest.fixture
def evaluated(tiny_run, workdir) -> Path:
    import shutil

    shutil.copytree(tiny_run, workdir / "runs", symlinks=True)
    return workdir


def _distinct_judgments(run: Path) -> int:
    """(prompt, A, B) triples the judge is asked about: both orders of each policy against sft on the judged prompts;
    the tiny models often answer alike, and a triple asked twice is answered once (the cache)."""
    rows = [json.loads(x) for x in (run / "report" / "samples.jsonl").read_text().splitlines()][:JUDGED]
    return len({(r["prompt"], *pair) for r in rows for p in ("ppo", "dpo")
                for pair in ((r[p]["response"], r["sft"]["response"]), (r["sft"]["response"], r[p]["response"]))})

def _endpoint_judge(url: str, key_env: str | None = None, **extra) -> str:
    fields = {"name": "smol", "model": "judge", "base_url": url, "max_prompts": JUDGED, "max_invalid_fraction": 1.0,
              "max_concurrency": 2, **extra}
    if key_env:
        fields["key_env"] = key_env
    return "evaluate.pairwise=[" + json.dumps(fields) + "]"


def test_evaluate_with_the_endpoint_judge_writes_the_key_nowhere(smollm2, evaluated):
    workdir = evaluated
    key = "sk-test-" + secrets.token_hex(16)
    print(f"key {key}")
    env = {"ALIGN_TEST_JUDGE_KEY": key}
    server = Server(smollm2, workdir, key_env="ALIGN_TEST_JUDGE_KEY", env=env)
    try:
        args = ["run", "pipelines/default.yaml", "--only", "evaluate", "tracking.wandb=offline", *TINY,
                _endpoint_judge(server.url, "ALIGN_TEST_JUDGE_KEY")]
        bad = run_align(*args[:-1], _endpoint_judge(server.url, "ALIGN_TEST_JUDGE_KEY"), cwd=workdir)
        assert bad.returncode == 2 and "variable ALIGN_TEST_JUDGE_KEY is not set" in bad.stderr, bad.stderr[-2000:]
        proc = run_align(*args, cwd=workdir, env=env)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        served = server.completions()
    finally:
        server.stop()
    run, metrics = _judged_report(workdir, served)
    for p in ("ppo", "dpo"):
        assert 0.0 <= metrics[f"eval/{p}/smol/invalid_rate"] <= 1.0
    assert "smol win rate vs sft" in (run / "report" / "report.md").read_text()
    for root in (workdir / "runs", workdir / "wandb"):
        for f in (p for p in root.rglob("*") if p.is_file()) if root.exists() else []:
            assert key.encode() not in f.read_bytes(), f  # the key's value, anywhere on disk
    assert key not in proc.stdout + proc.stderr


def _judged_report(workdir, served: int):
    """The evaluated run's directory and report metrics once the endpoint judged it, checked: the endpoint was asked
    every distinct question once (both orders, each policy against sft) and every judged prompt is a pair."""
    run = workdir / "runs" / "default" / "main"
    metrics = json.loads((run / "report" / "metrics.json").read_text())
    assert served == _distinct_judgments(run)
    for p in ("ppo", "dpo"):
        assert metrics[f"eval/{p}/smol/pairs"] == JUDGED
    return run, metrics


@pytest.mark.distributed
def test_evaluate_over_two_processes_asks_each_question_once(smollm2, evaluated):
    """evaluate over 2 processes (plain data parallel, gloo) with the endpoint judge: each process judges every other
    prompt (its own answer cache) and the verdicts are gathered in prompt order, so the endpoint is asked every
    distinct question once in all, and the report's pairs are every judged prompt's. The reward model's held-out
    pairs, scored a share on each process, give what the one-process evaluation of the same run gave."""
    workdir = evaluated
    alone = json.loads((workdir / "runs" / "default" / "main" / "report" / "metrics.json").read_text())
    server = Server(smollm2, workdir)
    try:
        proc = run_align("run", "pipelines/default.yaml", "--only", "evaluate", "tracking.wandb=disabled", *TINY,
                         "evaluate.accelerate=ddp", "evaluate.num_processes=2", _endpoint_judge(server.url),
                         cwd=workdir)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        served = server.completions()
    finally:
        server.stop()
    run, metrics = _judged_report(workdir, served)
    assert sorted(p.name for p in (run / "evaluate" / "judge_cache").iterdir()) == ["smol.rank0.jsonl",
                                                                                    "smol.rank1.jsonl"]
    assert metrics["eval/smol/requests"] == served
    held_out = [k for k in alone if k.startswith("eval/reward_model/")]
    assert alone["eval/reward_model/pairs"] >= 1 and len(held_out) >= 7  # the tiny run holds one out: rank 1 has none
    rounded = lambda v: json.loads(json.dumps(v), parse_float=lambda f: round(float(f), 6))  # noqa: E731
    for k in held_out:  # calibration buckets are a list of dicts
        assert rounded(metrics[k]) == rounded(alone[k]), k


def test_validate_names_an_unreachable_endpoint(workdir):
    proc = run_align("validate", "pipelines/default.yaml", *TINY, _endpoint_judge("http://127.0.0.1:9/v1"),
                     cwd=workdir)
    assert proc.returncode == 2
    assert "stages.evaluate: pairwise[0].base_url: http://127.0.0.1:9/v1: not reachable" in proc.stderr


def test_killed_mid_judging_the_rerun_asks_only_what_was_not_answered(smollm2, evaluated):
    """The endpoint answers slowly (0.3 s each); the run is SIGKILLed once 6 answers are cached; the rerun resumes
    the evaluation and the server is asked at most the rest plus what was in flight at the kill."""
    workdir = evaluated
    server = Server(smollm2, workdir, delay=0.3)
    run = workdir / "runs" / "default" / "main"
    cache = run / "evaluate" / "judge_cache" / "smol.jsonl"
    args = ["run", "pipelines/default.yaml", "--only", "evaluate", "tracking.wandb=disabled", *TINY,
            _endpoint_judge(server.url)]
    try:
        proc = subprocess.Popen([sys.executable, "-m", "align.cli", *args], cwd=workdir, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 600
        while not (cache.is_file() and len(cache.read_text().splitlines()) >= 6):
            assert proc.poll() is None and time.time() < deadline, "the run ended before judging half way"
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        cached = len(cache.read_text().splitlines())
        before = server.completions()
        again = run_align(*args, cwd=workdir)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        asked = server.completions() - before
    finally:
        server.stop()
    total = _distinct_judgments(run)
    print(f"distinct questions {total}, cached before the kill {cached}, asked again {asked}")
    assert cached < total  # killed mid-judging
    assert len(cache.read_text().splitlines()) == total
    assert total - cached <= asked <= total - cached + 2  # what was missing, plus at most what was in flight


def test_preferences_labelled_by_a_pairwise_judge_keep_only_its_consistent_verdicts(evaluated):
    """RLAIF: the preferences stage labels each prompt's first two samples with a pairwise judge, in both orders.
    The judge here is the test server's rule (the longer response wins; equal lengths tie), reached through the
    endpoint backend with a judging template given as a file: a pair is kept exactly where the
    lengths differ, and its chosen response is the longer one."""
    workdir = evaluated  # sft is up to date in the copy
    server = Server("", workdir, rule="longer")
    template = workdir / "marked_judge.txt"
    template.write_text((REPO / "tests" / "servers" / "marked_judge.txt").read_text())
    judge = json.dumps({"name": "longer", "model": "judge", "base_url": server.url, "template": str(template)})
    common = ["run", "pipelines/default.yaml", "tracking.wandb=disabled", *TINY, "preferences.max_prompts=16",
              "preferences.samples_per_prompt=2", f"preferences.pairwise={judge}"]
    try:
        proc = run_align(*common, "--only", "preferences", cwd=workdir)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        asked = server.completions()
    finally:
        server.stop()
    data = workdir / "runs" / "default" / "main" / "preferences" / "data"
    samples = [json.loads(x) for x in (data / "samples.jsonl").read_text().splitlines()]
    pairs = {json.loads(x)["prompt"]: json.loads(x) for f in ("train", "test")
             for x in (data / f"{f}.jsonl").read_text().splitlines()}
    assert len(samples) == 16 and all(len(s["responses"]) == 2 and len(s["verdicts"]) == 2 for s in samples)
    lengths = [(len(s["responses"][0]), len(s["responses"][1])) for s in samples]
    assert [s["outcome"] for s in samples] == ["win" if a > b else "loss" if a < b else "tie" for a, b in lengths]
    assert asked == len({(s["prompt"], *o) for s in samples for o in (s["responses"], s["responses"][::-1])})
    differ = {s["prompt"]: s for s in samples if len(s["responses"][0]) != len(s["responses"][1])}
    assert 0 < len(differ) and set(pairs) == set(differ)  # equal lengths: ties, no pair
    for prompt, p in pairs.items():
        assert p["chosen"] == max(differ[prompt]["responses"], key=len)
    # a pairwise judge's scores are 1 vs 0 or 0.5 each: its margin (always 1) and mean score (0.5) said nothing; how
    # often it decided does
    manifest = json.loads((data.parent / "manifest.json").read_text())
    final = manifest["final_metrics"]
    assert manifest["judge_endpoint_models"] == {"longer": ["judge"]}  # the model the endpoint said answered
    assert "preferences/mean_margin" not in final and "objective/scores" not in final
    assert (final["preferences/pairwise_decided"], final["preferences/pairwise_ties"]) == (len(differ) / 16,
                                                                                          1 - len(differ) / 16)


def test_a_pairwise_judging_that_fails_costs_no_sampling_on_the_rerun_even_with_another_judge(evaluated):
    """With a pairwise judge the stage samples every prompt, then judges: a judge that failed (a rate limit past its
    retries, its deadline) threw the sampling away, and the rerun (typically with other judge settings: another
    fingerprint) drew it all again, hours at UltraFeedback scale. The samples are kept first (preferences/sampled/,
    named by what drew them, not by the judge); the rerun judges them without sampling."""
    workdir = evaluated
    template = workdir / "marked_judge.txt"
    template.write_text((REPO / "tests" / "servers" / "marked_judge.txt").read_text())
    common = ["run", "pipelines/default.yaml", "tracking.wandb=disabled", *TINY, "preferences.max_prompts=16",
              "preferences.samples_per_prompt=2", "--only", "preferences"]
    stage = workdir / "runs" / "default" / "main" / "preferences"
    spent = Server("", workdir, rule="longer", max_requests=6)  # then HTTP 429, not retried (retries: 0)
    try:
        judge = {"name": "longer", "model": "judge", "base_url": spent.url, "template": str(template), "retries": 0}
        failed = run_align(*common, f"preferences.pairwise={json.dumps(judge)}", cwd=workdir)
    finally:
        spent.stop()
    assert failed.returncode != 0 and "rate limited" in failed.stderr, failed.stdout[-2000:] + failed.stderr[-2000:]
    [kept] = (stage / "sampled").iterdir()
    drawn = [r["responses"] for r in json.loads(kept.read_text())["records"]]
    assert len(drawn) == 16 and all(len(r) == 2 for r in drawn)
    server = Server("", workdir, rule="longer")
    try:
        judge = {"name": "longer", "model": "judge", "base_url": server.url, "template": str(template)}
        proc = run_align(*common, f"preferences.pairwise={json.dumps(judge)}", cwd=workdir)
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "judging the samples an earlier attempt drew" in (stage / "stage.log").read_text()
    assert not (stage / "sampled").exists()  # judged and published: a forced rerun draws anew
    samples = [json.loads(x) for x in (stage / "data" / "samples.jsonl").read_text().splitlines()]
    assert sorted(s["responses"] for s in samples) == sorted(drawn)


def test_each_process_appends_to_a_cache_file_of_its_own_and_reads_them_all(tmp_path):
    """Several processes judging at once (the preference stage over 2 processes): each appends to NAME.rankR.jsonl
    (appends from several nodes to one file on a network filesystem can tear lines), and each, and any later run,
    reads every process's answers, the one-process file's too; a torn line is skipped."""
    from align.judges.pairwise import JudgeCache

    base = tmp_path / "judge_cache" / "smol.jsonl"
    JudgeCache(base).put({"k0": "A"})  # a one-process run's answers
    JudgeCache(base, rank=0).put({"k1": "B"})
    JudgeCache(base, rank=1).put({"k2": "tie"})
    with open(base.with_name("smol.rank1.jsonl"), "a", encoding="utf-8") as fh:
        fh.write('{"key": "k3", "ans')  # a process killed mid-line
    assert sorted(p.name for p in base.parent.iterdir()) == ["smol.jsonl", "smol.rank0.jsonl", "smol.rank1.jsonl"]
    for rank in (None, 0, 1):
        assert JudgeCache(base, rank).answers == {"k0": "A", "k1": "B", "k2": "tie"}


def test_a_local_judge_model_is_found_beside_the_pipeline_and_its_replaced_weights_rerun_and_re_ask(workdir):
    """A pairwise judge `model: judge` (a directory beside the pipeline file) was checked there at validate but
    loaded from the user's directory by the stage process, and its cached answers were keyed by the name alone:
    replacing the weights reused the old judge's verdicts. Now the spec names it absolutely, its files' stamps are
    in the stage's fingerprint and in the cache's key; a hub id passes through untouched."""
    from types import SimpleNamespace

    import yaml

    from align.config import parse_pipeline
    from align.config.settings import PairwiseJudge
    from align.judges.pairwise import JudgeCache, PairwiseLLMJudge
    from align.orchestrator.plan import build_plan
    from align.orchestrator.runner import _resolved_stage

    sub = workdir / "sub"
    (sub / "judge").mkdir(parents=True)
    (sub / "judge" / "config.json").write_text("{}")
    (sub / "judge" / "model.safetensors").write_bytes(b"old weights")
    raw = yaml.safe_load((REPO / "pipelines" / "default.yaml").read_text())
    raw["stages"]["evaluate"]["pairwise"] = [{"name": "mine", "model": "judge"}, {"name": "hub", "model": "org/judge"}]
    source = sub / "p.yaml"

    def plans():
        return {p.name: p for p in build_plan(parse_pipeline(raw, str(source)), source)}

    before = plans()
    judges = _resolved_stage(before["evaluate"])["pairwise"]
    assert judges[0]["model"] == str((sub / "judge").resolve()) and judges[1]["model"] == "org/judge"

    def identity():
        settings = PairwiseJudge(name="mine", model=judges[0]["model"])
        return PairwiseLLMJudge(settings, SimpleNamespace(name="local"), "{prompt}{response_a}{response_b}",
                                JudgeCache(workdir / "cache.jsonl")).identity

    import shutil

    from align.core.fsutil import tree_stamp

    copy = shutil.copytree(sub / "judge", workdir / "node_local_copy", copy_function=shutil.copy)  # new inodes, times
    assert tree_stamp(copy) == tree_stamp(sub / "judge")  # every node of a multi-node stage plans one fingerprint
    old = identity()
    time.sleep(0.01)
    (sub / "judge" / "model.safetensors").write_bytes(b"new weights, longer")
    after = plans()
    assert {n for n in before if before[n].fingerprint != after[n].fingerprint} == {"evaluate"}
    assert identity() != old
    # a judge that is one .gguf file was keyed by its path alone: replaced weights reused the old model's answers
    gguf = sub / "judge.gguf"
    gguf.write_bytes(b"GGUF old weights")
    judges[0]["model"] = str(gguf)
    old = identity()
    gguf.write_bytes(b"GGUF new weights")
    assert identity() != old


def test_a_hub_judges_cached_answers_are_keyed_by_the_commit_its_weights_came_from(tmp_path):
    """A hub judge's answers were keyed by its id alone: after the repository moved on, a rerun reused the older
    commit's verdicts. The key now holds the commit the local Hugging Face cache loaded (its ref), read by
    hub_commit from the cache's layout (models--org--name/refs/main -> snapshots/<commit>/)."""
    from types import SimpleNamespace

    from align.config.settings import PairwiseJudge
    from align.judges.pairwise import JudgeCache, PairwiseLLMJudge, hub_commit

    repo = tmp_path / "hub" / "models--org--judge"
    first, second = "a" * 40, "b" * 40

    def moved_to(commit: str) -> None:
        (repo / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
        (repo / "snapshots" / commit / "config.json").write_text("{}")
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / "main").write_text(commit)

    def key(revision):
        judge = PairwiseLLMJudge(PairwiseJudge(name="hub", model="org/judge"), SimpleNamespace(name="local"),
                                 "{prompt}{response_a}{response_b}", JudgeCache(tmp_path / "c.jsonl"),
                                 revision=revision)
        return judge.key("p", "a", "b")

    assert hub_commit("org/judge", cache_dir=str(tmp_path / "hub")) is None  # not cached: no commit to name
    moved_to(first)
    assert hub_commit("org/judge", cache_dir=str(tmp_path / "hub")) == first
    old = key(first)
    moved_to(second)
    assert hub_commit("org/judge", cache_dir=str(tmp_path / "hub")) == second
    assert key(second) != old and key(first) == old
    assert key(None) != old  # no commit known (a packaged model): the name alone, as before
    for odd in ("./judge.gguf", "/abs/model.Q8_0.gguf", "a/b/c"):  # paths, not repository ids: no commit, no error
        assert hub_commit(odd, cache_dir=str(tmp_path / "hub")) is None


def test_a_local_judge_leaves_a_judging_prompt_past_its_positions_unjudged_and_says_why():
    """A review's probe (2026-11-30): a GPT-2-shaped judge with 128 positions given a 164-token judging prompt raised
    IndexError (a traceback, after every policy was sampled); a RoPE judge would have judged past its training
    length. Such a prompt now gets an invalid answer naming the cause, counted against max_invalid_fraction (whose
    message says what to change), never cached; the prompts that fit are judged as before."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from align.judges.endpoint import TOO_LONG, Refused
    from align.judges.pairwise import LocalBackend
    from align.modeling.models import load_tokenizer
    from conftest import REPO

    torch.manual_seed(5)
    print("seed 5")
    tok = load_tokenizer(str(REPO / "tokenizers" / "gpt2"))
    model = GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=16, n_layer=1, n_head=2)).eval()
    backend = LocalBackend(model, tok, batch_size=3, max_new_tokens=4)
    short, long = "Which is better, A or B?", "Which is better? " + "words " * 80
    answers = backend.answers([short, long, short])
    assert isinstance(answers[1], Refused) and TOO_LONG in answers[1] and "(64 positions)" in answers[1]
    assert not isinstance(answers[0], Refused) and answers[0] == answers[2]  # greedy, the same prompt
    assert backend.requests == 2


def test_a_local_model_stamp_sees_new_weights_whose_first_and_last_mib_are_the_old_ones(tmp_path):
    """safetensors stores tensors in name order: a merged MLP-only LoRA written over a local base changed neither the
    first MiB (header, embeddings) nor the last (the last layer's attention), and the stamp of size and both ends
    said the base was the same, so every stage from it was skipped as up to date."""
    import random

    from align.core.fsutil import stamp, tree_stamp

    seed = 17
    print(f"seed {seed}")
    rng = random.Random(seed)
    model = tmp_path / "base"
    model.mkdir()
    weights = bytearray(rng.randbytes(24 << 20))
    (model / "model.safetensors").write_bytes(weights)
    before = tree_stamp(model), stamp(model / "model.safetensors")
    for offset in (5 << 20, 12 << 20, 20 << 20):  # three ~100 KiB tensors in the middle, rewritten
        weights[offset:offset + (100 << 10)] = rng.randbytes(100 << 10)
    (model / "model.safetensors").write_bytes(weights)
    assert weights[:1 << 20] == (model / "model.safetensors").read_bytes()[:1 << 20]
    after = tree_stamp(model), stamp(model / "model.safetensors")
    assert after[0] != before[0] and after[1] != before[1]
    (model / "model.safetensors").write_bytes(weights)  # the same bytes again (a copy): the same stamp
    assert (tree_stamp(model), stamp(model / "model.safetensors")) == after
