"""Config strictness: unknown keys name the closest valid key; overrides get the same checks."""

from pathlib import Path

import pytest
import yaml

from align.config import ConfigError, apply_overrides, load_pipeline, parse_pipeline
from align.config.dpo import DPOStage
from align.config.ppo import PPOStage
from align.orchestrator.plan import build_plan
from align.core.errors import PipelineError
from align.orchestrator.validate import validate

REPO = Path(__file__).resolve().parent.parent


def _raw():
    return yaml.safe_load((REPO / "pipelines" / "default.yaml").read_text())


def _parse(raw):
    return parse_pipeline(raw, "pipelines/default.yaml")


def test_default_parses_with_types():
    cfg = _parse(_raw())
    assert isinstance(cfg.stages["dpo"], DPOStage)
    raw = _raw()
    assert cfg.stages["dpo"].beta == float(raw["stages"]["dpo"]["beta"]) and isinstance(cfg.stages["dpo"].beta, float)
    assert list(cfg.stages) == ["sft", "preferences", "reward", "ppo", "dpo", "evaluate"]


@pytest.mark.parametrize("where, key, suggestion", [
    ((), "sed", "seed"),
    (("stages", "sft"), "lerning_rate", "learning_rate"),
    (("stages", "dpo"), "betta", "beta"),
    (("builtin",), "hidden_sise", "hidden_size"),
    (("stages", "preferences", "generation"), "max_new_token", "max_new_tokens"),
])
def test_unknown_key_names_closest(where, key, suggestion):
    raw = _raw()
    node = raw
    for w in where:
        node = node.setdefault(w, {})
    node[key] = 1
    with pytest.raises(ConfigError) as err:
        _parse(raw)
    msg = str(err.value)
    assert f"unknown key '{key}'" in msg and f"did you mean '{suggestion}'" in msg
    assert "pipelines/default.yaml" in msg


def test_wrong_types_are_errors():
    raw = _raw()
    raw["stages"]["dpo"]["beta"] = "high"
    with pytest.raises(ConfigError, match=r"stages.dpo.beta: expected a number"):
        _parse(raw)
    raw = _raw()
    raw["stages"]["sft"]["max_steps"] = 1.5
    with pytest.raises(ConfigError, match=r"max_steps: expected an integer"):
        _parse(raw)


def test_unknown_stage_type():
    raw = _raw()
    raw["stages"]["orpo"] = {"policy": "sft"}
    with pytest.raises(ConfigError, match="unknown stage type 'orpo'"):
        _parse(raw)


@pytest.mark.parametrize("kind", [["dpo"], {"dpo": 1}, 3])
def test_a_stage_type_that_is_not_a_name_is_refused_by_field(kind):
    """`type: [dpo]` ended in TypeError (unhashable type: 'list') in `validate` and `estimate`."""
    raw = _raw()
    raw["stages"]["dpo2"] = {"type": kind, "policy": "sft"}
    with pytest.raises(ConfigError, match=r"stages\.dpo2\.type: expected one stage type name \(one of .*dpo.*\), got a"):
        _parse(raw)


def test_overrides_address_stages_and_nested_fields():
    raw = apply_overrides(_raw(), ["dpo.beta=0.3", "seed=5", "preferences.generation.top_k=50"])
    cfg = _parse(raw)
    assert cfg.stages["dpo"].beta == 0.3 and cfg.seed == 5
    assert cfg.stages["preferences"].generation.top_k == 50
    with pytest.raises(ConfigError, match="did you mean 'beta'"):
        _parse(apply_overrides(_raw(), ["dpo.bta=0.3"]))
    with pytest.raises(ConfigError, match="dotted.key=value"):
        apply_overrides(_raw(), ["dpo.beta"])


def test_ppo_nested_kl_override():
    raw = _raw()
    raw["stages"]["ppo"] = {"policy": "sft", "reward": "reward", "prompts": "../data_cards/movie_review_snippets.yaml"}
    cfg = _parse(apply_overrides(raw, ["ppo.kl.target=6"]))
    assert isinstance(cfg.stages["ppo"], PPOStage) and cfg.stages["ppo"].kl.target == 6.0


