"""PPO's rollout and scoring in chunks (align/stages/ppo/rollouts.py): the hf engine samples generation.batch_size
prompts per call and the chunks are joined (concat_rollouts), and the policy, value and reference score a
mini-batch of rows at a time, each giving what one call over the whole batch gives."""

from __future__ import annotations

import contextlib
import math
from types import SimpleNamespace

import torch

from families import RESPONSES, TEXTS, _rollout, build

SEED = 31


class _Recording:
    """An engine stand-in: one response per prompt from a fixed list, each call's prompts and seed recorded."""

    def __init__(self, tok, holds_own_weights: bool):
        self.tok, self.holds_own_weights, self.calls = tok, holds_own_weights, []

    def generate(self, prompts, gen, seed):
        self.calls.append((list(prompts), seed))
        return _rollout(self.tok, prompts, [RESPONSES[TEXTS.index(p) % len(RESPONSES)] for p in prompts])


def _accelerator():
    return SimpleNamespace(autocast=contextlib.nullcontext)


def _policy_value_reference(tmp_path):
    """A seeded tiny Llama as PPO holds it: (tokenizer, policy and value model, frozen reference)."""
    from align.modeling.models import load_causal_lm, load_scalar_model, load_tokenizer
    from align.stages.ppo.models import PolicyAndValue

    print("seed", SEED)
    torch.manual_seed(SEED)
    base, tok_dir = build("llama", tmp_path / "llama", seed=SEED)
    tok = load_tokenizer(str(tok_dir))
    model = PolicyAndValue(load_causal_lm(str(base)), load_scalar_model(str(base), tok.pad_token_id)).eval()
    return tok, model, load_causal_lm(str(base)).eval()


def test_the_hf_engine_samples_batch_size_prompts_per_call_and_the_chunks_join_row_for_row(tmp_path):
    """64 prompts per process with generation.batch_size 16 were one generate call (4x the KV cache align estimate
    counts): now the hf engine gets chunks of batch_size, and the joined rollout's rows are the chunks' rows (padding
    aside) in prompt order; an engine holding its own weights (vllm) gets them all."""
    from align.config import Generation
    from align.config.ppo import PPOStage
    from align.modeling.models import load_tokenizer
    from align.stages.ppo.rollouts import rollout

    print("seed", SEED)
    _, tok_dir = build("llama", tmp_path / "llama", seed=SEED)
    tok = load_tokenizer(str(tok_dir))
    cfg = PPOStage(type="ppo", policy="sft", reward="reward", prompts="p.yaml", generation=Generation(batch_size=2))
    prompts = TEXTS  # 3 prompts of different lengths: chunks of 2 and 1, of different widths
    hf = _Recording(tok, holds_own_weights=False)
    joined = rollout(cfg, _accelerator(), hf, prompts, seed=100, pad_id=tok.pad_token_id)
    assert [len(p) for p, _ in hf.calls] == [2, 1] and hf.calls[0][1] == 100  # the first chunk: the rollout's seed
    alone = [_rollout(tok, [p], [RESPONSES[i]]) for i, p in enumerate(prompts)]
    for i, a in enumerate(alone):
        q, resp = joined.query_mask[i].bool(), joined.response_mask[i].bool()
        assert torch.equal(joined.query_ids[i][q], a.query_ids[0][a.query_mask[0].bool()])
        assert torch.equal(joined.response_ids[i][resp], a.response_ids[0][a.response_mask[0].bool()])
        assert bool((joined.response_ids[i][~resp] == tok.pad_token_id).all())  # a reward model finds its last token
    own = _Recording(tok, holds_own_weights=True)
    rollout(cfg, _accelerator(), own, prompts, seed=100, pad_id=tok.pad_token_id)
    assert [(len(p), s) for p, s in own.calls] == [(3, 100)]


def test_a_rollouts_chunks_share_one_gather_of_the_policy(tmp_path):
    """The hf engine prepares the policy for each generate through its `context` (under ZeRO-3 with gather: whole, a
    gather of the whole policy, 16 GB at 8B): a rollout's chunks now share one (base.holding), not one a chunk; a
    generate outside a rollout still prepares it itself."""
    from align.config import Generation
    from align.config.ppo import PPOStage
    from align.engines.hf import HFEngine
    from align.modeling.models import load_causal_lm, load_tokenizer
    from align.stages.ppo.rollouts import rollout

    print("seed", SEED)
    base, tok_dir = build("llama", tmp_path / "llama", seed=SEED)
    tok = load_tokenizer(str(tok_dir))
    model = load_causal_lm(str(base)).eval()
    entered = []

    @contextlib.contextmanager
    def gathered():
        entered.append(1)
        yield model

    gen = Generation(batch_size=2, max_new_tokens=3)
    cfg = PPOStage(type="ppo", policy="sft", reward="reward", prompts="p.yaml", generation=gen)
    engine = HFEngine(None, tok, context=gathered)
    r = rollout(cfg, _accelerator(), engine, TEXTS * 2, seed=SEED, pad_id=tok.pad_token_id)  # 3 chunks of 2
    assert r.query_ids.size(0) == 6 and len(entered) == 1
    engine.generate(TEXTS, gen, seed=SEED)
    assert len(entered) == 2


