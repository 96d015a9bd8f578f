"""The `echo` stage (test-only; its config class is echo_config.py): publish the settings as data/echo.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from align.config import to_dict
from align.runtime.context import StageContext

OUTPUTS = ["data"]


def run(ctx: StageContext) -> dict[str, Any]:
    cfg = ctx.cfg
    text = " ".join([cfg.message] * cfg.repeat)

    def write(path: Path) -> None:
        if ctx.is_main:
            (path / "echo.json").write_text(json.dumps({"text": text, "config": to_dict(cfg)}))

    ctx.publish("data", write)
    words = len(text.split())
    ctx.log({"echo/words": words}, step=0)
    return {"echo/words": words}
