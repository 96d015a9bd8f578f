"""The orchestrator (cli, plan, validate, estimate, runner, launch, status) never imports torch, and asks each stage
type's config class instead of knowing stage types by name (issue 25).

Torch is made unimportable in the orchestrator's own process only (an import hook installed before align.cli is
imported, tests/probes/notorch.py): the helper process that loads tokenizers (align/orchestrator/helper.py) and the stage
processes import torch as usual. The probe asserts at exit that no torch module was imported."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest

from conftest import REPO, TINY, run_align

PROBE = REPO / "tests" / "probes" / "notorch.py"
# The orchestrator's modules, which the class contract keeps free of stage-type names.
NAME_FREE = ["align/orchestrator/plan.py", "align/orchestrator/validate.py", "align/orchestrator/data_checks.py", "align/data/lengths.py", "align/orchestrator/runner.py", "align/runtime/context.py", "align/runtime/process.py"]


def _no_torch(*args: str, cwd=REPO, timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(PROBE), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_validate_without_torch_checks_tokenizer_lengths_and_examples_in_a_helper():
    """A pipeline with a real tokenizer (GPT-2's, vendored): the length counts and the rendered example come from
    the helper process, the orchestrator stays torch-free."""
    proc = _no_torch("validate", "pipelines/hh_rlhf_tiny.yaml")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "NO-TORCH rc 0" in out
    assert re.search(r"length check sft: \d+ examples", out)  # counted with the loaded GPT-2 tokenizer
    assert "valid (" in out


def test_a_refusal_in_the_helper_is_exit_2_with_its_message():
    """A LoRA target the model lacks is found on the meta device in the helper; the orchestrator refuses with the
    helper's message, no traceback, still without torch."""
    proc = _no_torch("validate", "pipelines/default.yaml", *TINY, "sft.lora.enabled=true",
                     "sft.lora.target_modules=[q_proj,nonexistent_proj]")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "stages.sft.lora.target_modules: ['nonexistent_proj'] name no linear layer" in out
    assert "Traceback" not in out


def test_estimate_without_torch_sizes_every_stage_in_a_helper():
    proc = _no_torch("estimate", "pipelines/hh_rlhf.yaml")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "| ppo | ppo | policy* 1,011.8M" in out  # pythia-1b, counted on the meta device by the helper
    assert "NO-TORCH rc 0" in out


def test_run_without_torch_launches_a_stage_that_completes(workdir):
    proc = _no_torch("run", "pipelines/default.yaml", "--only", "sft", "tracking.wandb=disabled", *TINY,
                     "sft.max_steps=4", cwd=workdir)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "NO-TORCH rc 0" in out
    manifest = (workdir / "runs" / "default" / "main" / "sft" / "manifest.json").read_text()
    assert '"status": "completed"' in manifest  # the stage process did import torch, and trained


@pytest.mark.parametrize("module", NAME_FREE)
def test_orchestrator_modules_name_no_stage_type(module):
    """What grep would find: any registered stage type's name as a word, in code, strings or comments."""
    from align.config import stage_types

    names = sorted(stage_types())
    assert {"sft", "reward", "dpo", "ppo", "evaluate", "preferences", "grpo", "rloo"} <= set(names)
    text = (REPO / module).read_text(encoding="utf-8")
    found = [(i + 1, line.strip()) for i, line in enumerate(text.splitlines())
             if re.search(r"\b(" + "|".join(names) + r")\b", line, flags=re.IGNORECASE)]
    assert found == [], f"{module} names stage types: {found[:5]}"


def test_one_command_works_out_the_model_inputs_once(workdir, monkeypatch, capsys):
    """`align validate` asks for the base model's paths and config.json from several checks (plan, validation,
    lengths, tokenizer): within one command they are worked out once (inputs.resolved_once); outside a command
    (a library caller) each call looks again, so nothing stale is read."""
    from collections import Counter

    from align import cli
    from align.config import load_pipeline
    from align.orchestrator import inputs
    from align.orchestrator.validate import validate

    calls: Counter = Counter()
    def counting(name: str):
        real = getattr(inputs, name)

        def counted(*args, **kwargs):
            calls[name] += 1
            return real(*args, **kwargs)
        return counted

    for name in ("_resolve_model_paths", "_base_model_config"):
        monkeypatch.setattr(inputs, name, counting(name))
    monkeypatch.chdir(workdir)
    assert cli.main(["validate", "pipelines/default.yaml"]) == 0, capsys.readouterr().err
    assert calls == {"_resolve_model_paths": 1, "_base_model_config": 1}, calls

    calls.clear()
    validate(load_pipeline("pipelines/default.yaml", []), "pipelines/default.yaml")  # no command scope
    print("without the scope:", dict(calls))
    assert calls["_resolve_model_paths"] > 1, calls  # what the scope saves


def test_an_engine_module_that_does_not_import_is_one_line_before_anything_runs(workdir):
    """ALIGN_ENGINE_MODULES naming a module that is missing or raises: every command refuses at once, naming the
    variable, the module and the cause (the registry imports it with align.config, before a command could report)."""
    proc = run_align("validate", "pipelines/default.yaml", cwd=workdir, env={"ALIGN_ENGINE_MODULES": "no_such_engine_mod"})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("align: error: ALIGN_ENGINE_MODULES: cannot import engine module 'no_such_engine_mod' "
                                  "(ModuleNotFoundError"), proc.stderr
