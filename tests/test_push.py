"""The `push` stage type: a stage's published model/ uploaded to a hub repository as a run's last step. The hub is
out of reach here, so the upload is tested against a recording stand-in for huggingface_hub's HfApi; what can be
checked before a run (the repository id, the token's variable and its value's shape) is tested through `align
validate`, and the token never appears in a message."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from conftest import REPO, TINY, run_align

TOKEN = "hf_abcdefghijklmnopqrstuvwxyz012345"


HEAD = "c0ffee" * 6 + "c0ff"  # the branch's commit when the push reads it (40 hex digits)


class RecordingApi:
    def __init__(self, there=(".gitattributes",), private=True, refuse=None):
        self.calls, self.there, self.private, self.refuse = [], list(there), private, refuse

    def repo_info(self, repo_id, **kw):
        self.calls.append(("repo_info", repo_id, kw))
        return SimpleNamespace(sha=HEAD, private=self.private)

    def create_repo(self, repo_id, **kw):
        self.calls.append(("create_repo", repo_id, kw))

    def create_branch(self, repo_id, **kw):
        self.calls.append(("create_branch", repo_id, kw))

    def list_repo_files(self, repo_id, **kw):
        self.calls.append(("list_repo_files", repo_id, kw))
        return self.there

    def upload_folder(self, **kw):
        from pathlib import Path

        from huggingface_hub.utils import filter_repo_objects

        self.calls.append(("upload_folder", kw))
        if self.refuse is not None:
            raise self.refuse
        folder = Path(kw["folder_path"])  # what huggingface_hub's own filter would send
        self.sent = sorted(filter_repo_objects([p.relative_to(folder).as_posix() for p in folder.rglob("*")
                                                if p.is_file()], ignore_patterns=kw["ignore_patterns"]))
        self.content = {name: (folder / name).read_bytes() for name in self.sent}  # as sent (a staging folder goes)
        return SimpleNamespace(oid="0123abcd", commit_url=f"https://huggingface.co/{kw['repo_id']}/commit/0123abcd")


def test_upload_creates_the_repository_commits_the_folder_and_keeps_no_token(tmp_path):
    from align.config.push import PushStage
    from align.stages.push import upload

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "model.safetensors").write_bytes(b"\0" * 1000)
    cfg = PushStage(type="push", model="ppo", repo="my-org/tiny-ppo", private=True, revision="main")
    api = RecordingApi()
    receipt = upload(model, cfg, TOKEN, "align: test", api=api)
    assert api.calls[0] == ("create_repo", "my-org/tiny-ppo", {"repo_type": "model", "private": True, "exist_ok": True})
    # the files there are listed at the branch's commit, and the commit is made on that one or refused
    assert api.calls[3] == ("list_repo_files", "my-org/tiny-ppo", {"repo_type": "model", "revision": HEAD})
    assert api.calls[4][1] == {"folder_path": str(model), "repo_id": "my-org/tiny-ppo", "repo_type": "model",
                               "revision": "main", "commit_message": "align: test",
                               "ignore_patterns": ["training_args.bin", "*/training_args.bin"],
                               "parent_commit": HEAD, "delete_patterns": None}
    assert receipt == {"repo": "my-org/tiny-ppo", "revision": "main", "parent_commit": HEAD, "private": True,
                       "commit": "0123abcd", "url": "https://huggingface.co/my-org/tiny-ppo/commit/0123abcd",
                       "files": ["config.json", "model.safetensors"], "deleted": [], "bytes": 1002}
    assert TOKEN not in json.dumps(receipt)


def test_a_second_push_deletes_what_the_first_left_that_this_model_lacks_and_makes_its_branch(tmp_path):
    """A LoRA run pushed its adapters alone; pushed again with merged weights, the repository kept the old
    adapter_config.json beside the new config.json, and transformers then loads the old base + adapter from it. Now
    the upload deletes the model files this model/ lacks (what a user put there stays: README.md, LICENSE, images,
    a GGUF quantisation, a folder), uploads no pickled
    TrainingArguments (a TRL stage saves one into model/, with this machine's paths), and a branch other than main is
    created first (upload_folder commits only to a branch that exists)."""
    from align.config.push import PushStage
    from align.stages.push import upload

    model = tmp_path / "model"
    model.mkdir()
    (model / "value_head").mkdir()
    for name in ("config.json", "model.safetensors", "training_args.bin", "tokenizer.json",
                 "value_head/training_args.bin"):
        (model / name).write_text("x")
    api = RecordingApi(there=[".gitattributes", "README.md", "adapter_config.json", "adapter_model.safetensors",
                              "config.json", "tokenizer.json", "LICENSE", "images/plot.png", "model-q4.gguf",
                              "old/model.safetensors"])
    cfg = PushStage(type="push", model="ppo", repo="my-org/tiny-ppo", revision="v1")
    receipt = upload(model, cfg, TOKEN, "align: again", api=api)
    assert api.calls[2] == ("create_branch", "my-org/tiny-ppo", {"repo_type": "model", "branch": "v1",
                                                                  "exist_ok": True})
    assert api.calls[3] == ("repo_info", "my-org/tiny-ppo", {"repo_type": "model", "revision": "v1"})
    sent = api.calls[5][1]
    assert sent["delete_patterns"] == ["adapter_config.json", "adapter_model.safetensors"]
    assert sent["revision"] == "v1"
    # no pickle is sent, at the top level or in a folder, and the receipt names exactly what was sent
    assert receipt["files"] == api.sent == ["config.json", "model.safetensors", "tokenizer.json"]
    assert receipt["deleted"] == ["adapter_config.json", "adapter_model.safetensors"]


def test_a_public_repository_is_refused_unless_private_is_false_and_a_moved_branch_commits_nothing(tmp_path):
    """create_repo keeps an existing repository's visibility, so `private: true` (the default) pushed into a public
    one published the weights; and two pushes to one branch each listed its files and committed, the later one's
    deletions blind to the other's files (stale adapters beside new weights), both reporting success."""
    from requests import HTTPError, Response

    from align.config.push import PushStage
    from align.runtime.context import StageError
    from align.stages.push import upload

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    cfg = PushStage(type="push", model="ppo", repo="my-org/tiny-ppo")
    api = RecordingApi(private=False)
    with pytest.raises(StageError, match=r"my-org/tiny-ppo exists and is public, and private is true: the weights "
                                         r"would be public\. Make the repository private on the hub, or set private: "
                                         r"false"):
        upload(model, cfg, TOKEN, "align: test", api=api)
    assert [c[0] for c in api.calls] == ["create_repo", "repo_info"]  # nothing listed, nothing sent
    api = RecordingApi(private=False)  # to a branch: refused before the branch is made in the public repository
    with pytest.raises(StageError, match=r"exists and is public"):
        upload(model, PushStage(type="push", model="ppo", repo="my-org/tiny-ppo", revision="v1"), TOKEN, "m", api=api)
    assert [c[0] for c in api.calls] == ["create_repo", "repo_info"]
    cfg.private = False
    assert upload(model, cfg, TOKEN, "align: test", api=api)["private"] is False
    moved = HTTPError("412 Client Error: Precondition Failed", response=Response())
    moved.response.status_code = 412  # what the hub answers when the branch is no longer at parent_commit
    with pytest.raises(StageError, match=rf"my-org/tiny-ppo@main moved past commit {HEAD} while this push was being "
                                         r"prepared \(another push committed first\); nothing was committed\. Rerun"):
        upload(model, cfg, TOKEN, "align: test", api=RecordingApi(refuse=moved))
    other = HTTPError("500 Server Error", response=Response())
    other.response.status_code = 500
    with pytest.raises(HTTPError, match="500"):  # any other failure: as it is (the stage says it in one line)
        upload(model, cfg, TOKEN, "align: test", api=RecordingApi(refuse=other))


def test_the_token_is_kept_out_of_a_failed_pushs_message_whatever_its_variable_is_called(tmp_path, monkeypatch):
    """Only variables named like a secret (..._TOKEN, ..._KEY) were scrubbed: a token_env such as HF_WRITE was not."""
    from align.runtime.context import StageError

    model = tmp_path / "run" / "dpo" / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text("{}")
    monkeypatch.setenv("HF_WRITE", TOKEN)
    leak = RecordingApi(refuse=RuntimeError(f"401 Unauthorized: token {TOKEN} cannot write to my-org/tiny-dpo"))
    with pytest.raises(StageError) as caught:
        run_push(tmp_path / "run", "dpo", "meta-llama/Llama-3.1-8B-Instruct", monkeypatch, leak,
                 ("stages.push.token_env=HF_WRITE",))
    assert "401 Unauthorized: token <redacted> cannot write" in str(caught.value) and TOKEN not in str(caught.value)


def test_a_push_to_the_pipelines_own_base_model_or_tokenizer_is_refused():
    """`repo` copied from `base_model`: the push would replace the base's weights (adapters alone: delete them), and
    every later run loading it would start from this stage's model."""
    from align.config.push import PushStage

    push = PushStage(type="push", model="dpo", repo="my-org/Llama-3.1-8B-SFT")
    for fld in ("base_model", "tokenizer"):
        pipeline = SimpleNamespace(stages={"push": push}, base_model="meta-llama/Llama-3.1-8B", tokenizer=None)
        setattr(pipeline, fld, "My-Org/llama-3.1-8b-sft")  # the hub's ids are case-insensitive
        with pytest.raises(ValueError, match=rf"repo: 'my-org/Llama-3\.1-8B-SFT' is the pipeline's {fld}: the push "
                                             r"would replace its files.*push to a repository of its own, e\.g\. "
                                             r"my-org/Llama-3\.1-8B-SFT-dpo"):
            push.check(SimpleNamespace(pipeline=pipeline))
    push.check(SimpleNamespace(pipeline=SimpleNamespace(stages={}, base_model="meta-llama/Llama-3.1-8B")))


def run_push(run, source: str, base_model: str, monkeypatch, api: RecordingApi | None = None,
             overrides: tuple[str, ...] = ()):
    """The push stage's run() in this process, as its stage process runs it (the spec the runner writes: the pipeline
    without its stages), pushing `source`'s model/ in the run directory `run` to a recording hub. -> (metrics, api)"""
    import huggingface_hub

    from align.config import load_pipeline, to_dict
    from align.core.rundir import StageSpec
    from align.runtime.context import StageContext
    from align.stages import push

    if not any(o.startswith("stages.push.token_env=") for o in overrides):  # else the test sets its variable
        monkeypatch.setenv("ALIGN_TEST_HUB_TOKEN", TOKEN)
    api = api if api is not None else RecordingApi()
    monkeypatch.setattr(huggingface_hub, "HfApi", lambda token: api)
    cfg = load_pipeline(REPO / "pipelines" / "default.yaml", [*PUSH, f"stages.push.model={source}", *overrides])
    (run / "push").mkdir(parents=True, exist_ok=True)
    spec = StageSpec(stage_name="push", stage_dir=str(run / "push"), fingerprint="f", stage=to_dict(cfg.stages["push"]),
                     pipeline={**{k: v for k, v in to_dict(cfg).items() if k != "stages"}, "base_model": base_model},
                     inputs={source: str(run / source)})
    return push.run(StageContext(spec)), api


def test_the_push_stage_runs_as_its_process_runs_it_and_keeps_a_card_already_there(tmp_path, monkeypatch):
    """The stage process's pipeline has no stages (the runner leaves them out of the spec): reading them crashed
    every push as it started. A README.md already in the repository is kept (peft writes a boilerplate card beside
    adapters, which replaced a user's); a repository without one gets the model's."""
    model = tmp_path / "run" / "dpo" / "model"
    model.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "README.md"):
        (model / name).write_text("x")
    metrics, api = run_push(tmp_path / "run", "dpo", "meta-llama/Llama-3.1-8B-Instruct", monkeypatch)
    assert metrics == {"push/files": 3, "push/bytes": 3} and api.sent == ["README.md", "config.json", "model.safetensors"]
    receipt = json.loads((tmp_path / "run" / "push" / "pushed" / "receipt.json").read_text())
    assert receipt["files"] == api.sent and "adapter_base" not in receipt
    _, api = run_push(tmp_path / "run", "dpo", "meta-llama/Llama-3.1-8B-Instruct", monkeypatch,
                      RecordingApi(there=["README.md", "config.json"]))
    assert api.sent == ["config.json", "model.safetensors"]