@pytest.mark.parametrize("path", sorted((REPO / "pipelines").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_pipeline_validates(path):
    cfg = load_pipeline(path)
    plans = validate(cfg, path, verbose=False)
    assert plans and all(p.fingerprint for p in plans)


@pytest.mark.parametrize("path", sorted((REPO / "pipelines" / "accelerate").glob("*.yaml")), ids=lambda p: p.name)
def test_accelerate_configs_parse(path):
    cfg = yaml.safe_load(path.read_text())
    assert cfg["distributed_type"] in ("NO", "MULTI_GPU", "DEEPSPEED")
    if cfg["distributed_type"] == "DEEPSPEED":
        assert cfg["deepspeed_config"]["zero_stage"] in (1, 2, 3)


def test_graph_errors():
    raw = _raw()
    raw["stages"]["dpo"]["policy"] = "sfft"
    with pytest.raises(PipelineError, match="'sfft' is not a stage.*did you mean 'sft'"):
        build_plan(_parse(raw), REPO / "pipelines" / "default.yaml")
    raw = _raw()
    raw["stages"]["sft"]["model"] = "dpo"  # sft <- dpo <- sft
    with pytest.raises(PipelineError, match="dependency cycle: .*sft.*dpo.*sft|dependency cycle: .*dpo.*sft.*dpo"):
        build_plan(_parse(raw), REPO / "pipelines" / "default.yaml")


def test_fingerprints_change_downstream_only():
    path = REPO / "pipelines" / "default.yaml"
    a = {p.name: p.fingerprint for p in build_plan(_parse(_raw()), path)}
    b = {p.name: p.fingerprint for p in build_plan(_parse(apply_overrides(_raw(), ["dpo.beta=0.2"])), path)}
    changed = {n for n in a if a[n] != b[n]}
    assert changed == {"dpo", "evaluate"}
    c = {p.name: p.fingerprint for p in build_plan(_parse(apply_overrides(_raw(), ["sft.logging_steps=7"])), path)}
    assert c == a  # logging cadence does not change results


@pytest.mark.parametrize("override", ["sft.save_total_limit=5", "ppo.generation.engine_timeout_s=900",
                                      "ppo.generation.gpu_memory_utilization=0.5", "ppo.gradient_checkpointing=true"])
def test_what_align_advises_after_a_full_disk_a_timeout_or_an_oom_keeps_every_fingerprint(override):
    """align's errors advise lowering save_total_limit (a full disk), raising engine_timeout_s, or memory knobs; the
    fingerprint read these (nested ones too), so following that advice on an interrupted stage started it again
    from step 0 and deleted its checkpoints, and reran every stage after it."""
    path = REPO / "pipelines" / "default.yaml"
    a = {p.name: p.fingerprint for p in build_plan(_parse(_raw()), path)}
    assert {p.name: p.fingerprint for p in build_plan(_parse(apply_overrides(_raw(), [override])), path)} == a
    b = {p.name: p.fingerprint for p in build_plan(_parse(apply_overrides(_raw(), ["ppo.generation.top_k=5"])), path)}
    assert {n for n in a if a[n] != b[n]} == {"ppo", "evaluate"}  # a nested setting that samples differently does


def test_a_judge_weight_keyed_by_a_name_like_a_left_out_setting_stays_in_the_fingerprint():
    """Settings are left out of the fingerprint by field name; the keys of a judge-weight mapping are names the user
    gives (a reward stage named 'timeout'), and its weight was left out with them: PPO against twice the weight on
    that reward model read as up to date (a hostile review, 2026-12-01)."""
    def fingerprints(weight: float) -> dict[str, str]:
        raw = _raw()
        raw["stages"]["timeout"] = {**raw["stages"].pop("reward"), "type": "reward"}
        raw["stages"]["evaluate"]["reward"] = "timeout"
        raw["stages"]["ppo"]["reward"] = {"timeout": weight, "vader": 0.5}
        return {p.name: p.fingerprint for p in build_plan(_parse(raw), REPO / "pipelines" / "default.yaml")}

    a, b = fingerprints(1.0), fingerprints(2.0)
    assert {n for n in a if a[n] != b[n]} == {"ppo", "evaluate"}


def test_new_weights_at_the_base_models_path_change_the_fingerprints_of_the_stages_that_load_it(tmp_path):
    """The base model was fingerprinted by its path alone: new weights (or a packaged model converted again) at the
    same path left every stage "up to date". Stages that load it rerun, and so does everything made from them."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(REPO / "tokenizers" / "gpt2", model)
    (model / "config.json").write_text('{"model_type": "gpt2"}')
    (model / "model.safetensors").write_bytes(b"\0" * (3 << 20))
    raw = _raw()
    raw.update(base_model=str(model), chat_template=None)
    raw.pop("builtin", None)
    path = REPO / "pipelines" / "default.yaml"
    a = {p.name: p.fingerprint for p in build_plan(_parse(raw), path)}
    assert a == {p.name: p.fingerprint for p in build_plan(_parse(raw), path)}  # the same files: the same plan
    with open(model / "model.safetensors", "r+b") as fh:  # training moves the values at the file's end too
        fh.seek((3 << 20) - 8)
        fh.write(b"trained!")
    b = {p.name: p.fingerprint for p in build_plan(_parse(raw), path)}
    assert all(a[n] != b[n] for n in a)  # sft loads it; everything else is made from sft


def test_precision_and_the_attention_kernel_change_every_fingerprint():
    """Both change a stage's numerics (bf16 + SDPA once gave non-finite PPO gradients where eager did not): a run with
    another precision or kernel retrains rather than skipping stages as up to date, or resuming one across them."""
    path = REPO / "pipelines" / "default.yaml"
    a = {p.name: p.fingerprint for p in build_plan(_parse(_raw()), path)}
    for override in ("precision=bfloat16", "attn_implementation=eager"):
        b = {p.name: p.fingerprint for p in build_plan(_parse(apply_overrides(_raw(), [override])), path)}
        assert all(a[n] != b[n] for n in a), override


def test_a_stage_named_report_and_a_second_evaluate_stage_are_refused_before_anything_runs():
    """The run's report/ is the evaluate stage's: a stage named `report` would be replaced by it (its manifest and
    log with it), and two evaluate stages would each replace the other's report (the next run then finds it changed
    and asks to rerun one, which breaks the other)."""
    raw = _raw()
    raw["stages"]["report"] = raw["stages"].pop("evaluate")
    with pytest.raises(ConfigError, match=r"stages.report: `report` is the run directory's report/.*Rename it"):
        _parse(raw)
    raw = _raw()
    raw["stages"]["evaluate_dpo"] = {**raw["stages"]["evaluate"], "type": "evaluate", "policies": ["dpo"]}
    with pytest.raises(ConfigError, match=r"stages evaluate, evaluate_dpo: each writes the run's one report/.*"
                                          r"keep one evaluate stage"):
        _parse(raw)


def test_launch_command_applies_gpu_count_to_distributed_stages_only(tmp_path):
    from align.orchestrator.launch import launch_command

    cfg = _parse(apply_overrides(_raw(), ["dpo.accelerate=zero2"]))
    plans = {p.name: p for p in build_plan(cfg, REPO / "pipelines" / "default.yaml")}
    spec = tmp_path / "spec.json"
    sft = launch_command(plans["sft"], spec, REPO / "pipelines" / "default.yaml", num_processes=8)
    dpo = launch_command(plans["dpo"], spec, REPO / "pipelines" / "default.yaml", num_processes=8)
    assert sft[1:] == ["-m", "align.cli", "stage", str(spec)]  # one plain process: no accelerate launcher
    assert dpo[dpo.index("--num_processes") + 1] == "8" and dpo[dpo.index("--config_file") + 1].endswith("zero2.yaml")
    assert "--cpu" not in dpo  # --cpu would silently turn a DeepSpeed config into one plain process
    # one machine whatever the file says: a config copied from a cluster (num_machines: 2) waited for a second node
    assert dpo[dpo.index("--num_machines") + 1] == "1" and dpo[dpo.index("--machine_rank") + 1] == "0"


@pytest.mark.parametrize("body, needles", [
    ("distributed_type: MULTI_GPU\nnum_processes: auto\n", ["sets num_processes: 'auto', not a count of processes"]),
    ("distributed_type: MULTI_GPU\nnum_processes: 8\ngpu_ids: '0,1'\n", ["sets gpu_ids: '0,1', which align does not "
                                                                        "count", "CUDA_VISIBLE_DEVICES"]),
    ("distributed_type: NO\n", ["distributed_type: NO unquoted is YAML's false; write `distributed_type: 'NO'`"]),
])
def test_accelerate_keys_that_place_processes_behind_aligns_back_are_refused_at_validate(tmp_path, capsys, body,
                                                                                          needles):
    """`num_processes: auto` passed validate and `align run` died in int() with a traceback; gpu_ids put several
    processes on one GPU, unseen by align's placement check; an unquoted NO was called "not an accelerate config"."""
    from conftest import refused, validate

    (tmp_path / "mine.yaml").write_text("compute_environment: LOCAL_MACHINE\n" + body)
    rc, out = validate(capsys, str(REPO / "pipelines" / "default.yaml"), f"sft.accelerate={tmp_path / 'mine.yaml'}")
    refused(out, rc, "stages.sft", *needles)


def test_a_one_process_accelerate_config_by_path_or_of_the_users_own_is_not_distributed(tmp_path):
    """Only the name `cpu` counted as one process: `accelerate/cpu.yaml` by path, or a user's one-GPU config
    (distributed_type NO), got --num_processes 8, which accelerate ignores (the manifest's world then disagreed
    with what ran), and on two nodes the worker node waited at a rendezvous node 0 never opened."""
    from align.orchestrator.launch import is_distributed, launch_command
    from align.orchestrator.multinode import MultiNode

    (tmp_path / "one_gpu.yaml").write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: 'NO'\n"
                                           "mixed_precision: 'no'\nnum_processes: 1\n")
    for accelerate in (str(REPO / "pipelines" / "accelerate" / "cpu.yaml"), str(tmp_path / "one_gpu.yaml")):
        cfg = _parse(apply_overrides(_raw(), [f"sft.accelerate={accelerate}"]))
        plans = {p.name: p for p in build_plan(cfg, REPO / "pipelines" / "default.yaml")}
        assert not is_distributed(plans["sft"].cfg, REPO / "pipelines" / "default.yaml"), accelerate
        cmd = launch_command(plans["sft"], tmp_path / "s.json", REPO / "pipelines" / "default.yaml", 8,
                             MultiNode(nodes=2, node_rank=0, master_addr="h"))
        assert "--num_processes" not in cmd and "--machine_rank" not in cmd, cmd
    zero2 = _parse(apply_overrides(_raw(), ["sft.accelerate=zero2"])).stages["sft"]
    assert is_distributed(zero2, REPO / "pipelines" / "default.yaml")


