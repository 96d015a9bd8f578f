"""The checks the stage types that train on their own samples (ppo, grpo, rloo) make alike: whether the rollout
engine's weight sync can serve a LoRA policy, and whether the policy samples at the lengths its reward model learned
from and its evaluation samples at; and, for every stage that scores samples with a reward model (evaluate and
preferences too), whether they fit in what it trained on."""

from __future__ import annotations

from align.config.contract import DATA, POLICY, REPORT, REWARD_MODEL, StageBase
from align.config.settings import Generation, LoraSettings
from align.data.lengths import LengthRule, drop_long_prompts
from align.engines import engine_names, kind
from align.judges import judge_weights


def reward_stages(reward: str | dict[str, float] | None, stages: dict[str, StageBase]) -> list[str]:
    """The reward stages of the pipeline that a judge setting (`ppo.reward`, `preferences.judge`, ...) names."""
    return [n for n in judge_weights(reward or {}) if n in stages and stages[n].PRODUCES == REWARD_MODEL]


def _trained_lengths(reward: str | dict[str, float] | None, stages: dict[str, StageBase]) -> dict[str, int]:
    """Each reward stage `reward` names -> its max_length (the longest sequence it trained on)."""
    return {rm: stages[rm].max_length for rm in reward_stages(reward, stages)
            if isinstance(getattr(stages[rm], "max_length", None), int)}


def response_length_problems(name: str, algorithm: str, max_new_tokens: int, reward: str | dict[str, float],
                             stages: dict[str, StageBase]) -> list[str]:
    """Online RL (PPO, GRPO, RLOO) optimises responses of `max_new_tokens`; its reward model learned from pairs
    sampled at the length of the data stage it was trained on, and a report stage samples at its own. One line when
    they differ. Stages are asked what they read (`references`) and how long they sample (`response_tokens`)."""
    own = f"stages.{name}.generation.max_new_tokens"
    lengths = {own: max_new_tokens}
    for rm in reward_stages(reward, stages):
        for data in stages[rm].references(DATA):
            tokens = stages[data].response_tokens() if data in stages and stages[data].PRODUCES == DATA else None
            if tokens is not None:
                lengths[f"stages.{data}.generation.max_new_tokens"] = tokens
    for other_name, other in stages.items():
        if other.PRODUCES == REPORT and name in other.references(POLICY) and other.response_tokens() is not None:
            lengths[f"stages.{other_name}.generation.max_new_tokens"] = other.response_tokens()
    out = [] if len(set(lengths.values())) == 1 else [
        "response lengths differ: " + ", ".join(f"{k}={v}" for k, v in lengths.items())
        + f"; {algorithm} would optimise {max_new_tokens}-token responses against a reward model trained on, and an "
        "evaluation run at, other lengths. Set them equal"]
    return out + temperature_problems(name, algorithm, stages)


def reward_length_problems(name: str, longest: int, lengths: str, reward: str | dict[str, float],
                           stages: dict[str, StageBase]) -> list[str]:
    """A reward stage scores sequences of up to `longest` tokens here (`lengths`: the settings that make it) but
    trained on none longer than its own max_length (RewardTrainer drops longer pairs): past it, a score is read from
    positions the head never learned to score (a learned-position model fails there). One line per such stage."""
    return [f"stages.{name}: {lengths} ({longest}) is longer than reward stage '{rm}' trained on "
            f"(stages.{rm}.max_length: {trained}), and its scores of longer sequences are untrained; raise "
            f"stages.{rm}.max_length to {longest} or shorten stages.{name}'s sequences"
            for rm, trained in _trained_lengths(reward, stages).items() if longest > trained]


def reward_room_problems(name: str, max_new_tokens: int, reward: str | dict[str, float] | None,
                         stages: dict[str, StageBase]) -> list[str]:
    """A stage that samples after prompts of any length (evaluate, preferences) drops those after which a response
    of `max_new_tokens` could pass a reward stage's max_length (align/runtime/rows.py prompts_within_reward_models):
    a response as long as that max_length alone leaves none, which would fail the stage after everything before it
    trained. One line per such reward stage."""
    return [f"stages.{name}.generation.max_new_tokens ({max_new_tokens}) leaves no room for a prompt within the "
            f"longest sequence reward stage '{rm}' trained on (stages.{rm}.max_length: {trained}); "
            "raise that max_length or lower max_new_tokens"
            for rm, trained in _trained_lengths(reward, stages).items() if max_new_tokens >= trained]


