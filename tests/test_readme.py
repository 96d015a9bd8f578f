"""README is for users and stays true: at most 250 lines; every command in its bash blocks runs as written (the
launcher's dry run gives the `align` command it would run, which the CLI's own parser and the pipeline parser then
accept: files, flags, overrides and run directories); every pipeline sketch in it parses; every link in README and
docs/ points at a file that exists; docs/configuration.md is what the code generates."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys

import pytest
import yaml

from conftest import REPO

README = (REPO / "README.md").read_text()


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", text, flags=re.S)


def _commands() -> list[list[str]]:
    out = []
    for block in _blocks(README, "bash"):
        for line in block.splitlines():
            words = shlex.split(line, comments=True)
            if words:
                out.append(words)
    return out


def test_readme_is_short():
    assert len(README.splitlines()) <= 250, "README is for users: results and histories go to docs/"


def test_readme_has_the_two_commands_and_ci_runs_the_test_command():
    commands = _commands()
    assert ["./launch.sh"] in commands and ["./launch.sh", "--tests"] in commands, commands
    ci = [line.strip() for line in (REPO / ".ci" / "run").read_text().splitlines()]
    assert "./launch.sh --tests" in ci


def _check_align(argv: list[str]) -> None:
    """The CLI's parser takes the arguments; a pipeline (with its overrides) parses; a run directory is the one a
    shipped pipeline writes."""
    from align.cli import _parser
    from align.config import load_pipeline

    args = _parser().parse_args(argv)  # argparse exits (SystemExit) on an unknown flag or command
    if args.command in ("run", "validate", "estimate"):
        load_pipeline(REPO / args.pipeline, args.overrides)
    elif args.command in ("status", "report", "verify"):
        name, run_id = args.run_dir.split("/")[1:3]
        shipped = {load_pipeline(p).name for p in (REPO / "pipelines").glob("*.yaml")}
        assert args.run_dir == f"runs/{name}/{run_id}" and name in shipped and run_id == "main", args.run_dir


@pytest.mark.parametrize("words", _commands(), ids=lambda w: " ".join(w)[:60])
def test_every_readme_command_runs_as_written(words):
    if words[0] == "./launch.sh" and words[1:] == ["--tests"]:
        return  # CI runs it (the test above); running it here would recurse
    if words[0] == "./launch.sh":
        proc = subprocess.run(["bash", "launch.sh", *words[1:]], cwd=REPO, capture_output=True, text=True, timeout=60,
                              env={**os.environ, "ALIGN_DRY_RUN": "1"})
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if words[1:] == ["--setup"]:
            return
        printed = shlex.split(proc.stdout.strip().splitlines()[-1])
        assert printed[:2] == ["align", "run"], proc.stdout
        _check_align(printed[1:])
    elif words[:2] == ["source", ".venv/bin/activate"]:
        assert re.search(r"^VENV=.*\.venv", (REPO / "launch.sh").read_text(), flags=re.M)  # what launch.sh creates
    elif words[0] == "align":
        _check_align(words[1:])
    elif words[0] == "python" and words[1].startswith("benchmarks/"):
        # the script exists, its --help names every flag README gives it, and the paths README names exist
        proc = subprocess.run([sys.executable, words[1], "--help"], cwd=REPO, capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        flags = [w.split("=")[0] for w in words[2:] if w.startswith("--")]
        assert flags and all(f in proc.stdout for f in flags), (flags, proc.stdout)
        paths = [w for w in words[2:] if "/" in w]
        assert all((REPO / w).exists() for w in paths), paths
    else:
        pytest.fail(f"README runs {words[0]!r}: teach this test how to check it")


def test_every_pipeline_sketch_in_readme_parses():
    from align.config import parse_pipeline

    sketches = [yaml.safe_load(b) for b in _blocks(README, "yaml")]
    sketches = [s for s in sketches if isinstance(s, dict) and "stages" in s]
    assert sketches
    for raw in sketches:
        cfg = parse_pipeline(raw, "README.md")
        assert cfg.stages


def test_every_pipeline_sketch_in_readme_validates_on_a_real_card(tmp_path, monkeypatch):
    """What a user copies passes `align validate` with its cards in place (the movie-review card for each): the
    sketch's reward stage at its default max_length of 128 was refused once PPO's prompts + replies (512 + 24) had
    to fit it (2026-12-01 review)."""
    from align.config import parse_pipeline
    from align.orchestrator.validate import validate

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # the sketch's hub base is not asked for (no network here)
    card = str(REPO / "data_cards" / "movie_review_snippets.yaml")
    sketches = [yaml.safe_load(b) for b in _blocks(README, "yaml")]
    for raw in [s for s in sketches if isinstance(s, dict) and "stages" in s]:
        for stage in raw["stages"].values():
            stage.update({k: card for k, v in stage.items() if isinstance(v, str) and v.endswith(".yaml")})
        source = tmp_path / "sketch.yaml"
        source.write_text(yaml.safe_dump(raw))
        validate(parse_pipeline(raw, str(source)), source, verbose=False)


def test_every_link_in_readme_and_docs_points_at_a_file():
    broken = []
    for doc in [REPO / "README.md", *(REPO / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", doc.read_text()):
            if not target.startswith(("http://", "https://")) and not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(REPO)}: {target}")
    assert not broken, broken


def test_configuration_reference_is_what_the_code_generates():
    from align.orchestrator import reference

    assert reference.main(["--check"]) == 0, "docs/configuration.md is stale: python -m align.orchestrator.reference"
    text = reference.render()  # and it documents what a user sets: a nested setting, a range, a default
    assert "| `kl.max` |" in text and "| `dpo.beta` |" not in text and "| `beta` | `float` | `0.1` | > 0 |" in text
    # the settings of a list of settings, and of optional ones (a docs review, 2026-11-30: only their class was named)
    assert "| `pairwise[].deadline` | `float` | `3600.0` | in (0, 604800] |" in text and "| `pairwise.timeout` |" in text
