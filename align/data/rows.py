"""Rows a stage reads: from an upstream stage's `data/<split>.jsonl` or from a data card."""

from __future__ import annotations

from typing import Any

from align.data.cards import load_split, read_jsonl
from align.stages.context import StageContext, StageError


def load_rows(ctx: StageContext, ref: str, split: str, limit: int | None = None) -> list[dict[str, Any]]:
    """Rows from a data reference: an upstream stage that wrote `data/<split>.jsonl`, or a data card path."""
    if ref in ctx.inputs:
        rows = read_jsonl(ctx.input_dir(ref) / "data" / f"{split}.jsonl")
    else:
        rows = load_split(ref, split).rows
    return rows[:limit] if limit else rows


def unique_prompts(rows: list[dict[str, Any]], limit: int | None = None) -> list[str]:
    """Distinct prompts in order of first appearance (so a prompt is never sampled twice by accident)."""
    seen = dict.fromkeys(r["prompt"] for r in rows)
    prompts = list(seen)
    return prompts[:limit] if limit else prompts


def load_prompts(ctx: StageContext, ref: str, split: str, limit: int | None = None) -> list[str]:
    """Distinct non-empty prompts of a data reference (at most `limit`); none at all fails the stage."""
    prompts = [p for p in unique_prompts(load_rows(ctx, ref, split), limit) if p.strip()]
    if not prompts:
        raise StageError(f"stage '{ctx.name}': no non-empty prompts in {ref} split '{split}'")
    return prompts
