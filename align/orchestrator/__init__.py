"""The orchestrator: the process a user starts (`align run`, `validate`, `estimate`, `status`, `verify`, `report`, `model`).

It plans, checks, launches and records; it trains nothing and never imports torch (tests/test_orchestrator.py runs
it with torch unimportable). What needs torch (a loaded tokenizer, model shapes, a GGUF conversion) it asks of a
helper process (helper.py -> align/modeling/); stages run as their own processes (align/stages/). It imports nothing
from align/stages/, align/modeling/ or align/report/ (tests/test_layout.py), but warm.py's forked child, which is
a stage process."""
