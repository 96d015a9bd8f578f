"""One module per stage; each exposes `run(ctx: StageContext) -> dict` (final metrics)."""