def test_the_card_names_the_hub_base_where_yaml_wrapped_the_local_path():
    """peft writes its card's metadata with yaml (80 columns): a long path with spaces is wrapped onto two lines, and a
    plain text replacement of it missed, leaving a `base_model` the hub refuses. The metadata is parsed instead."""
    import yaml

    from align.stages.push import card_naming

    path = "/home/user/My Projects/alignment experiments with a long name/runs and more runs/x/main/instruct/model"
    meta = yaml.dump({"base_model": path, "library_name": "peft", "tags": [f"base_model:adapter:{path}", "lora"]},
                     width=80, allow_unicode=True)
    assert path not in meta  # wrapped, as peft writes it
    out = card_naming(f"---\n{meta}---\n\n# Model card\n\nTrained on {path}.\n", path, "org/base-8b")
    assert "base_model: org/base-8b\n" in out and "- base_model:adapter:org/base-8b\n" in out
    assert "Trained on org/base-8b." in out and "My Projects" not in out and "- lora" in out


PUSH = ["stages.push.type=push", "stages.push.model=dpo", "stages.push.repo=my-org/tiny-dpo",
        "stages.push.token_env=ALIGN_TEST_HUB_TOKEN"]


@pytest.mark.parametrize("env,extra,message", [
    ({}, [], "stages.push: token_env: the variable ALIGN_TEST_HUB_TOKEN is not set (or empty)"),
    ({"ALIGN_TEST_HUB_TOKEN": TOKEN + "\r"}, [], "the value of ALIGN_TEST_HUB_TOKEN holds whitespace or control "
                                                  "characters (a key file saved with CRLF"),
    ({"ALIGN_TEST_HUB_TOKEN": TOKEN}, ["stages.push.repo=tiny-dpo"], "stages.push: repo: 'tiny-dpo' is not a hub "
                                                                     "repository id: name it org/name"),
    # ids the hub refuses only when the push runs, after every stage before it
    ({"ALIGN_TEST_HUB_TOKEN": TOKEN}, ["stages.push.repo=org/my--model"], "the hub refuses '--' and '..'"),
    ({"ALIGN_TEST_HUB_TOKEN": TOKEN}, ["stages.push.repo=org/model.git"], "a repository name cannot end in .git"),
    ({"ALIGN_TEST_HUB_TOKEN": TOKEN}, ["stages.push.repo=org/x-"], "nor ending with '-' or '.'"),
    ({"ALIGN_TEST_HUB_TOKEN": TOKEN}, ["stages.push.repo=org/" + "x" * 97], "each part 1 to 96 characters"),
    ({"ALIGN_TEST_HUB_TOKEN": TOKEN, "HF_HUB_OFFLINE": "", "TRANSFORMERS_OFFLINE": "1"}, [],
     "stages.push: offline mode is on (HF_HUB_OFFLINE, or TRANSFORMERS_OFFLINE where HF_HUB_OFFLINE is unset)"),
    ({"ALIGN_TEST_HUB_TOKEN": TOKEN, "HF_HUB_OFFLINE": "on"}, [], "stages.push: offline mode is on"),
    ({"ALIGN_TEST_HUB_TOKEN": TOKEN}, [f"stages.push.token_env={TOKEN}"], "token_env: this looks like a token"),
    ({"ALIGN_TEST_HUB_TOKEN": TOKEN}, ["stages.push.model=preferences"],
     "stages.push.model: 'preferences' is a preferences stage, which produces preference pairs; model needs a policy "
     "or a reward model: use sft or reward or ppo or dpo"),
    ({"ALIGN_TEST_HUB_TOKEN": TOKEN, "HF_HUB_OFFLINE": "1"}, [], "stages.push: offline mode is on (HF_HUB_OFFLINE, or "
                                                                  "TRANSFORMERS_OFFLINE where HF_HUB_OFFLINE is unset): "
                                                                  "the hub cannot be reached to push to"),
    ({"ALIGN_TEST_HUB_TOKEN": TOKEN}, ["stages.push.revision=no such/branch.."], "stages.push: revision: 'no "
                                                                                "such/branch..' is not a branch name"),
    ({"ALIGN_TEST_HUB_TOKEN": TOKEN}, ["stages.push2.type=push", "stages.push2.model=sft",
                                       "stages.push2.repo=my-org/tiny-dpo", "stages.push2.token_env=ALIGN_TEST_HUB_TOKEN"],
     "stages.push2: pushes to my-org/tiny-dpo@main as stage 'push' does: the later commit replaces the other's files"),
    ({"ALIGN_TEST_HUB_TOKEN": TOKEN}, ["dpo.lora.enabled=true", "dpo.lora.target_modules=[q_proj,v_proj]"],
     "stages.push: stage 'dpo' publishes LoRA adapters alone, on a model that exists only in this run: the pushed "
     "repository could not be loaded; set stages.dpo.lora.merge: true"),
])
def test_validate_refuses_what_the_push_would_fail_on_and_never_prints_the_token(workdir, env, extra, message):
    env = {"HF_HUB_OFFLINE": "0", **env}  # the suite's default (no hub here) would refuse every push
    proc = run_align("validate", "pipelines/default.yaml", *TINY, *PUSH, *extra, cwd=workdir, env=env)
    assert proc.returncode == 2, proc.stdout
    assert message in proc.stderr, proc.stderr
    assert TOKEN not in proc.stderr + proc.stdout


