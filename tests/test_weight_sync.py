"""What a weight sync sends (align/engines/weight_sync.py) and the shared bucket it travels through, without vLLM.

The bucket in /dev/shm is the CPU stand-in for the CUDA IPC one (the same protocol; only the buffer differs): the
trainer's side (Bucket.pieces) is read here by the engine's own code (align/engines/vllm_side: the server opens the
bucket the trainer's message names, the worker's bucket_tensors copies out of it; both import only torch), over a
real shared file and a real pipe, with buckets smaller than the tensors: every tensor must arrive bit for bit. What
only a GPU runs (the CUDA buffer and its handle) is tested here as far as a CPU can: the choice of bucket, and how
the engine finds the trainer's GPU among its own.
"""

from __future__ import annotations

import sys
import threading
from multiprocessing import Pipe
from multiprocessing.reduction import send_handle

import pytest
import torch

from conftest import REPO

from align.engines.buckets import SharedBucket, bucket_kind, cuda_ipc_problem
from align.engines.weight_sync import engine_entries, groups, policy_state_for_engine

SEED = 2718
sys.path.insert(0, str(REPO / "align" / "engines" / "vllm_side"))
import align_vllm_buckets  # noqa: E402  (the engine's side of the bucket)
import align_vllm_server  # noqa: E402  (the engine's process)
import align_vllm_worker  # noqa: E402  (the engine side's reader, by the name vLLM loads it)


def tiny_llama(tie: bool = False):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(SEED)
    print(f"seed {SEED}")
    cfg = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, tie_word_embeddings=tie)
    return LlamaForCausalLM(cfg).eval()


def with_lora(model):
    from peft import LoraConfig, get_peft_model

    peft = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "down_proj"]))
    for n, p in peft.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.05)
    return peft


def test_groups_are_one_per_decoder_layer_and_the_rest():
    g = groups(tiny_llama())  # in state-dict order: the embedding (outside the layers) comes first
    assert len(g) == 4
    assert set(g[0]) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    assert all(k.startswith(f"model.layers.{i}.") for i in range(3) for k in g[i + 1])
    assert all(len(g[i + 1]) == 9 for i in range(3))  # q k v o, gate up down, two norms
    assert len(groups(with_lora(tiny_llama()))) == 4  # under PEFT's prefix alike


