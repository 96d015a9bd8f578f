"""The library stage processes compute with (torch): loading models and tokenizers, sampling and log-probs, the
loss functions, device and precision; and what the orchestrator's helper process runs for it (checks.py,
shapes.py). Imports nothing from align/orchestrator/ or align/stages/."""