def test_adapters_alone_are_refused_on_a_base_only_this_machine_has_but_not_on_a_builtin_one(tmp_path):
    """A LoRA stage that publishes its adapters alone on a local base: the pushed repository would name a path here
    as its base. A builtin base was refused too, though its stage builds the model and so publishes merged weights."""
    from align.config.push import PushStage
    from align.config.sft import SFTStage
    from align.config.settings import LoraSettings

    (tmp_path / "base").mkdir()
    sft = SFTStage(type="sft", lora=LoraSettings(enabled=True))
    push = PushStage(type="push", model="sft", repo="my-org/x")

    def ctx(base):
        return SimpleNamespace(pipeline=SimpleNamespace(stages={"sft": sft, "push": push}, base_model=base),
                               base_dir=tmp_path)

    with pytest.raises(ValueError, match="stage 'sft' publishes LoRA adapters alone, on base_model 'base', which is "
                                         "not on the hub"):
        push.check(ctx("base"))
    push.check(ctx("builtin:tiny-llama"))
    push.check(ctx("meta-llama/Llama-3.1-8B-Instruct"))


def test_adapters_trained_on_a_pretrained_copy_of_the_base_are_adapters_of_the_base(tmp_path):
    """DPO with LoRA on a pretrained stage (the base republished unchanged) was refused as 'a model that exists only
    in this run'; its adapters are the base's, so the push names base_model as their base (align/stages/push.py
    hub_folder) and is refused only where an sft stage from the base would be: a base not on the hub. DPO on an sft
    stage's model is still refused."""
    from align.config.dpo import DPOStage
    from align.config.pretrained import PretrainedStage
    from align.config.push import PushStage
    from align.config.reward import RewardStage
    from align.config.settings import LoraSettings
    from align.config.sft import SFTStage

    (tmp_path / "base").mkdir()
    stages = {"instruct": PretrainedStage(type="pretrained"), "sft": SFTStage(type="sft"),
              "dpo": DPOStage(type="dpo", policy="instruct", lora=LoraSettings(enabled=True)),
              "push": PushStage(type="push", model="dpo", repo="my-org/x")}

    def ctx(base):
        return SimpleNamespace(pipeline=SimpleNamespace(stages=stages, base_model=base), base_dir=tmp_path)

    push = stages["push"]
    assert push.pipeline_problems("push", stages) == []
    push.check(ctx("meta-llama/Llama-3.1-8B-Instruct"))
    with pytest.raises(ValueError, match="stage 'dpo' publishes LoRA adapters alone, on base_model 'base', which is "
                                         "not on the hub"):
        push.check(ctx("base"))
    stages["dpo"].policy = "sft"
    assert "exists only in this run" in push.pipeline_problems("push", stages)[0]
    stages["reward"] = RewardStage(type="reward", init="instruct", lora=LoraSettings(enabled=True))
    push.model = "reward"  # a scalar head's num_labels and pad token live only in align's record: merged weights
    assert "a reward model's LoRA adapters alone" in push.pipeline_problems("push", stages)[0]


