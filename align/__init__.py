"""align: staged alignment pipelines (SFT -> reward model -> PPO / DPO -> evaluation).

Importing the package has no side effects; see `align.cli` for the command line.
"""

__version__ = "0.1.0"
