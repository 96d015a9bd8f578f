"""One rollout engine shared by several training processes (generation.tensor_parallel_size > 1: an engine over a
group of GPUs; or engines on GPUs training does not use): align/engines/placement.py says which processes an engine
serves, this module makes that true.

- start: the engine's starter (the first process it serves) starts it for all of them; every process of the job then
  learns, in one all-gather, how to reach its engine (a contact: for vLLM its socket, connection key and process id,
  which travel between the job's own processes and are written nowhere) or that some engine failed to start, and in
  a second whether every process reached its engine: on a failure every process raises, none waits for a peer that
  will not come. Under `placement: separate` with engines serving unequal numbers of processes, a process alone on
  its engine still goes through here (placement's `shared` is the node's): the collectives need every process.
- start_each: where every process has an engine of its own, each starts its own and then learns in one all-gather
  whether all did (one that failed ends every process's stage, none goes on into collectives it would wait in).
- generate: each process sends its own prompts to its engine whenever it samples (the engine serves requests one at
  a time, in the order they come), so stages whose processes sample different numbers of batches (preferences,
  evaluate) work unchanged.
- sync: only the starter sends weights; the others join the ZeRO-3 gathers that sync takes part in
  (weight_sync.join_gathers) and then wait for it, with every other process of the job, in one all-gather that also
  carries whether every sync succeeded: no process samples from an engine before its sync is done, and a failed
  sync ends every process's stage.
- close: the others disconnect; the starter's close is answered once they have (the engine never stops under a
  process still sampling).

On a CPU the group shares one engine that runs in one process (the tested twin, tests/test_shared_engine.py); on GPUs
the engine is vLLM over the group's GPUs, which has not run in this project (vLLM's CUDA build cannot be carried to
the lent GPU).
"""

from __future__ import annotations

import time
from typing import Callable

from align.engines import EngineError
from align.engines.base import all_gather_objects as _all_gather, free_cached_memory, release
from align.engines.placement import Placement


def _world() -> tuple[int, int]:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(), dist.get_world_size()


def _waiting_group(timeout_s: float, clients: int):
    """A gloo group of every process of the job for this module's all-gathers, with a deadline past the engine's own
    (its start: 120 s to listen and `timeout_s` to load; a broadcast sync up to 3 x `timeout_s`; a process's last
    generate before a sleep up to `clients` x `timeout_s`, while the others wait): the processes waiting for the
    starter learn of its failure from its EngineError, never from the training group's shorter watchdog (NCCL's 10
    minutes), and these small gathers of Python objects stay off the GPUs."""
    import datetime

    import torch.distributed as dist

    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=(max(clients, 3) + 1) * timeout_s + 240))


def start_shared(placement: Placement, local_rank: int, start: Callable[[int], object],
                 attach: Callable[[dict], object], timeout_s: float = 600.0):
    """This process's engine when `placement` shares it: started here by `start(processes served)` (which returns an
    engine with a `contact` dict) or reached through the starter's contact by `attach(contact)`. A collective every
    process of the job joins. Raises EngineError on every process when any engine failed to start. `timeout_s`: the
    engine's deadline for one call (generation.engine_timeout_s)."""
    rank, world = _world()
    if world == 1:
        raise EngineError(f"generation.tensor_parallel_size: an engine shared by {len(placement.serves)} processes "
                          "needs them launched together (accelerate launch --num_processes); this process is alone")
    node = rank - local_rank  # the job's rank of this node's first process
    group = _waiting_group(timeout_s, len(placement.serves))
    engine, contact, error, failure = None, None, None, None
    if placement.owner:
        try:
            engine = start(len(placement.serves))
            contact = engine.contact
        except Exception as exc:  # told to every process below, then raised here
            error, failure = f"{type(exc).__name__}: {exc}", exc
    everyone = _gather_or_stop((node, placement.engine, rank, contact, error), group, engine)
    _stop_on_failure([(r, e) for _, _, r, _, e in everyone if e], failure if error else None, engine,
                     "process {r}'s rollout engine did not start ({e})")
    owner = node + placement.serves[0]
    if engine is None:
        found = [c for n, e, r, c, _ in everyone if (n, e, r) == (node, placement.engine, owner)]
        try:
            engine = attach(found[0])
        except Exception as exc:  # told to every process below, then raised here
            error, failure = f"{type(exc).__name__}: {exc}", exc
    _stop_on_failure([(r, e) for r, e in _gather_or_stop((rank, error), group, engine) if e],
                     failure if error else None, engine,
                     "process {r} could not reach its rollout engine ({e})")  # every process reached its engine
    return GroupEngine(engine, placement, owner, rank, group)


def start_each(start: Callable[[], object], timeout_s: float = 600.0):
    """This process's own engine (placement not shared), started by `start()`; in a job of several processes, every
    process then learns in one all-gather whether every engine started (a collective every process joins): on a
    failure every process raises, its own or an EngineError naming the first, and an engine started here is stopped,
    rather than the others going on into collectives (ZeRO-3's, a sync's) a failed process never joins and being
    stopped by the launcher as interrupted."""
    rank, world = _world()
    if world == 1:
        return start()
    group = _waiting_group(timeout_s, 1)
    engine, error, failure = None, None, None
    try:
        engine = start()
    except Exception as exc:  # told to every process below, then raised here
        error, failure = f"{type(exc).__name__}: {exc}", exc
    _stop_on_failure([(r, e) for r, e in _gather_or_stop((rank, error), group, engine) if e],
                     failure if error else None, engine, "process {r}'s rollout engine did not start ({e})")
    return engine