def test_a_push_stage_validates_with_a_token_and_runs_last(workdir):
    variable = ["stages.push.token_env=HF_TOKEN_ACME_WRITE_ONLY"]  # upper case: a variable's name, not a token
    proc = run_align("validate", "pipelines/default.yaml", *TINY, *PUSH, *variable, cwd=workdir,
                     env={"HF_TOKEN_ACME_WRITE_ONLY": TOKEN, "HF_HUB_OFFLINE": "0"})
    assert proc.returncode == 0, proc.stderr
    line = next(x for x in proc.stdout.splitlines() if x.strip().startswith("push "))
    assert "<- dpo" in line and TOKEN not in proc.stdout


def test_a_push_token_is_asked_for_only_by_the_commands_that_push():
    """`align report` (which reruns the evaluate stage alone) refused a run whose pipeline has a push stage when the
    token was not exported: the token is checked for the stages a command runs, and by `align validate`."""
    from align.config.push import PushStage
    from align.core.errors import PipelineError
    from align.orchestrator.validate import check_environment

    plans = [SimpleNamespace(name="push", cfg=PushStage(type="push", model="dpo", repo="a/b",
                                                        token_env="ALIGN_TEST_UNSET_TOKEN"))]
    check_environment(plans, {"evaluate"}, "p.yaml")  # not run by this command: not asked
    with pytest.raises(PipelineError, match=r"p\.yaml: stages\.push: (token_env: the variable ALIGN_TEST_UNSET_TOKEN "
                                            r"is not set|offline mode is on)"):
        check_environment(plans, {"push", "evaluate"}, "p.yaml")