def test_launch_command_for_one_node_of_a_multi_node_job(tmp_path):
    from align.orchestrator.launch import launch_command
    from align.orchestrator.multinode import MultiNode
    from align.core.errors import PipelineError

    cfg = _parse(apply_overrides(_raw(), ["dpo.accelerate=zero3"]))
    plans = {p.name: p for p in build_plan(cfg, REPO / "pipelines" / "default.yaml")}
    multi = MultiNode(nodes=2, node_rank=1, master_addr="10.0.0.7", master_port=29511, rdzv_timeout=42)
    cmd = launch_command(plans["dpo"], tmp_path / "s.json", REPO / "pipelines" / "default.yaml", 4, multi)
    arg = {k: cmd[cmd.index(k) + 1] for k in ("--num_processes", "--num_machines", "--machine_rank",
                                               "--main_process_ip", "--main_process_port", "--rdzv_conf",
                                               "--deepspeed_multinode_launcher")}
    assert arg == {"--num_processes": "8", "--num_machines": "2", "--machine_rank": "1",
                   "--main_process_ip": "10.0.0.7", "--main_process_port": "29511", "--rdzv_conf": "timeout=42",
                   "--deepspeed_multinode_launcher": "standard"}  # torchrun, no ssh/pdsh between nodes
    for bad, match in ((MultiNode(nodes=2), "--master-addr"), (MultiNode(nodes=2, node_rank=2, master_addr="h"),
                                                                "--node-rank 2"), (MultiNode(nodes=0), "--nodes 0")):
        with pytest.raises(PipelineError, match=match):
            bad.check()


