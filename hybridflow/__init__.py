"""hybridflow: RL post-training of language models with a single controller driving SPMD worker groups."""

__version__ = "0.1.0"