def test_gpt2_style_models_sync_a_layer_at_a_time_too():
    """Groups were found by the name `.layers.N.`: GPT-2, GPT-Neo, Falcon, BLOOM and StarCoder name theirs `.h.N.`,
    so the whole model was one group, gathered whole on every GPU under ZeRO-3 at each sync (a review, 2026-12-02)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=3, n_embd=16, n_head=2, n_positions=32, vocab_size=64))
    g = groups(model)
    assert len(g) == 4, [len(x) for x in g]
    assert all(k.startswith(f"transformer.h.{i}.") for i in range(3) for k in g[i + 1])
    assert dict(engine_entries(model)).keys() == {k for k in model.state_dict() if k != "lm_head.weight"}


def test_full_entries_are_the_checkpoint_and_a_tied_head_is_left_out():
    for tie in (False, True):
        model = tiny_llama(tie)
        state = dict(engine_entries(model))
        expected = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
        assert set(state) == set(expected)
        assert all(torch.equal(state[k], expected[k]) for k in expected)


def test_after_the_first_sync_only_what_trains_is_sent():
    model = tiny_llama()
    peft = with_lora(model)
    full = policy_state_for_engine(peft)
    changed = dict(engine_entries(peft, changed_only=True))
    # LoRA: the adapted layers' merged weights and nothing else (the base is frozen, already in the engine)
    assert sorted(changed) == sorted(f"model.layers.{i}.{m}.weight" for i in range(3)
                                     for m in ("self_attn.q_proj", "mlp.down_proj"))
    merged = peft.merge_and_unload().state_dict()
    for k, v in changed.items():
        assert torch.allclose(v, merged[k], atol=1e-6) and torch.equal(v, full[k])
    # full fine-tuning: everything trains; frozen parameters are not sent again
    plain = tiny_llama()
    assert set(dict(engine_entries(plain, changed_only=True))) == set(plain.state_dict())
    plain.model.embed_tokens.weight.requires_grad_(False)
    assert "model.embed_tokens.weight" not in dict(engine_entries(plain, changed_only=True))


def read_all(bucket_tensor, conn, out: dict, errors: list):
    try:
        for name, tensor in align_vllm_worker.bucket_tensors(conn, bucket_tensor):
            out[name] = tensor
    except Exception as exc:  # reported to the test
        errors.append(exc)


@pytest.mark.parametrize("size", [7, 1000, 1 << 20])
def test_the_shared_bucket_carries_every_tensor_bit_for_bit(tmp_path, size):
    """Tensors of several dtypes, one empty and one 0-d, through buckets smaller than most tensors (7 bytes), larger
    than some (1,000) and larger than all: the reader's tensors equal the sent ones exactly, and the bytes moved are
    the tensors' bytes."""
    g = torch.Generator().manual_seed(SEED)
    print(f"seed {SEED}")
    sent = {"a": torch.randn(33, 17, generator=g), "b": torch.randn(5, generator=g).to(torch.bfloat16),
            "empty": torch.zeros(0, 4), "scalar": torch.tensor(3.5, dtype=torch.float16),
            "big": torch.randn(300, generator=g).to(torch.float64), "ints": torch.arange(11)}
    bucket = SharedBucket(str(tmp_path / "bucket"), size)
    reader_view = align_vllm_buckets.bucket({**bucket.where(), "size": size})  # the engine's own mapping of it
    assert bucket.kind == "shared_memory" and reader_view.numel() == size
    trainer, engine = Pipe()
    got, errors = {}, []
    t = threading.Thread(target=read_all, args=(reader_view, engine, got, errors))
    t.start()
    chunks = 0
    for pieces, last in bucket.pieces(sent.items()):
        trainer.send({"op": "chunk", "pieces": pieces, "last": last})
        assert trainer.recv() == {"ok": True, "op": "chunk"}  # copied out: the bucket may be filled again
        chunks += 1
    t.join(30)
    assert not errors, errors
    assert list(got) == list(sent)
    for k, v in sent.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and torch.equal(got[k], v), k
    assert bucket.sent_bytes == sum(v.numel() * v.element_size() for v in sent.values())
    assert chunks >= -(-bucket.sent_bytes // size)
    bucket.close()
    assert not (tmp_path / "bucket").exists()


def test_in_place_chunks_are_views_of_the_bucket_and_acknowledged_only_after_they_are_consumed(tmp_path):
    """stream_chunks (the in-place load's reader): a tensor that lies whole and aligned in one bucket comes as a view of
    the bucket (no copy out), one in pieces or misaligned as a tensor of its own; the trainer hears that it may refill the bucket only after
    the consumer returned, so a view is never overwritten while it is read."""
    g = torch.Generator().manual_seed(SEED)
    print(f"seed {SEED}")
    sent = {"small": torch.randn(3, 4, generator=g), "half": torch.randn(7, generator=g).to(torch.bfloat16),
            "large": torch.randn(40, generator=g), "tail": torch.randn(2, generator=g)}
    size = 64  # small (48 bytes) and half (14) fit, large (160) travels in pieces, tail lands whole but at byte 30
    #            of its bucket: a float32 view there would be misaligned, so it is copied like a piece
    bucket = SharedBucket(str(tmp_path / "bucket"), size)
    reader_view = align_vllm_buckets.bucket({**bucket.where(), "size": size})
    lo = reader_view.data_ptr()
    trainer, engine = Pipe()
    got, kinds, early_acks, errors = {}, {}, [], []

    def consume(items):
        early_acks.append(trainer.poll())  # an acknowledgement already waiting would let the trainer refill
        for name, t in items:
            kinds[name] = "view" if lo <= t.data_ptr() < lo + size else "own"
            got[name] = t.clone()

    def reader():
        try:
            align_vllm_worker.stream_chunks(engine, reader_view, consume)
        except Exception as exc:
            errors.append(exc)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    for pieces, last in bucket.pieces(sent.items()):
        trainer.send({"op": "chunk", "pieces": pieces, "last": last})
        assert trainer.recv() == {"ok": True, "op": "chunk"}
    t.join(30)
    assert not errors, errors
    assert early_acks and not any(early_acks)
    assert kinds == {"small": "view", "half": "view", "large": "own", "tail": "own"}
    for k, v in sent.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    bucket.close()


class _Method:
    """A stand-in for vLLM's quant method: records which layers were processed after loading."""

    def __init__(self, calls: list):
        self.calls = calls

    def process_weights_after_loading(self, layer):
        self.calls.append(layer.tag)


def test_load_in_place_processes_exactly_the_layers_whose_weights_were_loaded():
    """load_in_place: every chunk goes through the model's load_weights; afterwards each layer owning a loaded
    parameter is processed again (on a CPU: packed), a tied head with it (it shares the embedding's parameter), and
    no other layer."""
    calls: list[str] = []
    model = torch.nn.Module()
    for tag in ("embed", "a", "b"):
        layer = torch.nn.Linear(2, 2, bias=False)
        layer.tag, layer.quant_method = tag, _Method(calls)
        setattr(model, tag, layer)
    head = torch.nn.Module()
    head.weight, head.tag, head.quant_method = model.embed.weight, "head", _Method(calls)
    model.head = head
    batches = []

    def load_weights(items):
        batches.append([n for n, _ in items])
        with torch.no_grad():
            for name, t in items:
                model.get_parameter(name).copy_(t)
        return {n for n, _ in items}

    model.load_weights = load_weights
    owners: dict[int, list] = {}  # as _owners builds it (that needs vLLM's classes): every layer with a quant method
    for m in model.modules():
        if hasattr(m, "quant_method"):
            for q in m._parameters.values():
                owners.setdefault(id(q), []).append(m)
    new = {"embed.weight": torch.full((2, 2), 3.0), "b.weight": torch.full((2, 2), 5.0)}
    received, _ = align_vllm_worker.load_in_place(
        model, lambda consume: [consume([item]) for item in new.items()], owners)
    assert received == 2 and batches == [["embed.weight"], ["b.weight"]]
    assert sorted(calls) == ["b", "embed", "head"]
    assert torch.equal(model.head.weight, new["embed.weight"]) and torch.equal(model.b.weight, new["b.weight"])


def test_owners_packs_a_tied_head_instead_of_its_embedding_and_keeps_an_embedding_that_is_the_head():
    """_owners: a parameter shared by an input embedding and a head (tied) is processed through the head alone (the
    embedding's packed copy serves nothing); an embedding no head shares is kept (Gemma 2 computes its logits with
    it); layers without a quant method are never processed."""
    class Embedding(torch.nn.Module):  # stands in for vLLM's VocabParallelEmbedding
        def __init__(self):
            super().__init__()
            self.weight, self.quant_method = torch.nn.Parameter(torch.zeros(4, 2)), object()

    class Head(Embedding):  # stands in for ParallelLMHead, its subclass
        pass

    tied = torch.nn.Module()
    tied.embed, tied.head, tied.norm = Embedding(), Head(), torch.nn.LayerNorm(2)
    tied.head.weight = tied.embed.weight
    owners = align_vllm_worker._owners(tied, embedding_class=Embedding)
    assert owners == {id(tied.embed.weight): [tied.head]}
    alone = torch.nn.Module()
    alone.embed = Embedding()
    assert align_vllm_worker._owners(alone, embedding_class=Embedding) == {id(alone.embed.weight): [alone.embed]}


def test_a_stream_that_ends_with_a_tensor_incomplete_is_an_error(tmp_path):
    bucket = SharedBucket(str(tmp_path / "bucket"), 64)
    trainer, engine = Pipe()
    got, errors = {}, []
    t = threading.Thread(target=read_all, args=(bucket.buffer, engine, got, errors))
    t.start()
    pieces, _ = next(bucket.pieces([("w", torch.ones(100))]))  # the first 64 of 400 bytes
    trainer.send({"op": "chunk", "pieces": pieces, "last": True})
    trainer.recv()
    t.join(30)
    assert errors and "incomplete" in str(errors[0]) and "'w'" in str(errors[0])
    bucket.close()


def test_the_bucket_is_on_the_trainers_gpu_only_when_the_engine_runs_there():
    """CUDA IPC where the weights are on a GPU the engine runs on (colocated: process r, GPU r) and the setting is
    `shared`; host shared memory on a CPU, for an engine on other GPUs, or with `host`."""
    cuda = torch.device("cuda", 1)  # a device object only: nothing is allocated
    assert bucket_kind(cuda, (1,)) == "cuda_ipc"
    assert bucket_kind(cuda, (0, 1)) == "cuda_ipc"  # a tensor-parallel engine that spans the trainer's GPU
    assert bucket_kind(cuda, (4,)) == "shared_memory"  # an engine on a GPU of its own
    assert bucket_kind(cuda, (1,), "host") == "shared_memory"
    assert bucket_kind(torch.device("cpu"), ()) == "shared_memory"
    # broadcast: to an engine on GPUs of its own, and on a CPU (gloo); an engine on the trainer's own GPU takes the
    # CUDA IPC bucket instead (NCCL refuses a group of two ranks on one GPU)
    assert bucket_kind(cuda, (4,), "broadcast") == "broadcast" and bucket_kind(torch.device("cpu"), (), "broadcast") \
        == "broadcast"
    assert bucket_kind(cuda, (1,), "broadcast") == "cuda_ipc"


def test_the_engine_opens_the_trainers_gpu_under_its_own_index(monkeypatch):
    """The CUDA IPC handle names the trainer's GPU by UUID: the engine (which sees GPUs through its own
    CUDA_VISIBLE_DEVICES) rebuilds the buffer on its index of that GPU, the one field of torch's rebuild arguments
    that changes; a GPU it cannot see is an error naming the setting that avoids CUDA IPC."""
    args = ["Tensor", (32,), (1,), 0, "UntypedStorage", "uint8", 3, b"handle", 32, 0, False, b"ref", 0, b"ev", True]
    moved = align_vllm_buckets.on_device(args, 0)
    assert moved[align_vllm_buckets.STORAGE_DEVICE] == 0 and args[6] == 3  # the trainer's index 3, the engine's 0
    assert [a for i, a in enumerate(moved) if i != 6] == [a for i, a in enumerate(args) if i != 6]
    assert align_vllm_buckets.local_gpu("GPU-b", ["GPU-a", "GPU-b"]) == 1
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")
    with pytest.raises(RuntimeError, match="CUDA_VISIBLE_DEVICES='5'.*generation.weight_sync: host"):
        align_vllm_buckets.local_gpu("GPU-c", ["GPU-a"])


def test_cuda_ipc_is_used_only_where_the_engine_can_open_the_handle():
    """torch's CUDA IPC handle format changes between minor versions and expandable segments need pidfd_getfd: in
    either case the sync goes through /dev/shm (the reason recorded), never a handle the engine cannot open."""
    assert cuda_ipc_problem("2.13.0+cu128", "2.13.1+cu126", "") is None  # patch releases and builds agree
    assert "2.12.0" in cuda_ipc_problem("2.13.0", "2.12.0", "")
    assert "is not the trainer's" in cuda_ipc_problem("2.13.0", None, "")
    assert "expandable segments" in cuda_ipc_problem("2.13.0", "2.13.0", "max_split_size_mb:64, expandable_segments:True")
    assert cuda_ipc_problem("2.13.0", "2.13.0", "expandable_segments:False") is None


@pytest.fixture
def engine_maps():
    """The engine side's mappings of the trainer's storages (align_vllm_worker.HOST), empty before and after."""
    align_vllm_worker.HOST.clear()
    yield align_vllm_worker.HOST
    align_vllm_worker.HOST.clear()


def host_sync(model, held: dict, bucket: SharedBucket, engine_end, trainer_end, shares: bool = True,
              space=lambda n: None, budget: int = 1000, changed_only: bool = False):
    """One streamed sync as VLLMEngine._sync_shared runs it (its `chunk_messages`; weight_sync: shared, or host when
    not `shares`), read by the engine's own stream_chunks in a thread: what the engine got (as clones) and whether each
    lay in a mapping of the trainer's memory (a view, not a copy), the HostTensors used, the names that went through
    the bucket."""
    from align.engines.buckets import chunk_messages
    from align.engines.weight_sync import HostTensors

    host = HostTensors(held, space, budget)
    got, viewed, errors = {}, {}, []

    def consume(items):
        maps = [(m.data_ptr(), m.data_ptr() + m.numel()) for m in align_vllm_worker.HOST.values()]
        for name, t in items:
            got[name] = t.clone()
            viewed[name] = any(lo <= t.data_ptr() < hi for lo, hi in maps)

    def reader():
        try:
            align_vllm_worker.stream_chunks(engine_end, bucket.buffer, consume)
        except Exception as exc:
            errors.append(exc)

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    through_bucket = []
    for msg, fds, _ in chunk_messages(bucket, model, engine_entries(model, changed_only=changed_only),
                                      host if shares else None):
        through_bucket += [p[0] for p in msg["pieces"] if p[4] + p[6] == p[3]]
        trainer_end.send(msg)
        for fd in fds:
            send_handle(trainer_end, fd, 0)
        assert trainer_end.recv() == {"ok": True, "op": "chunk"}
    t.join(30)
    assert not errors, errors
    assert all(viewed[r[0]] for r in host.refs) and not any(viewed[n] for n in through_bucket)
    return got, host, through_bucket


def test_weights_in_host_memory_are_read_where_they_lie_and_follow_the_optimiser(tmp_path, engine_maps):
    """weight_sync: shared on a CPU (HostTensors + the worker's host_views): every weight of a plain model reaches the
    engine without the bucket, as a view of the trainer's memory, its storage moved into shared memory in place (the
    values and the parameter objects unchanged, so an optimiser holding them goes on working) and mapped by the engine
    once: the next sync, after an optimiser step, sends no new file descriptor and the engine reads the new values. A
    sync through the bucket alone (weight_sync: host) in between leaves the mappings alone, and a parameter whose
    storage was replaced is shared anew while the one it replaced is let go on both sides."""
    model = tiny_llama(tie=True)
    before = {k: v.clone() for k, v in engine_entries(model)}
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    bucket = SharedBucket(str(tmp_path / "bucket"), 256)
    trainer, engine = Pipe()
    held: dict = {}
    got, host, through = host_sync(model, held, bucket, engine, trainer)
    assert through == [] and not host.problem and len(host.refs) == len(before) == len(host.new) == len(held)
    assert all(p.is_shared() for p in params) and list(model.parameters()) == params
    assert all(torch.equal(got[k], v) for k, v in before.items())
    assert set(engine_maps) == set(host.files)
    mapped = dict(engine_maps)

    sum(p.sum() for p in params).backward()
    opt.step()
    got, host, _ = host_sync(model, held, bucket, engine, trainer)
    assert host.new == [] and dict(engine_maps) == mapped  # nothing opened again
    assert all(torch.equal(got[k], v) and not torch.equal(v, before[k]) for k, v in engine_entries(model))

    got, host, through = host_sync(model, held, bucket, engine, trainer, shares=False)
    assert len(through) == len(before) and host.refs == [] and dict(engine_maps) == mapped

    norm = model.model.norm.weight
    old = norm.untyped_storage().data_ptr()
    norm.data = norm.data.clone() + 1  # a storage of its own, not shared yet
    got, host, _ = host_sync(model, held, bucket, engine, trainer)
    assert len(host.new) == 1 and torch.equal(got["model.norm.weight"], norm.detach())
    assert len(engine_maps) == len(mapped) == len(held) and set(engine_maps) != set(mapped) and old not in held

    for n, p in model.named_parameters():  # what trains: the final norm alone; the others are let go on both sides
        p.requires_grad_(n == "model.norm.weight")
    got, host, _ = host_sync(model, held, bucket, engine, trainer, changed_only=True)
    assert list(got) == ["model.norm.weight"] and len(engine_maps) == len(held) == 1 and host.new == []
    bucket.close()


def test_parameters_that_are_views_of_one_flat_buffer_are_read_at_their_offsets(tmp_path, engine_maps):
    """As under DeepSpeed ZeRO-1/2, where every parameter is a view of one flat buffer: the buffer is moved into shared
    memory once (one descriptor), each weight read at its own offset, before and after an in-place update of the
    flat buffer (the optimiser's step there)."""
    model = tiny_llama()
    params = list(model.parameters())
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    at = 0
    for p in params:
        p.data = flat[at:at + p.numel()].view_as(p)
        at += p.numel()
    bucket = SharedBucket(str(tmp_path / "bucket"), 256)
    trainer, engine = Pipe()
    held: dict = {}
    for step in range(2):
        if step:
            flat.add_(0.5)
        state = {k: v.clone() for k, v in engine_entries(model)}
        got, host, through = host_sync(model, held, bucket, engine, trainer)
        assert through == [] and len(host.files) == 1 and len(host.new) == (0 if step else 1)
        assert len({r[4] for r in host.refs}) == len(host.refs) > 1  # every weight at an offset of its own
        assert all(torch.equal(got[k], v) for k, v in state.items())
    assert flat.is_shared() and params[0].untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    bucket.close()


def test_computed_partitioned_and_unsharable_weights_go_through_the_bucket(tmp_path, engine_maps):
    """A LoRA layer's merged weight is computed (W + BA): the bucket; the frozen weights around it are read where they
    lie. A ZeRO-3-partitioned parameter (ds_id) is never shared, nor a non-contiguous view, nor a storage mapped from
    a file (no descriptor to pass). With no room in /dev/shm nothing is moved: every weight goes through the bucket
    and the reason is kept."""
    from align.engines.weight_sync import HostTensors

    peft = with_lora(tiny_llama())
    bucket = SharedBucket(str(tmp_path / "bucket"), 4096)
    trainer, engine = Pipe()
    state = dict(engine_entries(peft))
    got, host, through = host_sync(peft, {}, bucket, engine, trainer)
    merged = {k for k in state if ".q_proj." in k or ".down_proj." in k}
    assert set(through) == merged and {r[0] for r in host.refs} == set(state) - merged
    assert all(torch.equal(got[k], v) for k, v in state.items())

    plain = tiny_llama()
    plain.model.norm.weight.ds_id = 7  # gathered under ZeRO-3 while it is sent: a copy that goes away after
    filed = torch.from_file(str(tmp_path / "w"), shared=True, size=32 * 32)
    plain.model.layers[0].input_layernorm.weight.data = filed[:32]
    host = HostTensors({}, lambda n: None)
    entries = [("model.norm.weight", plain.model.norm.weight.detach()), ("lm_head.weight", plain.lm_head.weight.t()),
               ("ln", plain.model.layers[0].input_layernorm.weight.detach())]
    assert [n for n, _ in host.split(plain, entries)] == ["model.norm.weight", "lm_head.weight", "ln"]
    assert host.refs == [] and not plain.model.norm.weight.is_shared() and not host.problem

    fresh = tiny_llama()
    got, host, through = host_sync(fresh, {}, bucket, engine, trainer, space=lambda n: "no room (a test)")
    assert host.problem == "no room (a test)" and host.refs == [] and len(through) == len(state)
    assert not any(p.is_shared() for p in fresh.parameters())
    bucket.close()


def test_sharing_stays_within_the_open_file_budget_sync_after_sync(tmp_path, engine_maps):
    """Each storage moved into shared memory keeps a file descriptor open on each side: at most `budget` are held,
    however many syncs follow (the budget does not shrink as descriptors stay open); the rest goes through the bucket
    and the reason is kept."""
    model = tiny_llama()
    bucket = SharedBucket(str(tmp_path / "bucket"), 4096)
    trainer, engine = Pipe()
    held: dict = {}
    opened = []
    for _ in range(4):
        state = {k: v.clone() for k, v in engine_entries(model)}
        got, host, through = host_sync(model, held, bucket, engine, trainer, budget=3)
        opened.append(len(host.new))
        assert len(held) == len(engine_maps) == len(host.refs) == 3 and "open-file budget" in host.problem
        assert len(host.refs) + len(through) == len(state) and all(torch.equal(got[k], v) for k, v in state.items())
    assert opened == [3, 0, 0, 0]
    bucket.close()


def test_a_bucket_the_engine_cannot_open_is_answered_as_unopened_and_nothing_is_loaded(tmp_path):
    """The engine's answer when a stream's bucket will not open (a CUDA IPC handle it cannot map; here a /dev/shm
    file that is gone): an error marked `unopened`, before anything reaches vLLM (no llm is given: a call to it
    would fail otherwise), so the trainer sends the sync again through /dev/shm (vllm_sync.BucketSync)."""
    _, engine_end = Pipe()
    reply = align_vllm_server.handle(None, engine_end, {"op": "stream", "path": str(tmp_path / "gone"), "size": 16})
    assert reply["ok"] is False and reply["unopened"] is True and "FileNotFoundError" in reply["error"]
    path = tmp_path / "bucket"
    path.write_bytes(bytes(16))
    opened = align_vllm_server.handle(None, engine_end, {"op": "stream", "path": str(path), "size": 16})
    assert "unopened" not in opened and "AttributeError" in opened["error"]  # opened, it went on to vLLM (None)


def test_a_dropped_chunk_leaves_no_descriptor_in_the_connection(tmp_path):
    """A stream that failed on the engine's side before it read its last chunk (the bucket would not open, say): the
    trainer had already sent that chunk and passed the descriptors of its weights after it. The engine drops the
    chunk and reads the descriptors too, so the next request (the close) is read whole; before, its bytes were read
    from the middle of theirs and the engine waited for a message that never came."""
    import os

    trainer_end, engine_end = Pipe()
    files = [open(tmp_path / f"w{i}", "wb") for i in range(2)]
    chunk = {"op": "chunk", "last": True, "pieces": [], "refs": [], "files": {1: 8, 2: 8}, "new": [1, 2]}
    trainer_end.send(chunk)
    for f in files:
        send_handle(trainer_end, f.fileno(), 0)
    trainer_end.send({"op": "close"})
    got, opened = [], len(os.listdir("/proc/self/fd"))
    assert align_vllm_server.handle(None, engine_end, engine_end.recv()) is None
    t = threading.Thread(target=lambda: got.append(engine_end.recv()), daemon=True)
    t.start()
    t.join(10)
    assert got == [{"op": "close"}]
    assert len(os.listdir("/proc/self/fd")) <= opened  # the descriptors read were closed, not kept
    for f in files:
        f.close()


def test_a_bucket_made_again_at_the_same_path_is_opened_again(tmp_path):
    """The engine opens the trainer's bucket once and keeps it while the trainer names the same one; a bucket the
    trainer made again at the same path and size (after CUDA IPC failed, say) is another file: the engine maps the
    new one, not the unlinked file it had (whose old bytes it would have loaded as the new weights)."""
    import os

    path = tmp_path / "bucket"
    msg = {"op": "stream", "path": str(path), "size": 16}
    path.write_bytes(bytes(range(16)))
    first = align_vllm_buckets.bucket(msg)
    assert align_vllm_buckets.bucket(msg) is first and first[3].item() == 3  # kept while it is the same file
    os.unlink(path)
    path.write_bytes(bytes([7] * 16))
    again = align_vllm_buckets.bucket(msg)
    assert again is not first and again.tolist() == [7] * 16
    align_vllm_buckets._BUCKETS.clear()


def test_a_malloc_setting_glibc_refuses_leaves_every_other_unchanged(monkeypatch):
    """keep_freed_memory sets glibc's mmap threshold, trim threshold and top pad; glibc refuses only the first (past
    half its largest heap), so it is asked first: a refusal then changes nothing (the trim threshold and pad alone,
    with the dynamic threshold off, are the state the guard exists to avoid), and the answer is False."""
    import ctypes

    asked = []

    class Libc:
        def mallopt(self, option, value):
            asked.append(option)
            return 0 if option == -3 else 1  # M_MMAP_THRESHOLD refused

        malloc = free = None

    monkeypatch.setattr(ctypes, "CDLL", lambda name: Libc())
    monkeypatch.setattr(align_vllm_worker.os, "environ", {})
    monkeypatch.setattr(align_vllm_worker.resource, "getrlimit", lambda r: (align_vllm_worker.resource.RLIM_INFINITY,) * 2)
    assert align_vllm_worker.keep_freed_memory() is False and asked == [-3]


def test_a_dropped_chunk_whose_descriptors_never_came_ends_the_engine():
    """The rest of a stream that failed is dropped without a reply (its error was the stream's): descriptors that
    never arrived (multiprocessing's recvfds raises RuntimeError on missing ancillary data, a byte of the next message
    already read) must neither turn into an {"ok": False} reply the trainer would read as the answer to its next
    request nor leave the engine reading what follows out of step: the engine stops, saying why."""
    import socket

    from multiprocessing.connection import Connection

    a, b = socket.socketpair()
    try:
        sender, receiver = Connection(a.detach()), Connection(b.detach())
        sender.send_bytes(b"x")  # a message without the descriptors the chunk promised
        msg = {"op": "chunk", "last": True, "files": {1: 8}, "new": [1]}
        with pytest.raises(SystemExit, match="descriptors never came"):
            align_vllm_worker.drop_handles(receiver, msg)
        assert align_vllm_worker.drop_handles(receiver, {"op": "chunk", "last": False}) is None  # none promised
    finally:
        for c in (sender, receiver):
            c.close()


def test_the_cpu_engine_repacks_a_tied_head_whatever_its_embedding_is_called(monkeypatch):
    """vLLM on CPU prepacks linear weights; a reload leaves a tied head's pack stale (log-probs off by up to 2.56
    nats, ../shared/notes/vllm-cpu.md). The worker re-packed it only when a loaded name held "embed": GPT-2's
    `transformer.wte` never was (a review, 2026-12-02). It goes by the tie itself now, and skips a sync of layer
    weights alone (LoRA's) and an untied head."""
    import sys
    import types
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "align" / "engines" / "vllm_side"))
    import align_vllm_worker

    packed: list = []
    utils = types.ModuleType("vllm.model_executor.layers.utils")
    utils.dispatch_cpu_unquantized_gemm = lambda layer, remove_weight: packed.append(layer)
    for name in ("vllm", "vllm.model_executor", "vllm.model_executor.layers"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "vllm.model_executor.layers.utils", utils)

    def engine(tie: bool):
        model = torch.nn.Module()
        model.transformer = torch.nn.Module()
        model.transformer.wte = torch.nn.Embedding(8, 4)
        model.transformer.h = torch.nn.ModuleList([torch.nn.Linear(4, 4)])
        model.lm_head = torch.nn.Linear(4, 8, bias=False)
        if tie:
            model.lm_head.weight = model.transformer.wte.weight
        sync = object.__new__(align_vllm_worker.WeightSync)
        sync.reload_weights = lambda weights_iterator, is_checkpoint_format: list(weights_iterator)
        sync.model_runner = types.SimpleNamespace(get_model=lambda: model)
        return sync, model

    sync, model = engine(tie=True)
    assert sync._align_load([("transformer.wte.weight", torch.zeros(8, 4)), ("transformer.h.0.weight", None)],
                            partial=False) == 2
    assert packed == [model.lm_head]
    packed.clear()
    sync._align_load([("transformer.h.0.weight", None)], partial=True)  # the layers alone: the head is as it was
    assert packed == []
    sync, model = engine(tie=False)
    sync._align_load([("transformer.wte.weight", None), ("lm_head.weight", None)], partial=False)
    assert packed == []  # an untied head is loaded and packed by the reload itself


