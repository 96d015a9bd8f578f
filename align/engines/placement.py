"""Where each training process's rollout engine runs on its node: a pure function of the node's shape (processes,
GPUs, the engine's tensor-parallel size, colocated or not), tested for 1, 2 and 8 GPUs (tests/test_engine_checks.py).

- colocated (the default): the engines share the training GPUs. With tensor_parallel 1 every process has an engine
  on its own GPU (process r: GPU r), holding `memory_fraction` of it; with tensor_parallel t, each group of t
  consecutive processes shares one engine spread over their t GPUs, started by the group's first process.
- separate: the engines get the node's GPUs that training does not use (training takes GPUs 0..P-1), in groups of
  t, each taking 0.9 of its GPUs (vLLM's default); process r is served by engine r mod E (E engines), started by the processes r < E.
- a machine without GPUs: tensor_parallel t groups t consecutive processes on one engine, as colocated, that runs on
  the CPU in one process (the CPU twin of a shared engine: tests/test_shared_engine.py); separate means nothing there.

An engine serving more than its starter (`serves`) is shared across processes: align/engines/group.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Placement:
    devices: tuple[int, ...]  # the node's GPU indices the engine runs on; () on a machine without GPUs
    owner: bool  # this process starts the engine (the first process its engine serves)
    engine: int  # which of the node's engines serves this process
    memory_fraction: float  # of each of its GPUs the engine may take
    serves: tuple[int, ...] = ()  # the local ranks its engine serves (its starter first)
    shared: bool = False  # some engine of the node serves more than one process: every process then goes through
    # align/engines/group.py (its collectives need them all), those alone on an engine included


def place(local_rank: int, local_world: int, gpus: int, tensor_parallel: int = 1, colocate: bool = True,
          memory_fraction: float = 0.3) -> Placement:
    """The placement of process `local_rank` of `local_world` on a node with `gpus` GPUs (ValueError naming the
    setting when the shape cannot hold it)."""
    if not 0 <= local_rank < local_world:
        raise ValueError(f"local rank {local_rank} outside 0..{local_world - 1}")
    if tensor_parallel < 1:
        raise ValueError(f"generation.tensor_parallel_size: {tensor_parallel}; use 1 or more")
    if gpus == 0:  # CPU: groups of tensor_parallel processes, one engine each, on the CPU
        if local_world % tensor_parallel:
            raise ValueError(f"generation.tensor_parallel_size: {tensor_parallel} does not divide the {local_world} "
                             "processes of a node; use a divisor of it")
        engine = local_rank // tensor_parallel
        first = engine * tensor_parallel
        return Placement((), local_rank == first, engine, memory_fraction, tuple(range(first, first + tensor_parallel)),
                         tensor_parallel > 1)
    if colocate:
        if gpus < local_world:
            raise ValueError(f"{local_world} processes on a node with {gpus} GPUs: each process trains on a GPU of "
                             "its own; use --num-processes at most the node's GPUs")
        if local_world % tensor_parallel:
            raise ValueError(f"generation.tensor_parallel_size: {tensor_parallel} does not divide the {local_world} "
                             "processes of a node; use a divisor of it")
        engine = local_rank // tensor_parallel
        first = engine * tensor_parallel
        group = tuple(range(first, first + tensor_parallel))
        return Placement(group, local_rank == first, engine, memory_fraction, group, tensor_parallel > 1)
    spare = gpus - local_world
    if spare < tensor_parallel:
        raise ValueError(f"separate engines need GPUs training does not use: {gpus} GPUs, {local_world} training "
                         f"processes, {spare} left for engines of {tensor_parallel} GPU(s) each; train on fewer "
                         "processes or colocate the engines")
    engines = spare // tensor_parallel
    engine = local_rank % engines
    first = local_world + engine * tensor_parallel
    return Placement(tuple(range(first, first + tensor_parallel)), local_rank < engines, engine, 0.9,  # most of it
                     tuple(range(engine, local_world, engines)), engines < local_world)


def visible_devices(devices: tuple[int, ...], parent: str | None) -> str:
    """CUDA_VISIBLE_DEVICES for an engine on `devices` (indices among the GPUs this process sees), through the
    parent's own CUDA_VISIBLE_DEVICES when it has one ("4,5,6,7" and devices (1,) give "5")."""
    ids = [p.strip() for p in parent.split(",") if p.strip()] if parent else None
    if ids is not None and any(d >= len(ids) for d in devices):
        raise ValueError(f"engine devices {devices} outside CUDA_VISIBLE_DEVICES={parent}")
    return ",".join(ids[d] if ids is not None else str(d) for d in devices)


def node_placement(gen) -> Placement:
    """This process's engine placement, from the launcher's LOCAL_RANK / LOCAL_WORLD_SIZE and the GPUs it sees."""
    import os

    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return place(int(os.environ.get("LOCAL_RANK", 0)), int(os.environ.get("LOCAL_WORLD_SIZE", 1)), gpus,
                 gen.tensor_parallel_size, gen.placement == "colocated", gen.gpu_memory_utilization)
