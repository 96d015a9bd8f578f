"""Stage sweeps (align/config/sweeps.py): expansion into named variants, cartesian and zip, clear errors, references by
the swept stage's name, overrides, `align validate`'s listing, and the acceptance test: changing one swept value
reruns exactly that variant and the evaluation, while upstream stages are skipped."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from conftest import REPO, run_align

from align.cli import main as cli_main
from align.config import ConfigError, apply_overrides, load_pipeline, parse_pipeline, to_dict
from align.orchestrator.plan import build_plan
from align.core.tracking import sweep_config

DEFAULT = str(REPO / "pipelines" / "default.yaml")


def _raw(**stages) -> dict:
    return {"name": "t", "stages": {"sft": {"data": "cards/x.yaml"}, **stages}}


def _parse(**stages):
    return parse_pipeline(_raw(**stages), "p.yaml")


# --------------------------------------------------------------------------------------------- expansion
def test_one_key_one_variant_per_value_in_order_and_evaluate_takes_all():
    cfg = _parse(dpo={"policy": "sft", "beta": 0.7, "learning_rate": 1e-4, "sweep": {"beta": [0.3, 0.02, 1]}},
                 evaluate={"policies": ["sft", "dpo"], "baseline": "sft"})
    names = ["dpo-beta_0.3", "dpo-beta_0.02", "dpo-beta_1"]
    assert list(cfg.stages) == ["sft", *names, "evaluate"]  # sweep order, not sorted
    assert [cfg.stages[n].beta for n in names] == [0.3, 0.02, 1.0]  # the sweep replaces the stage's own 0.7
    assert {cfg.stages[n].learning_rate for n in names} == {1e-4}  # other settings shared
    assert cfg.stages["evaluate"].policies == ["sft", *names]
    assert cfg.variants["dpo-beta_0.02"] == {"stage": "dpo", "values": {"beta": 0.02}}
    assert "sft" not in cfg.variants and "evaluate" not in cfg.variants


def test_cartesian_is_every_combination_first_key_slowest_with_dotted_keys():
    cfg = _parse(ppo={"policy": "sft", "reward": "vader", "kl": {"target": 5.0},
                      "sweep": {"kl.coef": [0.05, 0.2], "learning_rate": [1e-4, 5e-5, 1e-5]}})
    got = [(n, st.kl.coef, st.learning_rate, st.kl.target) for n, st in cfg.stages.items() if n != "sft"]
    assert [g[1:3] for g in got] == [(0.05, 1e-4), (0.05, 5e-5), (0.05, 1e-5), (0.2, 1e-4), (0.2, 5e-5), (0.2, 1e-5)]
    assert {g[3] for g in got} == {5.0}  # a dotted key leaves the rest of its group as written
    assert got[1][0] == "ppo-kl.coef_0.05-learning_rate_5e-05"


def test_zip_pairs_the_ith_values():
    cfg = _parse(ppo={"policy": "sft", "reward": "vader",
                      "sweep": {"mode": "zip", "kl.coef": [0.05, 0.2], "learning_rate": ["1e-4", 5.0e-5]}})
    pairs = {n: (st.kl.coef, st.learning_rate) for n, st in cfg.stages.items() if n != "sft"}
    assert pairs == {"ppo-kl.coef_0.05-learning_rate_1e-4": (0.05, 1e-4),  # the name keeps the value as written
                     "ppo-kl.coef_0.2-learning_rate_5e-05": (0.2, 5e-5)}


def test_every_variant_has_its_own_fingerprint_and_upstream_is_shared():
    cfg = load_pipeline(DEFAULT, ["dpo.sweep={beta: [0.1, 0.3]}"])
    plans = {p.name: p for p in build_plan(cfg, DEFAULT)}
    a, b = plans["dpo-beta_0.1"], plans["dpo-beta_0.3"]
    assert a.fingerprint != b.fingerprint and a.deps == b.deps == ["sft", "preferences"]
    # Changing one value leaves the other variant's fingerprint (and sft's) as it was.
    again = {p.name: p for p in build_plan(load_pipeline(DEFAULT, ["dpo.sweep={beta: [0.1, 0.5]}"]), DEFAULT)}
    assert again["dpo-beta_0.1"].fingerprint == a.fingerprint and again["sft"].fingerprint == plans["sft"].fingerprint
    assert again["evaluate"].fingerprint != plans["evaluate"].fingerprint
    # pipeline.json's resolved config parses back to the same stages (align status / align report read it).
    record = json.loads(json.dumps(to_dict(cfg)))
    back = {p.name: p.fingerprint for p in build_plan(parse_pipeline(record, DEFAULT), DEFAULT)}
    assert back == {n: p.fingerprint for n, p in plans.items()}


@pytest.mark.parametrize("sweep, message", [
    ({"bta": [0.1]}, r"stages\.dpo\.sweep\.bta: 'bta' is not a setting of a dpo stage; did you mean 'beta'\?"),
    ({"lora.alpah": [4]}, r"stages\.dpo\.sweep\.lora\.alpah: 'alpah' is not a setting of 'lora' in a dpo stage; "
                          r"did you mean 'alpha'\?"),
    ({"beta.x": [4]}, r"stages\.dpo\.sweep\.beta\.x: 'beta' is not a group of settings"),
    ({"beta": []}, r"stages\.dpo\.sweep\.beta: expected a non-empty list"),
    ({"beta": 0.1}, r"stages\.dpo\.sweep\.beta: expected a non-empty list"),
    ({"lora": {"r": [4, 8]}}, r"'lora' is a group of settings; sweep one setting in it with a dotted key"),
    ({"beta": [0.1, -1]}, r"stages\.dpo\.sweep\.beta\[1\]: -1(\.0)? is not allowed: must be > 0"),
    ({"beta": [0.1, "big"]}, r"stages\.dpo\.sweep\.beta\[1\]: expected a number"),
    ({"loss_type": ["sigmoid", "nope"]}, r"stages\.dpo\.sweep\.loss_type\[1\]: 'nope' is not allowed"),
    ({"mode": "grid", "beta": [0.1]}, r"stages\.dpo\.sweep\.mode: 'grid' is not one of cartesian, zip"),
    ({"mode": "zip", "beta": [0.1, 0.2], "seed": [1]}, r"stages\.dpo\.sweep: mode zip .* \(beta: 2, seed: 1\)"),
    ({"mode": "zip", "beta": [0.1, 0.2, 0.3], "seed": [1], "max_variants": 2},  # lengths before the bound, whose
     r"stages\.dpo\.sweep: mode zip .* \(beta: 3, seed: 1\)"),  # count reads the first list: its fix led to this
    ({"type": ["ppo"]}, r"stages\.dpo\.sweep\.type: the stage type cannot be swept"),
    ({"beta": [0.1, 0.1]}, r"two variants are both named 'dpo-beta_0.1'"),
    ({"learning_rate": ["1e-4", 0.0001]}, r"variants 'dpo-learning_rate_1e-4' and 'dpo-learning_rate_0.0001' have "
                                          r"equal settings"),
    ([0.1, 0.2], r"stages\.dpo\.sweep: expected a mapping"),
])
def test_bad_sweeps_are_clear_errors(sweep, message):
    with pytest.raises(ConfigError, match=message):
        _parse(dpo={"policy": "sft", "sweep": sweep})


def test_a_report_stage_cannot_be_swept():
    with pytest.raises(ConfigError, match=r"stages\.evaluate\.sweep: a stage of type evaluate writes the run's one "
                                          r"report/"):
        _parse(evaluate={"sweep": {"max_prompts": [8, 16]}})


def test_variant_name_taken_by_another_stage():
    with pytest.raises(ConfigError, match=r"two stages would be named 'dpo-beta_0.1'"):
        _parse(dpo={"sweep": {"beta": [0.1, 0.2]}}, **{"dpo-beta_0.1": {"type": "dpo"}})


@pytest.mark.parametrize("field, stages", [
    ("policy", {"dpo": {"sweep": {"beta": [0.1, 0.2]}}, "preferences": {"policy": "dpo"}}),
    ("baseline", {"dpo": {"sweep": {"beta": [0.1, 0.2]}}, "evaluate": {"policies": ["dpo"], "baseline": "dpo"}}),
    ("reward", {"reward": {"sweep": {"learning_rate": [1e-4, 1e-3]}}, "ppo": {"reward": {"reward": 1.0}}}),
])
def test_single_stage_field_naming_a_swept_stage_must_name_a_variant(field, stages):
    with pytest.raises(ConfigError, match=rf"stages\.\w+\.{field}: '\w+' is swept into 2 stages \(.*-\w+_[\d.e-]+, "
                                          rf".*\); {field} takes one stage, so name the variant"):
        _parse(**stages)


def test_overrides_apply_to_every_variant_but_not_to_a_swept_key():
    raw = {"name": "t", "stages": {"dpo": {"beta": 0.2, "sweep": {"beta": [0.1, 0.3], "learning_rate": [1e-4]}}}}
    cfg = parse_pipeline(apply_overrides(json.loads(json.dumps(raw)), ["dpo.max_steps=7", "dpo.sweep.beta=[0.5]"]),
                         "p.yaml")
    got = {n: (st.beta, st.max_steps) for n, st in cfg.stages.items()}
    assert got == {"dpo-beta_0.5-learning_rate_0.0001": (0.5, 7)}
    for item in ("dpo.beta=0.3", "dpo.learning_rate=1e-3", "stages.dpo.beta=0.3"):  # the full path: it was dropped
        with pytest.raises(ConfigError, match=rf"override '{re.escape(item)}': stages\.dpo sweeps \w+ .*Override the "
                                              r"list instead, e.g. dpo\.sweep\.\w+="):
            apply_overrides(json.loads(json.dumps(raw)), [item])
    nested = {"name": "t", "stages": {"ppo": {"sweep": {"kl.coef": [0.1, 0.2]}}}}
    with pytest.raises(ConfigError, match=r"sweeps kl\.coef"):  # a group above the swept key covers it too
        apply_overrides(json.loads(json.dumps(nested)), ["ppo.kl={coef: 0.3}"])
    kept = apply_overrides(json.loads(json.dumps(nested)), ["ppo.kl={adaptive: false}"])  # beside it: no conflict
    assert kept["stages"]["ppo"]["kl"] == {"adaptive": False}
    with pytest.raises(ConfigError, match=r"override 'stages=\{dpo: \{beta: 0\.3\}\}': stages\.dpo sweeps beta"):
        apply_overrides(json.loads(json.dumps(raw)), ["stages={dpo: {beta: 0.3}}"])  # merged into dpo: 0.3 was lost


def test_an_override_of_one_variant_says_what_a_variant_is():
    """`dpo-beta_0.1.max_steps=3` said "unknown key 'dpo-beta_0'; valid keys: attn_implementation, ..." (the name cut
    at the value's dot, the file's top-level keys listed), though `--only dpo-beta_0.1` takes the same name."""
    for item in ("dpo-beta_0.1.max_steps=3", "stages.dpo-beta_0.1.max_steps=3", "dpo-beta_1.max_steps=3"):
        with pytest.raises(ConfigError, match=rf"override '{re.escape(item)}': a variant of swept stage dpo cannot be "
                                              r"set alone .*\(dpo\.<key>=\.\.\.\)"):
            load_pipeline(str(REPO / "pipelines" / "frontier.yaml"), [item])
    raw = {"name": "t", "stages": {"dpo": {"sweep": {"beta": [0.1, 0.2]}}, "dpo-final": {"type": "dpo"}}}
    for item in ("dpo-final.beta=0.3", "stages.dpo-final.beta=0.3"):  # a stage of its own named so: not a variant
        assert apply_overrides(json.loads(json.dumps(raw)), [item])["stages"]["dpo-final"]["beta"] == 0.3


def test_a_null_sweep_turns_the_sweep_off():
    """`dpo.sweep=null` was refused ("expected a mapping"): there was no way to drop a stage's sweep from the command
    line, where null turns a setting off everywhere else."""
    cfg = load_pipeline(str(REPO / "pipelines" / "frontier.yaml"), ["dpo.sweep=null", "dpo.beta=0.3"])
    assert cfg.stages["dpo"].beta == 0.3 and not any(n.startswith("dpo-") for n in cfg.stages)
    assert "dpo" in cfg.stages["evaluate"].policies and "dpo" not in cfg.variants


def test_a_mapping_override_sets_the_keys_it_names_and_a_whole_group_is_not_swept():
    """`ppo.kl={coef: 0.3}` replaced the whole group (its controller and target went back to their defaults without
    a word), and `sweep: {kl: [{coef: 0.1}, {coef: 0.2}]}` did the same to each variant."""
    raw = {"name": "t", "stages": {"ppo": {"kl": {"controller": "ziegler", "target": 4.0, "coef": 0.1}}}}
    merged = apply_overrides(json.loads(json.dumps(raw)), ["ppo.kl={coef: 0.3, horizon: 100}"])
    assert merged["stages"]["ppo"]["kl"] == {"controller": "ziegler", "target": 4.0, "coef": 0.3, "horizon": 100}
    assert apply_overrides(json.loads(json.dumps(raw)), ["ppo.kl.coef=0.3"]) == apply_overrides(
        json.loads(json.dumps(raw)), ["ppo.kl={coef: 0.3}"])
    assert apply_overrides(json.loads(json.dumps(raw)), ["ppo.kl=null"])["stages"]["ppo"]["kl"] is None
    mix = {"name": "t", "stages": {"ppo": {"reward": {"reward": 1.0, "vader": 0.5}, "sweep": {"seed": [1, 2]}}}}
    mixed = apply_overrides(json.loads(json.dumps(mix)), ["ppo.reward={vader: 1.0}", "ppo={sweep: {beta: [0.1]}}"])
    assert mixed["stages"]["ppo"] == {"reward": {"vader": 1.0}, "sweep": {"beta": [0.1]}}  # a judges' mix, a sweep: whole
    swept = {"name": "t", "stages": {"ppo": {"type": "ppo", "sweep": {"kl": [{"coef": 0.1}, {"coef": 0.2}]}}}}
    with pytest.raises(ConfigError, match=r"stages\.ppo\.sweep\.kl: 'kl' is a group of settings; sweep one setting "
                                          r"in it with a dotted key, e.g. `kl\.coef: \[\.\.\.\]`"):
        parse_pipeline(swept, "p.yaml")


def test_a_setting_the_stage_does_not_read_leaves_its_fingerprint_alone():
    """Editing kl.kp of a PPO stage with a fixed KL coefficient retrained it and the evaluation, though a sweep over
    kl.kp there is refused as twins: the stage does not read it."""
    frontier = str(REPO / "pipelines" / "frontier.yaml")

    def prints(*overrides):
        return {p.name: p.fingerprint for p in build_plan(load_pipeline(frontier, list(overrides)), frontier)}

    plans = prints()
    assert prints("ppo_rm.kl.kp=5.0", "ppo_rm.kl.target=3.0", "grpo.epochs=9") == plans  # grpo sets max_steps
    read = prints("ppo_rm.ppo_epochs=3", "grpo.max_steps=256")  # what they read still reruns them
    assert all(read[n] != plans[n] for n in plans if n.startswith(("ppo_rm-", "grpo-", "evaluate")))


def test_sweep_config_for_wandb():
    variants = {"dpo-beta_0.1": {"stage": "dpo", "values": {"beta": 0.1}}}
    assert sweep_config("dpo-beta_0.1", variants) == {"sweep": {"beta": 0.1}, "swept_stage": "dpo"}
    assert sweep_config("sft", variants) == {}


def test_report_figures_render_a_sweeps_many_policies(tmp_path):
    """Nine policies with long names: the frontier plot moves its labels to a legend beside the axes (wider
    figure) and the win-rate bars tilt their names (taller figure)."""
    import random
    import struct

    from align.report import plots

    seed = 3
    print(f"seed {seed}")
    rng = random.Random(seed)
    policies = ["sft", *(f"ppo-kl.coef_{c}-learning_rate_1e-4" for c in (0.01, 0.05, 0.1, 0.2, 0.5)),
                *(f"dpo-beta_{b}" for b in (0.02, 0.05, 0.1))]
    m = {}
    for p in policies:
        y = rng.random()
        m.update({f"eval/{p}/kl": 5 * rng.random(), f"eval/{p}/vader/mean": y,
                  f"eval/{p}/vader/mean_ci": (y - .1, y + .1),
                  f"eval/{p}/vader/win_rate": y, f"eval/{p}/vader/win_rate_ci": (max(0, y - .1), min(1, y + .1))})
    plots.reward_vs_kl(m, policies, "vader", "sft", tmp_path / "kl.png")
    plots.win_rates(m, policies, ["vader"], "sft", tmp_path / "win.png")
    plots.reward_vs_kl(m, policies[:3], "vader", "sft", tmp_path / "kl3.png")

    def size(name: str) -> tuple[int, int]:
        return struct.unpack(">II", (tmp_path / name).read_bytes()[16:24])  # PNG IHDR: width, height

    assert size("kl.png")[0] > size("kl3.png")[0] and size("win.png")[1] > size("kl3.png")[1]


# --------------------------------------------------------------------------------------------- CLI
PIPELINE = """\
name: sweeptest
base_model: builtin:tiny-llama
builtin: {vocab_size: 512, hidden_size: 32, num_layers: 2, num_heads: 2, intermediate_size: 64,
          max_position_embeddings: 96}
