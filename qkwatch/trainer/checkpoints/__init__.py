"""Checkpoints: ``checkpoint`` (sharded DCP checkpoints for resuming, the qkwatch-gpt export for
analysis) and ``safety`` (reading one without running it, and knowing it is the one that was saved).
"""