def test_a_mixtral_policy_is_synced_under_its_checkpoints_names(tmp_path):
    """transformers 5 fuses Mixtral's experts as it loads them (`mlp.experts.gate_up_proj` in memory,
    `block_sparse_moe.experts.N.w1` on disk) and converts them back in save_pretrained; the sync sent memory's names,
    which vLLM's loader (started from the saved directory) does not know, so the first sync failed (a review,
    2026-12-02). Each group is converted back as save_pretrained converts it; a node bucket, which sends the
    partitions in memory's layout, is refused for such a model."""
    from safetensors.torch import load_file
    from transformers import MixtralConfig, MixtralForCausalLM

    from align.engines import node_bucket
    from align.engines.weight_sync import converts_weights

    torch.manual_seed(0)
    print("seed 0")
    model = MixtralForCausalLM(MixtralConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                             num_attention_heads=2, num_key_value_heads=2, num_local_experts=3,
                                             num_experts_per_tok=2, tie_word_embeddings=False))
    model.save_pretrained(tmp_path)
    disk = load_file(tmp_path / "model.safetensors")
    sent = dict(engine_entries(model))
    assert "model.layers.0.block_sparse_moe.experts.2.w3.weight" in disk and set(sent) == set(disk)
    assert all(torch.equal(sent[k], disk[k]) for k in disk)
    assert converts_weights(model) and not converts_weights(tiny_llama())
    assert dict(engine_entries(tiny_llama())).keys() == tiny_llama().state_dict().keys()  # as it was: no conversion
    assert "converts its weights" in (node_bucket_problem := _bucket_problem(model, node_bucket)), node_bucket_problem


