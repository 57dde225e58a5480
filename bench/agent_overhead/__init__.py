"""What the agent costs a training step, ``python -m bench.agent_overhead`` (usage in ``__main__.py``).

* ``arms``: the bench's model and the interleaved A/B rounds (arm A with the agent, arm B without), on one
  rank or on two FSDP2 ranks, and cProfile of the report steps;
* ``summary``: the rounds' overheads, their bootstrap interval and the per-position breakdown;
* ``sinks``: ``--sinks``, the A/B of the sinks (both arms with the agent, arm A's with the sinks too);
* ``parts``: ``--parts``, one report's cost piece by piece and metric family by family;
* ``__main__``: the command and its Markdown.
"""