def test_a_kl_penalty_the_controller_can_never_move_is_refused():
    raw = _raw()
    raw["stages"]["ppo"]["kl"] = {"coef": 0, "adaptive": True, "controller": "ziegler"}
    with pytest.raises(PipelineError, match=r"kl.coef: 0 with kl.controller: ziegler.*never leaves 0.*kl.controller: pi"):
        validate(_parse(raw), REPO / "pipelines" / "default.yaml", verbose=False)
    for kl in ({"coef": 0, "adaptive": False},  # no KL penalty at all: allowed, and said so by name
               {"coef": 0, "adaptive": True, "controller": "pi"}):  # the PI rule adds to coef: a pure Lagrangian
        raw["stages"]["ppo"]["kl"] = kl
        assert validate(_parse(raw), REPO / "pipelines" / "default.yaml", verbose=False)


@pytest.mark.parametrize("kl, match", [
    ({"max": 6.0, "heldout_prompts": 0}, r"kl.max: 6 with kl.heldout_prompts: 0.*set kl.heldout_prompts"),
    ({"max": 4.0, "target": 4.0}, r"kl.target: 4 is not below kl.max: 4.*set kl.target below kl.max"),
    ({"max": -1.0}, r"kl.max.*-1"),
])
def test_a_kl_budget_that_cannot_hold_is_refused(kl, match):
    raw = _raw()
    raw["stages"]["ppo"]["kl"] = kl
    with pytest.raises((PipelineError, ConfigError), match=match):
        validate(_parse(raw), REPO / "pipelines" / "default.yaml", verbose=False)


