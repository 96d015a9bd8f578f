"""The evaluation report: confidence intervals and win rates, the reward-KL frontier, the figures. Used by the
evaluate stage; imports nothing from align/orchestrator/ or align/stages/."""
