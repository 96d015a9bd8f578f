"""One process of a two-process job (gloo) exercising align/engines/group.py with stand-in engines: `python
shared_engine_probe.py RANK STORE SCENARIO OUT`; writes what happened to OUT (JSON). Scenarios: ok (process 0 starts
the engine, process 1 reaches it by its contact, both sample and sync), start_fails (process 0's start raises),
sync_fails (process 0's sync raises), join_fails (process 1's part of a sync raises), attach_fails
(process 1 cannot reach the engine), sleep_fails (process 0's engine fails to go to sleep: generation.sleep),
release_fails (process 0's engine fails to let the policy go: evaluate's base.release); own_ok and own_start_fails
(every process starts an engine of its own, group.start_each: process 1's start fails in the second)."""

from __future__ import annotations

import json
import os
import sys
import time

import torch.distributed as dist

from align.engines import group
from align.engines.group import start_shared
from align.engines.placement import place


class StandIn:
    name = "stand_in"
    sleeps = True  # generation.sleep

    def __init__(self, role: str, scenario: str, contact=None):
        self.role, self.scenario, self.log_path = role, scenario, f"/tmp/{role}.log"
        self.contact = contact or {"address": "engine-of-process-0", "pid": os.getpid()}
        self.calls: list[str] = []
        self.sync_bytes: list[int] = []

    def generate(self, prompts, *args, **kwargs):
        self.calls.append(f"generate {len(prompts)}")
        return [f"{self.role}:{p}" for p in prompts]

    def sync_weights(self, model):
        self.calls.append("sync")
        self.sync_at = time.time()
        if self.scenario == "sync_fails":
            raise RuntimeError("bucket mapping failed")
        self.sync_bytes.append(123)

    def join_sync(self, model):
        self.calls.append("join")
        if self.scenario == "join_fails":
            raise RuntimeError("gather failed")

    def sleep(self):
        self.calls.append("sleep")
        if self.scenario == "sleep_fails":
            raise RuntimeError("cuMemUnmap failed")

    def release(self):
        self.calls.append("release")
        if self.scenario == "release_fails" and self.role == "owner":
            raise RuntimeError("engine lost the mapping")

    def describe(self):
        return {"name": self.name, "pid": self.contact["pid"]}

    def close(self, kill: bool = False):
        self.calls.append("kill" if kill else "close")


def main(rank: int, store: str, scenario: str, out: str) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    placement = place(rank, 2, 0, tensor_parallel=2)  # a CPU node: both processes on one engine
    result: dict = {"owner": placement.owner, "serves": list(placement.serves)}

    started: list[StandIn] = []

    def start(clients: int):
        result["clients"] = clients
        if scenario == "start_fails":
            raise RuntimeError("engine ran out of memory")
        started.append(StandIn("owner", scenario))
        return started[0]

    def attach(contact: dict):
        result["attached_to"] = contact
        if scenario == "attach_fails":
            raise ConnectionRefusedError("engine socket refused the connection")
        return StandIn("client", scenario, contact)

    engine = None
    # before the engine wakes from its sleep, every process gives back its cached GPU memory: recorded in its calls

    def free():
        engine.engine.calls.append("free")
        result.setdefault("free_at", []).append(time.time())

    group.free_cached_memory = free
    if scenario.startswith("own_"):  # every process its own engine (group.start_each); process 1's fails to start
        def own():
            if scenario == "own_start_fails" and rank == 1:
                raise RuntimeError("CUDA out of memory on GPU 1")
            started.append(StandIn("owner", scenario))
            return started[0]

        try:
            result["sampled"] = group.start_each(own).generate([f"p{rank}"])
        except Exception as exc:
            result["error"] = f"{type(exc).__name__}: {exc}"
        result["started_calls"] = started[0].calls if started else None
        with open(out, "w") as f:
            json.dump(result, f)
        dist.destroy_process_group()
        return
    try:
        engine = start_shared(placement, rank, start, attach)
        result["sampled"] = engine.generate([f"p{rank}"])
        result["described"] = engine.describe()
        engine.sleep()
        if rank == 1:  # late to the sync after the sleep: the starter's sync must wait until this process freed
            time.sleep(1.0)
        engine.sync_weights(model=None)
        result["syncs"] = len(engine.sync_seconds)
        result["sampled_after_sync"] = engine.generate([f"q{rank}"])
        result["sync_at"] = getattr(engine.engine, "sync_at", None)
        engine.release()  # every process at the same point, as evaluate lets each policy go
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        if scenario in ("sync_fails", "sleep_fails", "release_fails") and engine is not None:  # closing because of the error: the starter kills
            engine.close()
            result["calls"] = engine.engine.calls
            engine = None
    if engine is not None:
        engine.close()
        result["calls"] = engine.engine.calls
    if started:
        result["started_calls"] = started[0].calls
    with open(out, "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4])
