"""Trainer and PPO checkpoints on disk: which one a stage resumes from, and rotation. A Trainer checkpoint is whole when
its trainer_state.json parses (transformers' main process writes it last of its files), every process's RNG state is
a whole archive, and, once align has synced every process's files (align/runtime/resume.py), it holds `DURABLE`; PPO's
are renamed into place with a COMPLETE marker (align/stages/ppo/checkpoint.py). No torch here."""

from __future__ import annotations

import json
from pathlib import Path

from align.core.fsutil import atomic_write_text, fsync_dir

DURABLE = "DURABLE"
"""Written into a Trainer checkpoint by the main process once every node has synced every process's files of it, and
before an older one is removed: a newer checkpoint without it is passed over for the newest with it (checkpoints
written before align marked them have none, and are chosen as before)."""


def mark_durable(ckpt: Path, metrics_rows: int) -> None:
    """`ckpt` synced on every node; `metrics_rows`: the stage's metrics rows when it was saved (`durable_rows`)."""
    atomic_write_text(ckpt / DURABLE, json.dumps({"metrics_rows": metrics_rows}))


def durable_rows(ckpt: Path | None) -> int | None:
    """The metrics rows the stage had logged when `ckpt` was saved, as its DURABLE marker says (None: not said)."""
    try:
        rows = json.loads((Path(ckpt) / DURABLE).read_text()).get("metrics_rows") if ckpt else None
    except (OSError, ValueError, AttributeError):
        return None
    return rows if type(rows) is int and rows >= 0 else None


def torn_rng_states(ckpt: Path, world_size: int) -> list[Path] | None:
    """A Trainer checkpoint's per-process RNG states that are missing or torn ([] when all are whole), or None when
    the checkpoint itself is not (its trainer_state.json, which transformers' main process writes last of its files,
    does not parse). The other processes write their RNG states (rng_state_<rank>.pth; rng_state.pth for one
    process) at their own pace, with no barrier before: whole means a whole torch.save archive (a zip, whose
    central directory comes last). A checkpoint without any (save_only_model) has none to miss."""
    import zipfile

    try:
        json.loads((ckpt / "trainer_state.json").read_text())
    except (OSError, ValueError):
        return None
    if not any(ckpt.glob("rng_state*.pth")):
        return []
    names = ["rng_state.pth"] if world_size == 1 else [f"rng_state_{r}.pth" for r in range(world_size)]
    return [ckpt / n for n in names if not zipfile.is_zipfile(ckpt / n)]


def checkpoint_files(root: Path) -> set[str]:
    """A checkpoint's files, RNG states aside (rundir.torn_rng_states) and DeepSpeed's `global_step<N>` folder named by
    its pattern: what an older checkpoint must hold of the newest's. A rotation removes an old checkpoint
    (shutil.rmtree, files in no fixed order; `rotate_checkpoints`, and transformers' own before align rotated): one
    killed meanwhile parses but lacks some."""
    import re

    return {re.sub(r"global_step\d+", "global_step*", str(p.relative_to(root))) for p in root.rglob("*")
            if p.is_file() and not p.name.startswith("rng_state") and p.name != DURABLE}


def choose_checkpoint(checkpoints: Path, world_size: int, log) -> Path | None:
    """The Trainer checkpoint to resume from (main process): the newest whole one; checkpoints whose trainer state
    is torn, ones newer than the newest marked DURABLE (synced on every node: a power loss or node loss before then
    can leave a weights file short under a trainer state that parses), older ones lacking files the newest holds (a
    rotation's removal cut short), and newer ones with a missing or torn RNG state, are removed. Where no whole one is left (checkpoints rotated by transformers, which removed
    the last before the other processes finished writing, or copied by hand), the newest with its torn RNG states
    removed: it resumes, those processes' random streams not restored (transformers says so in its log)."""
    import shutil

    states: dict[Path, list[Path]] = {}
    for ckpt in step_checkpoints(checkpoints):
        torn = torn_rng_states(ckpt, world_size)
        if torn is None:
            log.warning("removing incomplete checkpoint %s", ckpt)
            shutil.rmtree(ckpt)
        else:
            states[ckpt] = torn
    marked = [c for c in states if (c / DURABLE).is_file()]
    for ckpt in list(states)[list(states).index(marked[-1]) + 1:] if marked else []:
        log.warning("removing checkpoint %s: its save was cut short before every process's files were synced to "
                    "disk (no %s marker; its files may be short after a crash); resuming from %s", ckpt, DURABLE,
                    marked[-1])
        shutil.rmtree(ckpt)
        del states[ckpt]
    expected = checkpoint_files(list(states)[-1]) if states else set()
    for ckpt in list(states)[:-1]:
        lacking = sorted(expected - checkpoint_files(ckpt))
        if lacking:
            log.warning("removing checkpoint %s: it lacks %s (its removal was cut short)", ckpt, lacking[:3])
            shutil.rmtree(ckpt)
            del states[ckpt]
    whole = [c for c, torn in states.items() if not torn]
    for ckpt in [c for c, torn in states.items() if torn]:
        if whole and list(states).index(ckpt) > list(states).index(whole[-1]):
            log.warning("removing checkpoint %s: RNG states %s missing or torn", ckpt, [t.name for t in states[ckpt]])
            shutil.rmtree(ckpt)
    if whole or not states:
        return whole[-1] if whole else None
    newest = list(states)[-1]
    for torn in states[newest]:
        torn.unlink(missing_ok=True)
    log.warning("resuming from %s without the RNG states %s (missing or torn; no older whole checkpoint)", newest,
                [t.name for t in states[newest]])
    return newest


def step_checkpoints(checkpoints: Path, prefix: str = "checkpoint-") -> list[Path]:
    """The checkpoints `<prefix><step>` by step: Trainer's (`checkpoint-old`: not one), PPO's with prefix `iter-`."""
    return sorted((p for p in checkpoints.glob(f"{prefix}*") if p.is_dir() and p.name[len(prefix):].isdigit()),
                  key=lambda p: int(p.name[len(prefix):]))


def rotate_checkpoints(checkpoints: Path, keep: int) -> list[Path]:
    """Remove all but the newest `keep` Trainer checkpoints (by step, not mtime: a copied run dir keeps its order),
    then sync the directory; returns those removed."""
    import shutil

    found = step_checkpoints(checkpoints)
    gone = found[:-keep] if keep > 0 else []
    for old in gone:
        shutil.rmtree(old)
    fsync_dir(checkpoints)
    return gone