def _gather_or_stop(obj, group, engine) -> list:
    """The all-gather of `obj`; when the collective itself fails (a process died), this process's engine, started or
    reached, is let go before the error is raised: nobody else would ever close it."""
    try:
        return _all_gather(obj, group)
    except BaseException:
        if engine is not None:
            engine.close(kill=True)
        raise


def _stop_on_failure(failed: list, failure: BaseException | None, engine, what: str) -> None:
    """After an all-gather told every process of the failures `failed` [(rank, error text)]: nothing when there are
    none; else this process's engine (started or reached) is let go at once (the processes it would wait for are not
    coming) and this process's own failure is raised, or an EngineError naming the first one (`what`: its text)."""
    if not failed:
        return
    if engine is not None:
        engine.close(kill=True)
    if failure is not None:
        raise failure
    r, e = failed[0]
    raise EngineError(what.format(r=r, e=e.splitlines()[0][:300]) + "; every process stops with it")


class GroupEngine:
    """A process's view of an engine it shares (`placement.serves`, started by process `owner` of the job): samples
    through it, syncs it when this process is the starter, and joins every sync of it (module docstring)."""

    holds_own_weights = True

    def __init__(self, engine, placement: Placement, owner: int, rank: int, group=None):
        self.engine, self.placement, self.owner, self.rank, self.group = engine, placement, owner, rank, group
        self.name = engine.name
        self.sync_seconds: list[float] = []
        self.sync_bytes: list[int] = []

    @property
    def log_path(self):
        return self.engine.log_path

    def describe(self) -> dict | None:
        own = self.engine.describe() if self.rank == self.owner else {"name": self.name}
        return {**own, "started_by_process": self.owner, "shared_by_local_ranks": list(self.placement.serves)}

    asleep = ""  # generation.sleep: "all" once asleep, "cache" when a sync woke its weights

    def generate(self, *args, **kwargs):
        self._wake_together("all")
        return self.engine.generate(*args, **kwargs)

    def generate_ids(self, *args, **kwargs):
        self._wake_together("all")
        return self.engine.generate_ids(*args, **kwargs)

    def _wake_together(self, waking: str) -> None:
        """A sync after a sleep wakes the engine's weights (`waking` "weights"), sampling the rest ("all"), on GPUs the
        others compute on: every process gives back its cached memory first (free_cached_memory), and none asks
        before all have (an all-gather: after a sleep, the stages that sleep sync and sample at the same points on
        every process)."""
        if self.asleep:
            free_cached_memory()
            _all_gather(None, self.group)
            self.asleep = "cache" if waking == "weights" else ""
            self.engine.asleep = ""  # done here for every process: the starter's engine need not free again

    def sync_weights(self, model) -> float:
        """The starter syncs the engine; the others join its gathers. Then every process of the job waits for every
        sync and learns whether all succeeded (a failed one: EngineError everywhere)."""
        self._wake_together("weights")
        t0 = time.perf_counter()

        def sync():
            if self.rank == self.owner:
                self.engine.sync_weights(model)
                self.sync_bytes.append(self.engine.sync_bytes[-1])
            else:
                self.engine.join_sync(model)

        self._together(sync, "the weight sync of process {r}'s engine failed ({e})")
        seconds = time.perf_counter() - t0
        self.sync_seconds.append(seconds)
        return seconds

    def release(self) -> None:
        """base.release, on every process at the same point: the starter's engine lets the starter's storages go (it
        maps no other's) and its next sync sends every weight, so every other process forgets its last sync too (its
        next join then takes every weight's gathers, as the starter's sync does: under ZeRO-3 the collectives line
        up); then every process learns whether the starter's succeeded."""
        self._together(lambda: release(self.engine), "process {r}'s engine failed to let the policy go ({e})")

    def sleep(self) -> None:
        """generation.sleep: once every process has sampled (an all-gather: every process calls this at the same
        point), the starter puts the engine to sleep, and every process waits until it sleeps (the memory it frees
        may be on their GPUs) and learns whether it did; it wakes when next asked to sync or sample."""
        if not getattr(self.engine, "sleeps", False):
            return
        _all_gather(None, self.group)
        self._together(lambda: self.engine.sleep() if self.rank == self.owner else None,
                       "process {r}'s engine failed to sleep ({e})")
        self.asleep = "all"

    def _together(self, work: Callable[[], None], what: str) -> None:
        """`work` on this process, then an all-gather in which every process learns whether every process's succeeded:
        this process's own failure is raised, else the first other's as an EngineError (`what`: its text)."""
        error, failure = None, None
        try:
            work()
        except Exception as exc:  # after the all-gather: the others must not wait for this process forever
            error, failure = f"{type(exc).__name__}: {exc}", exc
        failed = [(r, e) for r, e in _all_gather((self.rank, error), self.group) if e]
        if failure is not None:
            raise failure
        if failed:
            r, e = failed[0]
            raise EngineError(what.format(r=r, e=e.splitlines()[0][:300]) + "; every process stops with it")

    def close(self) -> None:
        """Disconnect, or (the starter) stop the engine once the others have disconnected; at once when closing
        because of an error (sys.exc_info): the job is ending, and the others may be waiting in a collective for
        this process rather than disconnecting."""
        import sys

        if self.rank == self.owner and sys.exc_info()[0] is not None:
            self.engine.close(kill=True)
        else:
            self.engine.close()
