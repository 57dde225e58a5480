"""What a run says about itself: ``monitoring`` (the one seam to the agent), ``step_report`` (what
the loop reports after a step), ``metrics_log`` (``<out>/metrics.jsonl``) and ``evals`` (seed
000's evaluations of a checkpoint).
"""