LEAVES_REPLY_ROOM = LengthRule(
    "leaves_reply_room", drop_long_prompts, setting="reward max_length - generation.max_new_tokens", per_prompt=True,
    nothing_left="stages.{stage}: all {examples} prompts are longer than {max_length} tokens after templating and "
                 "tokenisation, so none leaves room for a reply of generation.max_new_tokens within the max_length of "
                 "the reward stage that scores it (the longest sequence it trained on): the stage would fail when it "
                 "starts, after every stage before it ran. Lower generation.max_new_tokens, raise that reward stage's "
                 "max_length, or use shorter prompts")
"""Prompts a reward model scores the replies to (evaluate, preferences): one after which a reply of max_new_tokens
could pass the reward stage's max_length is dropped and counted (align/runtime/rows.py prompts_within_reward_models);
none left fails the stage."""


def reply_room_check(max_new_tokens: int, reward: str | dict[str, float] | None,
                     stages: dict[str, StageBase]) -> tuple[LengthRule, int, float] | None:
    """A sampling stage's prompts (evaluate, preferences) counted at validate by the room they leave for a reply of
    `max_new_tokens` within every reward stage `reward` names: the stage drops the longer ones and fails when none is
    left (align/runtime/rows.py prompts_within_reward_models), after every stage before it ran; so any fraction is
    allowed (1.0) but all. None when no reward stage scores, or when one leaves no room at all (reward_room_problems)."""
    room = min(_trained_lengths(reward, stages).values(), default=0) - max_new_tokens
    return (LEAVES_REPLY_ROOM, room, 1.0) if room > 0 else None


def temperature_problems(name: str, algorithm: str, stages: dict[str, StageBase]) -> list[str]:
    """The policy's KL to its reference is taken at its sampling temperature, by the stage (its KL penalty, PPO's
    held-out KL that `kl.max` and the pi controller read) and by each report stage that evaluates it (the report's
    "KL to the reference"): at two temperatures they are two quantities, a budget set from the report is not kept in
    it, and the win rates come from another distribution than the one optimised. One line when they differ."""
    own = stages[name].generation_settings()
    temps = {f"stages.{name}.generation.temperature": own.temperature} if own is not None else {}
    for other_name, other in stages.items():
        gen = other.generation_settings() if other.PRODUCES == REPORT and name in other.references(POLICY) else None
        if gen is not None:
            temps[f"stages.{other_name}.generation.temperature"] = gen.temperature
    if len(set(temps.values())) <= 1:
        return []
    return ["sampling temperatures differ: " + ", ".join(f"{k}={v:g}" for k, v in temps.items())
            + f"; {algorithm}'s KL to the reference (its penalty, and a kl budget) is taken at its own temperature, the "
            "report's at the evaluation's, and the win rates come from another distribution than the one optimised. "
            "Set them equal"]


VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""The ranks vLLM's LoRA support is built for (its max_lora_rank takes one of them)."""


def lora_sync_problem(gen: Generation, lora: LoraSettings) -> str | None:
    """Why the engine's weight sync cannot serve this stage's LoRA policy (None when it can): a 4-bit base with an
    engine that keeps its own copy, or `generation.lora_sync: adapter` where it cannot work."""
    if lora.enabled and lora.quantize != "none" and kind(gen.engine).own_copy:
        return (f"lora.quantize: {lora.quantize} with generation.engine: {gen.engine!r}: the engine keeps its own "
                "full-precision copy of the policy, which a 4-bit base cannot be synced into (lora_sync: merged would "
                "add the adapters' delta to packed 4-bit weights; adapter, the adapters would act on other weights "
                "than the trainer's); use generation.engine: hf, or lora.quantize: none")
    if gen.lora_sync != "adapter":
        return None
    if not kind(gen.engine).adapters:
        takers = ", ".join(n for n in engine_names() if kind(n).adapters)
        return (f"generation.lora_sync: adapter needs an engine that applies adapters itself (generation.engine: "
                f"{takers}); generation.engine is {gen.engine!r}; use lora_sync: merged")
    if not lora.enabled:
        return ("generation.lora_sync: adapter needs lora.enabled: true (there are no adapters to send); use "
                "lora_sync: merged")
    if lora.r > VLLM_LORA_RANKS[-1]:
        return (f"generation.lora_sync: adapter: vLLM serves LoRA ranks up to {VLLM_LORA_RANKS[-1]}, lora.r is "
                f"{lora.r}; use lora_sync: merged")
    return None