def test_seeds_are_bounded_where_numpy_and_vllm_take_them():
    for override in ("seed=4294967296", "dpo.seed=2147483648"):
        with pytest.raises(ConfigError, match=r"seed.*a seed below 2\*\*31"):
            _parse(apply_overrides(_raw(), [override]))
    assert _parse(apply_overrides(_raw(), ["seed=2147483647"])).seed == 2 ** 31 - 1


def test_an_override_of_a_dotted_stage_name_states_the_naming_rule():
    raw = _raw()
    raw["stages"]["sft.v2"] = raw["stages"].pop("sft")
    with pytest.raises(ConfigError, match=r"override 'sft.v2.epochs=1': the stage name 'sft.v2' holds a dot.*`sft_v2`"):
        apply_overrides(raw, ["sft.v2.epochs=1"])
    with pytest.raises(ConfigError, match=r"stages.sft.v2: a stage name is a plain identifier"):
        _parse(raw)


def test_variants_in_a_pipeline_file_and_a_directory_for_a_file_are_named(tmp_path):
    """`variants:` is pipeline.json's record of a sweep: in a user's file it was a traceback (`variants: {dpo: 5}`),
    or let a stage named `dpo.v2` past the naming rule. A directory given as the pipeline was "not found"."""
    path = tmp_path / "p.yaml"
    path.write_text("name: p\nstages:\n  dpo: {}\nvariants:\n  dpo: 5\n")
    with pytest.raises(ConfigError, match=r"p\.yaml: variants: written by align from a stage's `sweep:` .* add "
                                          r"`sweep:` to the stage"):
        load_pipeline(path)
    with pytest.raises(ConfigError, match=r"not a pipeline file \(a directory or a device\); name the \.yaml file"):
        load_pipeline(tmp_path)
    with pytest.raises(ConfigError, match=r"gone\.yaml: pipeline file not found"):
        load_pipeline(tmp_path / "gone.yaml")



def test_an_accelerate_path_is_read_relative_to_the_pipeline_file(tmp_path, monkeypatch):
    """`accelerate: ./cfgs/my.yaml` was read from the working directory (data cards are read relative to the
    pipeline file): it worked from one directory only, and the error named pipelines/accelerate/./cfgs/my.yaml.yaml."""
    from align.core.errors import PipelineError
    from align.orchestrator.launch import accelerate_config

    conf = tmp_path / "proj" / "cfgs" / "my.yaml"
    conf.parent.mkdir(parents=True)
    conf.write_text("distributed_type: 'NO'\n")
    source = tmp_path / "proj" / "p.yaml"
    monkeypatch.chdir(tmp_path)  # not the pipeline's directory
    assert accelerate_config("cfgs/my.yaml", source) == accelerate_config("./cfgs/my.yaml", source) == conf.resolve()
    with pytest.raises(PipelineError, match=r"accelerate config 'cfgs/nope\.yaml' not found: a path is read relative "
                                            r"to the pipeline file \(.*proj/cfgs/nope\.yaml\)"):
        accelerate_config("cfgs/nope.yaml", source)
    assert accelerate_config("zero2", source) == (REPO / "pipelines" / "accelerate" / "zero2.yaml").resolve()