def _bucket_problem(model, node_bucket) -> str:
    """node_bucket.problem(model) as two processes of ZeRO-3 on one node see it (the checks before the partitions')."""
    from unittest import mock

    for p in model.parameters():
        p.ds_id = 0
    try:
        with mock.patch("torch.distributed.is_initialized", return_value=True), \
                mock.patch("torch.distributed.get_world_size", return_value=2):
            return node_bucket.problem(model) or ""
    finally:
        for p in model.parameters():
            del p.ds_id


def test_a_lora_sync_of_part_of_a_fused_checkpoint_tensor_sends_it_whole():
    """A family whose checkpoint fuses q, k and v in one tensor (sarvam_moe's `query_key_value`, split as it loads),
    trained with LoRA on q and v: every sync after the first sent the fused tensor rebuilt from the trained parts
    alone, (96, 64) under the name of a (128, 64) tensor (a review of the day's diff, 2026-12-02). The group goes
    whole where its trained part alone would convert to other shapes; a family that fuses nothing across them
    (Llama) still sends its trained weights alone."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    print("seed 0")
    cfg = AutoConfig.for_model("sarvam_moe", hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, vocab_size=128, moe_intermediate_size=32,
                               num_experts=4, head_dim=16)
    model = AutoModelForCausalLM.from_config(cfg)
    full = {k: tuple(v.shape) for k, v in engine_entries(model)}
    peft = with_lora(model)
    changed = {k: tuple(v.shape) for k, v in engine_entries(peft, changed_only=True)}
    fused = [k for k in changed if "query_key_value" in k]
    assert fused and all(changed[k] == full[k] == (128, 64) for k in fused), changed
    llama = with_lora(tiny_llama())
    assert all(k.endswith(("q_proj.weight", "down_proj.weight")) for k, _ in engine_entries(llama, changed_only=True))
