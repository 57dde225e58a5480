"""What a run says about itself, the trainer's ground floor: ``monitoring`` (the one seam to the agent:
the ``Monitor`` protocol that the loop and RAA talk to) and ``metrics_log`` (``<out>/metrics.jsonl``).
It imports no other room of the trainer.
"""