def test_a_pipeline_nested_thousands_deep_and_a_seed_sweep_of_null_and_the_pipeline_seed_are_named(tmp_path):
    """A key holding 5,000 nested brackets was a RecursionError traceback; `sweep: {seed: [null, 17]}` under `seed: 17`
    made two variants that train identically (their spread then understated the seeds' variance)."""
    deep = tmp_path / "deep.yaml"
    deep.write_text("name: d\nstages:\n  sft:\n    data: " + "[" * 5000 + "]" * 5000 + "\n")
    with pytest.raises(ConfigError, match=r"deep\.yaml: nested too deeply to read"):
        load_pipeline(deep)
    with pytest.raises(ConfigError, match=r"override 'sft\.data=\.\.\.': its value is nested too deeply"):
        apply_overrides(_raw(), ["sft.data=" + "[" * 5000 + "]" * 5000])
    raw = {"name": "t", "seed": 17, "stages": {"dpo": {"sweep": {"seed": [None, 17]}}}}
    with pytest.raises(ConfigError, match=r"variants 'dpo-seed_null' and 'dpo-seed_17' have equal settings"):
        _parse(raw)
    assert len(_parse({"name": "t", "seed": 17, "stages": {"dpo": {"sweep": {"seed": [None, 18]}}}}).stages) == 2



def test_editing_a_users_judge_reruns_the_stages_that_score_with_it(tmp_path, monkeypatch):
    """A `module:function` judge's code was not fingerprinted: after editing it, PPO (and evaluate, which reports it
    as a gold judge) were "up to date" and skipped, and the run reported scores of the old judge. Its module's
    content is now part of the fingerprint of each stage that names it, and so reruns them and what follows."""
    judge = tmp_path / "fp_probe_judge.py"
    judge.write_text("def score(prompts, responses):\n    return [1.0 for _ in responses]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    path = REPO / "pipelines" / "default.yaml"

    def plan(override: str) -> dict[str, str]:
        return {p.name: p.fingerprint for p in build_plan(_parse(apply_overrides(_raw(), [override])), path)}

    for override, expected in (("ppo.reward=fp_probe_judge:score", {"ppo", "evaluate"}),
                               ("evaluate.judges=[vader, fp_probe_judge:score]", {"evaluate"}),
                               ("preferences.judge=fp_probe_judge:score", {"preferences", "reward", "ppo", "dpo",
                                                                           "evaluate"})):
        before = plan(override)
        assert plan(override) == before  # the same code: the same plan
        text = judge.read_text()
        judge.write_text(text.replace("1.0", "2.0") if "1.0" in text else text.replace("2.0", "1.0"))
        after = plan(override)
        assert {n for n in before if before[n] != after[n]} == expected, override


@pytest.mark.parametrize("override", ["grpo.split=validation", "rloo.split=valid", "reward.split=train_all"])
def test_a_split_that_a_data_stage_does_not_write_is_refused_when_the_plan_is_made(override):
    """GRPO and RLOO took prompts from a preferences stage with any `split`: `align validate` said valid, and the
    stage failed after its upstream trained, telling the user to rerun the stage that wrote the file. Every reader of
    a data stage (reward's check was its own) is now held to the splits that stage writes."""
    path = REPO / "pipelines" / "online_rl.yaml"
    stage, _, split = override.partition(".split=")
    raw = yaml.safe_load(path.read_text())
    if stage != "reward":
        raw["stages"][stage]["prompts"] = "preferences"
    good = apply_overrides(raw, [f"{stage}.split=train_all_pairs"])
    assert any(p.name == stage for p in build_plan(_parse(good), path))
    with pytest.raises(PipelineError, match=rf"stages\.{stage}: reads split '{split}' of stage 'preferences' "
                       rf"\((prompts|data)\), which writes \['train', 'test', 'train_all_pairs'\]; set stages\.{stage}"
                       r"\.split to one of them"):
        build_plan(_parse(apply_overrides(raw, [override])), path)


def test_a_stage_set_to_null_on_the_command_line_is_removed_and_an_empty_one_in_a_file_is_kept():
    """`dpo=null` (the override error's own advice for unsetting a key) gave a dpo stage of all defaults, beta 0.1
    and lr 5e-7, which evaluate then compared as if it were the pipeline's; it now removes the stage."""
    raw = apply_overrides(_raw(), ["dpo=null", "evaluate.policies=[sft, ppo]"])
    assert "dpo" not in raw["stages"] and "dpo" not in _parse(raw).stages
    with pytest.raises(PipelineError, match="stages.evaluate.policies: 'dpo' is not a stage of this pipeline"):
        build_plan(_parse(apply_overrides(_raw(), ["dpo=null"])), REPO / "pipelines" / "default.yaml")
    empty = _raw()
    empty["stages"]["dpo"] = None  # `dpo:` with no body in a file: a dpo stage of defaults, as before
    assert _parse(empty).stages["dpo"].type == "dpo"
    assert apply_overrides(_raw(), ["dpo.beta=null"])["stages"]["dpo"]["beta"] is None  # a key of it: unset
