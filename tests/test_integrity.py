"""Nothing consumed unchecked, nothing "completed" that is wrong (issue 22, first part): whole-file digests of
every published output, checked by the next consumer, the skip decision and `align status`; finite and bounded
settings; an all-zero reward refused; a non-finite final metric fails its stage; the CLI says what it will do."""

from __future__ import annotations

import json
import random
import shutil

import pytest

from align.core.fsutil import output_digest, output_problem
from conftest import TINY, run_align

SEED = 22


def _flip(path, offset: int, n: int = 64) -> None:
    """Overwrite n bytes at offset with different bytes (same size)."""
    with open(path, "r+b") as fh:
        fh.seek(offset)
        old = fh.read(n)
        fh.seek(offset)
        fh.write(bytes((b + 1) % 256 for b in old))


@pytest.mark.parametrize("where", ["start", "middle", "end"])
def test_a_flipped_byte_anywhere_is_found_and_named(tmp_path, where):
    print(f"seed {SEED}")
    rng = random.Random(SEED)
    out = tmp_path / "model"
    out.mkdir()
    big = out / "model.safetensors"
    big.write_bytes(rng.randbytes(20 << 20))  # past the 16 MiB the old digest read in full, past its first MiB
    (out / "config.json").write_text("{}")
    recorded = output_digest(out)
    assert output_problem(out, recorded) is None
    offset = {"start": 0, "middle": 10 << 20, "end": (20 << 20) - 64}[where]
    _flip(big, offset)
    problem = output_problem(out, json.loads(json.dumps(recorded)))  # as read back from a manifest
    assert problem and str(big) in problem and "changed after it was published" in problem


def test_truncated_missing_and_added_files_are_named(tmp_path):
    out = tmp_path / "model"
    out.mkdir()
    (out / "a.bin").write_bytes(b"x" * 1000)
    (out / "b.json").write_text("{}")
    recorded = output_digest(out)
    (out / "a.bin").write_bytes(b"x" * 10)
    assert "a.bin has 10 bytes, 1,000 when it was published (truncated)" in output_problem(out, recorded)
    (out / "a.bin").write_bytes(b"x" * 1000)
    (out / "b.json").unlink()
    assert f"{out / 'b.json'} is missing" == output_problem(out, recorded)
    (out / "b.json").write_text("{}")
    (out / "c.safetensors").write_bytes(b"")
    assert "c.safetensors was added" in output_problem(out, recorded)
    shutil.rmtree(out)
    assert output_problem(out, recorded) == f"{out} is missing"