def test_a_push_below_a_stage_that_reruns_is_asked_for_its_token_before_anything_trains(tmp_path, monkeypatch):
    """sft's model deleted (or `--only sft --force` earlier), the token not exported: at the start the push still
    read up to date (its input dpo had not changed yet), so its token went unasked; sft and dpo then retrained and
    the push failed after all of it. What reruns below a stage that reruns is checked with it."""
    from align.config import load_pipeline
    from align.core.errors import PipelineError
    from align.orchestrator import runner
    from align.orchestrator.plan import build_plan

    source = REPO / "pipelines" / "default.yaml"
    cfg = load_pipeline(source, [*TINY, *PUSH, "stages.push.token_env=ALIGN_TEST_UNSET_TOKEN",
                                 f"runs_dir={tmp_path / 'runs'}"])
    monkeypatch.delenv("ALIGN_TEST_UNSET_TOKEN", raising=False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setattr(runner, "validate", lambda cfg, source: build_plan(cfg, source))
    monkeypatch.setattr(runner, "up_to_date", lambda plan, run_dir, source: plan.name != "sft")  # sft reruns
    with pytest.raises(PipelineError, match=r"stages\.push: token_env: the variable ALIGN_TEST_UNSET_TOKEN is not set"):
        runner.run(cfg, source)
    assert not (tmp_path / "runs").exists()  # refused before the run directory was made
    monkeypatch.setattr(runner, "up_to_date", lambda plan, run_dir, source: True)
    monkeypatch.setattr(runner, "_run_stages", lambda *args: "ran")  # nothing reruns: the push is not asked
    monkeypatch.setattr(runner, "memory_preflight", lambda *args: None)
    assert runner.run(cfg, source) == "ran"


def test_whole_weights_pushed_to_a_repository_without_a_card_get_one_naming_their_base_and_metrics(tmp_path,
                                                                                                  monkeypatch):
    """Merged or whole weights reached the hub with no README.md: no `base_model` for the hub to link, no word of the
    stage or its results, and no licence note (peft writes a card beside adapters only). The stage sends one built
    from the run's records to a repository without a card, never a path on this machine, and leaves model/ as it is."""
    from align.core.rundir import StageSpec, write_manifest

    stage = tmp_path / "run" / "dpo"
    (stage / "model").mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        (stage / "model" / name).write_text("x")
    StageSpec("dpo", str(stage), "f1", {"type": "dpo"}, {}).write(stage / "spec.json")
    write_manifest(stage, {"stage": "dpo", "status": "completed", "outputs": ["model"],
                           "final_metrics": {"eval/rewards/accuracy": 0.8125, "train/loss": 0.41}})
    sent = {}

    class Keeping(RecordingApi):
        def upload_folder(self, **kw):
            from pathlib import Path
            card = Path(kw["folder_path"]) / "README.md"
            sent["card"] = card.read_text() if card.is_file() else None
            return super().upload_folder(**kw)

    _, api = run_push(tmp_path / "run", "dpo", "meta-llama/Llama-3.1-8B-Instruct", monkeypatch, Keeping())
    assert api.sent == ["README.md", "config.json", "model.safetensors"]
    card = sent["card"]
    assert card.startswith("---\nbase_model: meta-llama/Llama-3.1-8B-Instruct\nlibrary_name: transformers\n"
                           "tags: [align, dpo]\n---\n") and "`dpo` stage `dpo` of the pipeline `default`" in card
    assert "| eval/rewards/accuracy | 0.8125 |" in card and "licences of the base model" in card
    assert not (stage / "model" / "README.md").exists()  # the published model/ is not changed
    local = tmp_path / "weights"
    local.mkdir()
    _, api = run_push(tmp_path / "run", "dpo", str(local), monkeypatch, Keeping())
    assert "base_model:" not in sent["card"] and str(tmp_path) not in sent["card"]
    _, api = run_push(tmp_path / "run", "dpo", "meta-llama/Llama-3.1-8B-Instruct", monkeypatch,
                      Keeping(there=["README.md"]))
    assert "README.md" not in api.sent  # a card already there is kept
    from align.stages.push import model_card

    bare = model_card("me/x", "p", "gpt2", tmp_path / "nowhere")  # an unnamespaced hub id; no spec: no type tag
    assert bare.startswith("---\nbase_model: gpt2\nlibrary_name: transformers\ntags: [align]\n---\n")
