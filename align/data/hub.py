"""Hub datasets as data cards read them: whether the hub answers from here, a local mirror of hub repositories
($ALIGN_HUB_MIRROR, for clusters whose compute nodes cannot reach the hub), and the commit a revision names now
(so a fingerprint changes when the dataset does). Torch-free; `datasets` itself is imported only to read rows
(align/data/cards.py `_read_hub`)."""

from __future__ import annotations

import hashlib
import os
import re
import socket
from pathlib import Path
from urllib.parse import urlparse


def _on(value: str | None) -> bool:
    """huggingface_hub's reading of a boolean variable (constants._is_true): 1, ON, YES or TRUE, any case."""
    return value is not None and value.upper() in ("1", "ON", "YES", "TRUE")


def hub_offline() -> bool:
    """huggingface_hub's offline mode, which models, tokenizers, revisions and pushes obey (constants.HF_HUB_OFFLINE):
    HF_HUB_OFFLINE, or TRANSFORMERS_OFFLINE where HF_HUB_OFFLINE is unset or empty."""
    return _on(os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE"))


def datasets_offline() -> bool:
    """datasets' offline mode (datasets.config.HF_HUB_OFFLINE): HF_DATASETS_OFFLINE where it is set, either way, else
    the hub's. Offline, datasets reads its cached copies and asks nothing."""
    own = os.environ.get("HF_DATASETS_OFFLINE")
    return hub_offline() if own is None else _on(own)


def hub_unreadable(hub_id: str) -> bool:
    """Whether validation must leave hub dataset `hub_id` unread: no mirror of it, the hub not reachable, and not in
    datasets' offline mode (where it reads its cached copy at once, as the stage will: its rows and the evaluation
    prompts' overlap with training prompts are checked then, not skipped)."""
    return hub_mirror(hub_id) is None and not datasets_offline() and not hub_reachable()


def hub_reachable(timeout: float = 3.0) -> bool:
    """Whether the Hugging Face hub answers a TCP connection from here (False in offline mode). Lets validation
    tell an unreachable hub at once instead of after the datasets library's retries."""
    if hub_offline():
        return False
    try:
        with socket.create_connection(hub_address(), timeout=timeout):
            return True
    except OSError:
        return False


def hub_address() -> tuple[str, int]:
    """Where a connection to the hub goes first: HF_ENDPOINT's host and port (its scheme's, 80 for http), or the
    proxy the environment names for it (HTTPS_PROXY, HTTP_PROXY; not for a host NO_PROXY lists), as
    huggingface_hub's requests would: on a cluster that reaches the hub through a proxy alone, the hub's own address
    never answers."""
    import urllib.request

    url = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    scheme, host = url.scheme or "https", url.hostname or "huggingface.co"
    proxies = urllib.request.getproxies()
    proxy = proxies.get(scheme) or proxies.get("all")  # httpx, which huggingface_hub uses, reads ALL_PROXY too
    if proxy and not urllib.request.proxy_bypass(host):
        url = urlparse(proxy if "://" in proxy else f"http://{proxy}")
        scheme, host = url.scheme, url.hostname or host
    return host, url.port or (80 if scheme == "http" else 1080 if scheme.startswith("socks") else 443)


HUB_MIRROR_ENV = "ALIGN_HUB_MIRROR"
"""A directory of local copies of hub dataset repositories, one per `<org>/<name>` (what `hf download
--repo-type dataset ORG/NAME --local-dir $ALIGN_HUB_MIRROR/ORG/NAME` writes): a hub card whose dataset is there is
read from it, for clusters whose compute nodes cannot reach the hub (and for tests: fixtures in the hub's layout)."""


def hub_mirror(hub_id: str) -> Path | None:
    """The local copy of hub dataset `hub_id` under $ALIGN_HUB_MIRROR, when there is one."""
    root = os.environ.get(HUB_MIRROR_ENV)
    if not root:
        return None
    path = Path(root) / hub_id
    return path if path.is_dir() else None


def mirror_commits(root: Path, under: str | None = None) -> set[str]:
    """The commits the files of a mirror (those under `under`, a card's data_dir, when given) were downloaded at, as
    huggingface_hub records them beside a `--local-dir` download (`.cache/huggingface/download/<file>.metadata`:
    commit, etag, time). As huggingface_hub reads them: the record of a file since removed, or changed after it was
    downloaded, says nothing. Empty when the mirror was made another way."""
    found = set()
    records = root / ".cache" / "huggingface" / "download"
    for meta in (records / under if under else records).rglob("*.metadata"):
        file = root / meta.relative_to(records).with_suffix("")
        try:
            commit, _etag, stamp = meta.read_text(encoding="utf-8").split("\n")[:3]
            fresh = file.stat().st_mtime - 1 <= float(stamp)  # huggingface_hub's own rule (1 s of slack)
        except (OSError, UnicodeDecodeError, ValueError):  # no such file any more, or a torn record
            continue
        if fresh and _COMMIT.fullmatch(commit.strip()):
            found.add(commit.strip())
    return found


_COMMIT = re.compile(r"[0-9a-f]{40}")


def mirror_mismatch(root: Path, hub_id: str, revision: str | None, under: str | None = None) -> str | None:
    """Why the mirror of `hub_id` at `root` (its files under `under`) is not the commit a card pins as its
    `revision` (40 hex digits); None when it is, when nothing says which commit the mirror is, or when the revision
    is a branch, a tag or a short commit (which name whatever was downloaded: the fingerprint is the mirror's files)."""
    commits = mirror_commits(root, under)
    if not commits or not isinstance(revision, str) or not _COMMIT.fullmatch(revision):
        return None
    other = sorted(c for c in commits if c != revision)
    if not other:
        return None
    return (f"its mirror {root} holds files downloaded at commit {', '.join(c[:12] for c in other)}, not the commit "
            f"the card pins as its revision, {revision}; download that revision into it (hf download --repo-type "
            f"dataset {hub_id} --revision {revision} --local-dir {root}), or pin the card to the mirror's")


def mirror_digest(root: Path) -> str:
    """sha256 over a mirrored dataset's files (names and contents): its identity in fingerprints."""
    h = hashlib.sha256()
    for file in sorted(p for p in root.rglob("*") if p.is_file() and ".cache" not in p.parts):
        h.update(file.relative_to(root).as_posix().encode())
        with open(file, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()


_REVISIONS: dict[tuple[str, str | None], str | None] = {}


RUN_REVISIONS_ENV = "ALIGN_RUN_REVISIONS"
"""The run's own record of the commits it resolved (`align run` sets it to <run dir>/hub-revisions.json for itself
and its stage processes): read before align's cache, so another run that resolved a newer commit since does not
change this run's fingerprints when it resumes offline."""


def resolved_revision(hub_id: str, revision: str | None) -> str | None:
    """The commit a hub dataset's `revision` (a branch, a tag or a commit; None: main) names now, so a fingerprint
    changes when the dataset does. When the hub cannot be asked from here, the commit it named when this run last
    could ($ALIGN_RUN_REVISIONS), else when any run on this cache did (`hub-revisions.json` in align's cache): a resume
    while the hub is down or from an offline node keeps the fingerprints it had, instead of rerunning every stage
    that reads the dataset; the revision as written when it never could."""
    key = (hub_id, revision)
    if key not in _REVISIONS:
        run = os.environ.get(RUN_REVISIONS_ENV)  # a stage process (pin_to_run): the commit this run's plan resolved
        planned = _known(Path(run)).get(f"{hub_id}@{revision}") if _PINNED[0] and run else None
        _REVISIONS[key] = planned or _remembered(hub_id, revision)
        if not planned and not datasets_offline() and hub_reachable():  # offline, datasets reads only its cache
            try:
                from huggingface_hub import HfApi  # light (no torch): only for hub cards, and only when reachable

                sha = HfApi().dataset_info(hub_id, revision=revision).sha
            except Exception:  # unknown repo or revision, no access: loading the rows will say which
                sha = None
            if sha:
                _REVISIONS[key] = sha
                _remember(hub_id, revision, sha)
    return _REVISIONS[key]


_PINNED = [False]


def pin_to_run() -> None:
    """In a stage process: a dataset's commit is the one this run's plan resolved and fingerprinted (the run's own
    record), not what its branch names by the time the stage starts (hours later, for DPO after SFT); a commit the
    plan never resolved is asked for as before."""
    _PINNED[0] = True


def _revisions_files() -> list[Path]:
    """Where commits are remembered, the first read first: the run's own record, then align's cache."""
    from align.core.fsutil import cache_root

    run = os.environ.get(RUN_REVISIONS_ENV)
    return ([Path(run)] if run else []) + [cache_root() / "hub-revisions.json"]


def _known(path: Path | None = None) -> dict:
    """The commits remembered in `path` (default: every file, the run's winning), by `<hub id>@<revision>` ({} when
    none are, or a file is torn)."""
    import json

    known: dict = {}
    for file in reversed(_revisions_files()) if path is None else [path]:
        try:
            found = json.loads(file.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        known.update(found if isinstance(found, dict) else {})
    return known


def _remembered(hub_id: str, revision: str | None) -> str | None:
    return _known().get(f"{hub_id}@{revision}", revision)


def _remember(hub_id: str, revision: str | None, sha: str) -> None:
    """Add one commit to the remembered ones, in each file: read, added to and written again under a lock on a file
    beside it, so that runs (or a run's processes) resolving other datasets at the same moment do not drop each
    other's."""
    import fcntl

    from align.core.fsutil import atomic_write_json

    for path in _revisions_files():
        if _known(path).get(f"{hub_id}@{revision}") == sha:
            continue
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                atomic_write_json(path, {**_known(path), f"{hub_id}@{revision}": sha})
        except OSError:
            pass  # read-only: asked again next time


def hub_revision(base_model: str) -> str | None:
    """The commit of the hub snapshot a hub id was just loaded from (the cache's refs/main, which a download updates
    first), or None: a local directory or file, or a repository not cached. Recorded where a stage republishes the
    base (pretrained) or trains adapters of it, so that a push pins the base its adapters load on."""
    from huggingface_hub import try_to_load_from_cache  # light

    if Path(base_model).exists():
        return None
    try:
        found = try_to_load_from_cache(base_model, "config.json")
    except ValueError:  # not a repository id (huggingface_hub's HFValidationError)
        return None
    parts = Path(found).parts if isinstance(found, str) else ()  # .../models--org--name/snapshots/<commit>/config.json
    layout = len(parts) >= 4 and parts[-3] == "snapshots" and parts[-4].startswith("models--")
    return parts[-2] if layout else None