tracking: {wandb: disabled}
stages:
  sft: {data: data_cards/movie_review_snippets.yaml, max_steps: 3, per_device_batch_size: 8, max_length: 96,
        max_train_examples: 200, eval_max_examples: 16, max_truncated_fraction: 0.2}
  dpo:
    policy: sft
    data: data_cards/hh_rlhf_harmless_pairs.yaml
    max_steps: 2
    per_device_batch_size: 4
    max_length: 96
    max_truncated_fraction: 1.0
    sweep: {beta: [0.1, 0.5]}
  evaluate:
    policies: [sft, dpo]
    reward: null
    preferences: null
    prompts: data_cards/movie_review_snippets.yaml
    max_prompts: 8
    bootstrap_samples: 100
    generation: {max_new_tokens: 8}
"""


def _project(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "data_cards").symlink_to(REPO / "data_cards")
    (root / "sweep.yaml").write_text(PIPELINE)
    return root


def test_validate_lists_every_variant_with_its_values(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(_project(tmp_path))
    assert cli_main(["validate", "sweep.yaml", "dpo.sweep={beta: [0.1, 0.5], seed: [1, 2]}"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if "fingerprint" in line]
    assert [r[0] for r in rows] == ["sft", "dpo-beta_0.1-seed_1", "dpo-beta_0.1-seed_2", "dpo-beta_0.5-seed_1",
                                    "dpo-beta_0.5-seed_2", "evaluate"]
    assert "(sweep of dpo: beta=0.5 seed=2)" in out
    assert rows[-1][3:7] == ["sft,", "dpo-beta_0.1-seed_1,", "dpo-beta_0.1-seed_2,", "dpo-beta_0.5-seed_1,"]
    assert "valid (6 stages)" in out


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    root = _project(tmp_path_factory.mktemp("sweeps") / "project")
    proc = run_align("run", "sweep.yaml", cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return root


def test_the_report_draws_the_sweep_as_one_frontier_curve(first_run):
    """evaluate groups dpo's variants into one curve: the frontier table lists both settings under `dpo (dpo)`
    with KL and its CI (the CI brackets the mean KL), and the figure is drawn."""
    report = first_run / "runs" / "sweeptest" / "main" / "report"
    m = json.loads((report / "metrics.json").read_text())
    assert m["eval/groups"] == {"sft": {"type": "sft", "policies": ["sft"]},
                                "dpo": {"type": "dpo", "policies": ["dpo-beta_0.1", "dpo-beta_0.5"]}}
    for p in ("sft", "dpo-beta_0.1", "dpo-beta_0.5"):
        lo, hi = m[f"eval/{p}/kl_ci"]
        assert lo <= m[f"eval/{p}/kl"] <= hi
    text = (report / "report.md").read_text()
    frontier = text.split("## Reward–KL frontier", 1)[1].split("## Length", 1)[0]
    assert "| dpo (dpo) | beta=0.1 |" in frontier and "| dpo (dpo) | beta=0.5 |" in frontier
    assert "| sft (sft) | - |" in frontier and "Pareto-optimal points for vader" in frontier
    assert (report / "frontier_vader.png").stat().st_size > 0


def _ran(stdout: str) -> list[str]:
    return re.findall(r"\[align\] stage \d+/\d+ (\S+) \(\w+\): running", stdout)


def _skipped(stdout: str) -> list[str]:
    return re.findall(r"\[align\] stage \d+/\d+ (\S+) \(\w+\): up to date .*skipped", stdout)


def test_only_and_from_with_a_swept_stage_name_select_every_variant(first_run, tmp_path):
    root = tmp_path / "project"
    shutil.copytree(first_run, root, symlinks=True)
    only = run_align("run", "sweep.yaml", "--only", "dpo", cwd=root, timeout=300)
    assert only.returncode == 0, only.stdout[-3000:] + only.stderr[-3000:]
    assert _skipped(only.stdout) == ["dpo-beta_0.1", "dpo-beta_0.5"] and _ran(only.stdout) == []
    bad = run_align("run", "sweep.yaml", "--from", "dpoo", cwd=root, timeout=300)
    assert bad.returncode == 2 and "--from dpoo: no such stage; did you mean 'dpo'?" in bad.stderr


def test_changing_one_swept_value_reruns_that_variant_and_the_evaluation(first_run, tmp_path):
    root = tmp_path / "project"
    shutil.copytree(first_run, root, symlinks=True)  # this test's own copy: the shared run stays as it was
    run = root / "runs" / "sweeptest" / "main"
    before = {n: json.loads((run / n / "manifest.json").read_text())
              for n in ("sft", "dpo-beta_0.1", "dpo-beta_0.5", "evaluate")}
    assert {m["status"] for m in before.values()} == {"completed"}
    proc = run_align("run", "sweep.yaml", "dpo.sweep.beta=[0.1, 0.3]", cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert _ran(proc.stdout) == ["dpo-beta_0.3", "evaluate"]
    assert _skipped(proc.stdout) == ["sft", "dpo-beta_0.1"]
    for name in ("sft", "dpo-beta_0.1"):  # not touched: the same manifest, one attempt
        assert json.loads((run / name / "manifest.json").read_text()) == before[name]
    new = json.loads((run / "dpo-beta_0.3" / "manifest.json").read_text())
    assert new["status"] == "completed" and new["config"]["beta"] == 0.3
    assert new["fingerprint"] not in {m["fingerprint"] for m in before.values()}
    report = (run / "report" / "report.md").read_text()
    assert "| dpo-beta_0.3 |" in report and "| dpo-beta_0.1 |" in report and "| dpo-beta_0.5 |" not in report


def test_a_seed_sweep_is_reported_as_one_recipe_with_its_spread(first_run, tmp_path):
    """`dpo.sweep={seed: [1, 2]}`: the report keeps the per-seed rows and adds the recipe's row, mean ± std [min, max]
    over the seeds, recomputed here from the per-seed metrics."""
    import statistics

    root = tmp_path / "project"
    shutil.copytree(first_run, root, symlinks=True)
    proc = run_align("run", "sweep.yaml", "dpo.sweep={seed: [1, 2]}", cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = root / "runs" / "sweeptest" / "main" / "report"
    m = json.loads((report / "metrics.json").read_text())
    kls = [m["eval/dpo-seed_1/kl"], m["eval/dpo-seed_2/kl"]]
    wins = [m["eval/dpo-seed_1/vader/win_rate"], m["eval/dpo-seed_2/vader/win_rate"]]
    assert m["eval/dpo/seeds/n"] == 2 and m["eval/dpo/seeds/kl/mean"] == pytest.approx(statistics.fmean(kls))
    assert m["eval/dpo/seeds/vader/win_rate/std"] == pytest.approx(statistics.stdev(wins))
    text = (report / "report.md").read_text()
    assert "| dpo-seed_1 |" in text and "| dpo-seed_2 |" in text  # the per-seed rows stay
    row = next(line for line in text.splitlines() if line.startswith("| dpo | 2 |"))
    assert f"{statistics.fmean(wins):.3f} ± {statistics.stdev(wins):.3f} [{min(wins):.3f}, {max(wins):.3f}]" in row