def test_a_file_rewritten_at_its_size_with_its_mtime_put_back_is_found_in_the_same_process(tmp_path, monkeypatch):
    """The process that published an output remembered its digest by path, size and mtime: the same bytes' count
    rewritten in place with the mtime set back (`touch -r`, a restore that keeps times) was reported intact by that
    process, and its new stamp recorded as verified, so every later `align run` and `status` trusted it too."""
    import os

    monkeypatch.setenv("ALIGN_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "model"
    out.mkdir()
    weights = out / "w.bin"
    weights.write_bytes(b"A" * 4096)
    recorded = output_digest(out)  # this process hashed w.bin
    st = os.stat(weights)
    with open(weights, "r+b") as fh:
        fh.write(b"B" * 4096)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert f"{weights} changed after it was published" in output_problem(out, recorded)
    assert f"{weights} changed after it was published" in output_problem(out, recorded, full=True)
    assert f"{weights} changed after it was published" in output_problem(out, recorded)  # nothing vouched for it


ARGS = ["pipelines/default.yaml", "--run-id", "integrity", "tracking.wandb=disabled", *TINY, "sft.max_steps=5",
        "sft.save_steps=5", "preferences.max_prompts=32", "reward.max_steps=2", "reward.save_steps=2"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrity")
    for name in ("pipelines", "data_cards"):
        (root / name).symlink_to((__import__("conftest").REPO / name))
    for stage in ("sft", "preferences", "reward"):
        proc = run_align("run", *ARGS, "--only", stage, cwd=root)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return root, root / "runs" / "default" / "integrity"


def test_damaged_weights_stop_the_next_consumer_the_skip_and_status(run):
    root, run_dir = run
    weights = run_dir / "sft" / "model" / "model.safetensors"
    backup = weights.read_bytes()
    try:
        _flip(weights, len(backup) // 2)  # same size, bytes past any header
        status = run_align("status", str(run_dir), cwd=root)
        assert status.returncode == 0 and "completed, output damaged" in status.stdout
        assert f"{weights} changed after it was published" in status.stdout and "--from sft" in status.stdout
        for stage in ("reward", "dpo"):  # reward is up to date (a skip), dpo would load sft's model
            proc = run_align("run", *ARGS, "--only", stage, cwd=root)
            assert proc.returncode == 2, proc.stdout[-1500:]
            assert f"stage 'sft' completed, but {weights} changed" in proc.stderr and "--from sft" in proc.stderr
            assert "Traceback" not in proc.stderr
        with open(weights, "r+b") as fh:  # truncated: named, not a safetensors traceback
            fh.truncate(len(backup) - 100)
        proc = run_align("run", *ARGS, "--only", "dpo", cwd=root)
        assert proc.returncode == 2 and "(truncated)" in proc.stderr and str(weights) in proc.stderr
    finally:
        weights.write_bytes(backup)
    proc = run_align("run", *ARGS, "--only", "reward", cwd=root)  # restored: up to date again, skipped
    assert proc.returncode == 0 and "reward (reward): up to date" in proc.stdout, proc.stderr[-1500:]


def test_a_deleted_model_is_not_completed_or_current(run):
    """`align status` says so, and `--only reward` no longer skips over it (a plain `align run` reruns sft and
    its dependants: tests/test_hostile.py)."""
    root, run_dir = run
    model = run_dir / "sft" / "model"
    moved = model.with_name("model.away")
    model.rename(moved)
    try:
        status = run_align("status", str(run_dir), cwd=root)
        assert "| sft | sft | completed, output missing |" in status.stdout
        proc = run_align("run", *ARGS, "--only", "reward", cwd=root)
        assert proc.returncode == 2 and "needs stage 'sft' completed" in proc.stderr, proc.stdout[-1500:]
    finally:
        moved.rename(model)


@pytest.mark.parametrize("override, message", [
    ("dpo.beta=.inf", "stages.dpo.beta: inf is not a finite number"),
    ("sft.learning_rate=1e400", "stages.sft.learning_rate: inf is not a finite number"),
    ("sft.max_steps=99999999999999999999999", "stages.sft.max_steps: 99999999999999999999999 is out of range"),
    ("ppo.reward={reward: 0.0}", "every weight of {'reward': 0.0} is 0"),
])
def test_settings_are_finite_bounded_and_meaningful(workdir, override, message):
    proc = run_align("validate", "pipelines/default.yaml", override, cwd=workdir)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("flags, message", [
    (["--only", "reward", "--from", "dpo"], "--only reward and --from dpo together"),
    (["--num-processes", "0"], "--num-processes: 0: give 1 or more"),
    (["--only", ""], "--only '': no such stage"),
    (["--from", "rewrd"], "did you mean 'reward'? (stages: sft, preferences, reward, ppo, dpo, evaluate)"),
])
def test_the_cli_refuses_what_it_would_not_do(workdir, flags, message):
    proc = run_align("run", "pipelines/default.yaml", *flags, cwd=workdir)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (workdir / "runs").exists()  # refused before anything ran


def test_a_non_finite_final_metric_fails_the_stage(tmp_path):
    from align.config import stage_types
    from align.runtime.context import StageError
    from align.runtime.process import check_produced

    class Ctx:
        name, dir, extra_manifest, cfg, is_main = "sft", tmp_path, {"global_step": 3}, stage_types()["sft"](), True

    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    check_produced(Ctx(), ["model"], {"train/loss": 1.2, "eval/loss": 0.9})
    with pytest.raises(StageError, match=r"eval/loss = nan: the model diverged .*stages.sft.learning_rate"):
        check_produced(Ctx(), ["model"], {"train/loss": 1.2, "eval/loss": float("nan")})
    with pytest.raises(StageError, match=r"eval/rewards/margin = inf"):
        check_produced(Ctx(), ["model"], {"eval/rewards/margin": float("inf")})
    # evaluate trains nothing: a pairwise judge named "accuracy_judge" whose length-controlled win rate (or a gold
    # judge "math:accuracy" whose agreement) is NaN by design, printed "n/a", failed a finished report as "diverged"
    class Eval(Ctx):
        name, cfg, extra_manifest = "evaluate", stage_types()["evaluate"](), {}

    (tmp_path / "report").mkdir()
    (tmp_path / "report" / "report.md").write_text("# report")
    check_produced(Eval(), ["report"], {"eval/prompts": 64, "eval/ppo/accuracy_judge/lc_win_rate": float("nan"),
                                        "eval/ppo/accuracy_judge/agreement/math:accuracy": float("nan")})


def test_status_reads_no_published_bytes_unless_a_stamp_changed_and_verify_reads_them_all(run, monkeypatch):
    """`align status` (and the skip decision) check each published file's stamp (size, mtime, ctime, inode): an
    unchanged file is not read at all; a file rewritten in place, even with its mtime set back, has a new ctime
    and is read, hashed and named. `align verify` reads everything."""
    import os

    import align.core.fsutil as fsutil
    from align.orchestrator.status import status_table, verify

    root, run_dir = run
    read: list[str] = []
    real = fsutil.file_sha256

    def counting(path):
        read.append(str(path))
        return real(path)

    monkeypatch.setattr(fsutil, "file_sha256", counting)
    fsutil._HASHED.clear()
    table = status_table(run_dir)
    assert "output damaged" not in table and read == []  # nothing re-read: every stamp as published
    weights = run_dir / "sft" / "model" / "model.safetensors"
    report, intact = verify(run_dir)
    assert intact and str(weights) in read and "| sft | " in report and "intact" in report
    read.clear()
    st = os.stat(weights)
    backup = weights.read_bytes()
    try:
        _flip(weights, len(backup) // 2)
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime set back: only ctime tells
        fsutil._HASHED.clear()
        table = status_table(run_dir)
        assert set(read) == {str(weights)}  # only the changed file was read
        assert "completed, output damaged" in table and f"{weights} changed after it was published" in table
        report, intact = verify(run_dir)
        assert not intact and "DAMAGED" in report
    finally:
        weights.write_bytes(backup)
    fsutil._HASHED.clear()
    read.clear()
    assert "output damaged" not in status_table(run_dir)  # restored: read once (new stamp), found intact
    assert read == [str(weights)]
    read.clear()
    status_table(run_dir)
    assert read == []  # and remembered: not read again