def test_the_heldout_kl_rollouts_share_one_gather_of_the_policy(tmp_path):
    """The held-out KL (every iteration) samples its prompts generation.batch_size at a time, one rollout a chunk:
    under ZeRO-3 with gather: whole each was a gather of the whole policy (16 GB at 8B); now all of an iteration's
    share one (base.holding around them), and the KL is measured on every prompt."""
    from align.config import Generation
    from align.config.ppo import PPOStage
    from align.engines.hf import HFEngine
    from align.stages.ppo.budget import heldout_kl

    tok, model, reference = _policy_value_reference(tmp_path)
    entered = []

    @contextlib.contextmanager
    def gathered():
        entered.append(1)
        yield model.policy

    cfg = PPOStage(type="ppo", policy="sft", reward="reward", prompts="p.yaml",
                   generation=Generation(batch_size=2, max_new_tokens=3))
    accelerator = SimpleNamespace(autocast=contextlib.nullcontext, num_processes=1, process_index=0,
                                  gather=lambda t: t)
    kl = heldout_kl(cfg, accelerator, HFEngine(None, tok, context=gathered), model, reference, TEXTS * 2,
                    seed=SEED, where="iteration 1")
    assert len(entered) == 1  # 3 rollouts of 2 prompts, one gather
    assert kl.n == 3  # six prompts measured, three of them distinct: the bound counts prompts, not repeats


def test_the_heldout_kl_scores_a_mini_batch_of_rows_at_a_time(tmp_path):
    """The held-out KL ran the policy and the reference over a whole generation.batch_size chunk at once (64 rows by
    default: under ZeRO-3, no fused head, ~40 GB of logits for 32 rows of 1,024 tokens over a 128k vocabulary),
    which align estimate does not count; it scores mini_batch_size rows at a time now, as PPO's step 3 does, with the
    same KL (fp32)."""
    from align.config import Generation
    from align.config.ppo import PPOStage
    from align.engines.hf import HFEngine
    from align.stages.ppo.budget import heldout_kl

    tok, model, reference = _policy_value_reference(tmp_path)
    with torch.no_grad():  # the reference one step away from the policy: a KL that is not 0
        for p in reference.parameters():
            p.add_(0.01 * torch.randn_like(p))
    rows: list[int] = []

    def policy(ids, *args, **kwargs):
        rows.append(ids.size(0))
        return model(ids, *args, **kwargs)

    accelerator = SimpleNamespace(autocast=contextlib.nullcontext, num_processes=1, process_index=0,
                                  gather=lambda t: t)
    kls = {}
    for mini in (1, 4):
        cfg = PPOStage(type="ppo", policy="sft", reward="reward", prompts="p.yaml", mini_batch_size=mini,
                       rollout_batch_size=8, generation=Generation(batch_size=4, max_new_tokens=3))
        rows.clear()
        kls[mini] = heldout_kl(cfg, accelerator, HFEngine(model.policy, tok), policy, reference, TEXTS * 2,
                               seed=SEED, where="iteration 1")
        assert max(rows) == min(mini, 4) and sum(rows) == 6, (mini, rows)
    assert kls[1].mean != 0 and math.isclose(kls[1].mean, kls[4].mean, rel_tol=1e-5, abs_tol=1e-6), kls


def test_scoring_a_mini_batch_at_a_time_equals_scoring_the_whole_rollout(tmp_path):
    """Step 3 in chunks of rows (the mini-batch): the policy's log-probs and values and the reference's log-probs
    equal one forward over the whole rollout (fp32), whatever the chunk."""
    from align.modeling.generation import sequence_logprobs
    from align.stages.ppo.rollouts import scored

    tok, model, reference = _policy_value_reference(tmp_path)
    with torch.no_grad():  # the reference one step away from the policy, so the two log-probs differ
        for p in reference.parameters():
            p.add_(0.01 * torch.randn_like(p))
    r = _rollout(tok, TEXTS * 2, RESPONSES * 2)
    lq = r.query_ids.size(1)
    with torch.no_grad():
        logprobs, _, values = model(r.input_ids, r.attention_mask, lq, 0.7, with_entropy=False)
        ref = sequence_logprobs(reference, r.input_ids, r.attention_mask, lq, 0.7)
    rmask = r.response_mask.bool()
    for rows in (1, 4, 6):
        got = scored(model, reference, r, 0.7, rows, _accelerator())
        for a, b, what in zip(got, (logprobs, values, ref), ("log-probs", "values", "reference")):
            assert a.shape == b.shape and torch.allclose(a[rmask], b[rmask], rtol=1e-5, atol=1e-6), (rows, what)
    assert not torch.allclose(got[0][rmask], got[2][rmask])


def test_no_two_chunks_of_any_iteration_or_process_share_a_seed():
    """Each chunk's sampling stream is its own: over PPO's rollout seeds (seed * 7919 + iteration * world + rank)
    for 8 processes, 200 iterations and 8 chunks a rollout, every chunk's seed is distinct; the first chunk keeps the
    rollout's seed (one call's stream, as before chunking)."""
    from align.stages.ppo.rollouts import chunk_seed

    print("seed", SEED)
    world, seeds = 8, []
    for it in range(200):
        for rank in range(world):
            rollout_seed = 17 * 7919 + it * world + rank
            seeds += [chunk_seed(rollout_seed, c) for c in range(8)]
            assert chunk_seed(rollout_seed, 0) == rollout_seed
    assert len(set(seeds)) == len(seeds)
