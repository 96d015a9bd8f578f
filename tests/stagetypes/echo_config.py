"""A stage type defined outside align/: `echo`, which publishes its own settings as data/echo.json.

It is the worked example of adding a stage type (docs/ARCHITECTURE.md): this config class and its stage module
(echo_stage.py) are the only two files; align finds the class because ALIGN_STAGE_MODULES names this module
(a built-in type's module under align/config/ needs not even that).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from align.config import StageBase
from align.core.schema import ranged


@dataclass
class EchoStage(StageBase):
    """Write the message, repeated, to data/echo.json (no model, no torch)."""

    TYPE: ClassVar[str] = "echo"
    MODULE: ClassVar[str] = "echo_stage"
    PRODUCES: ClassVar[str] = "data"
    HEADLINE: ClassVar[tuple[str, ...]] = ("echo/words",)

    message: str = "hello"
    """Text to publish."""
    repeat: int = ranged(1, ge=1, fix="an echo says something at least once")
    """How many times the message is repeated."""

    def check(self, ctx) -> None:
        if not self.message.strip():
            raise ValueError("message: empty; an echo needs something to say")
