"""The fleet bench, ``python -m bench.fleet`` (usage in ``__main__.py``): collector replicas behind
HAProxy over one PostgreSQL, fed by simulated agent ranks, one replica killed with SIGKILL midway.

* ``config``: the session's settings (:class:`FleetConfig`) and the metric names a report carries;
* ``values``: the synthetic values, functions of (run, layer, step), and the alerts they must raise;
* ``agents``: the simulated ranks down the agent's real spool, sender and transport, one process of them;
* ``servers``: the fresh database and HAProxy in front of the replicas;
* ``sampler``: the lambdas read from every replica directly, and the CPU time of the servers;
* ``session``: one session, built, loaded, killed and restarted, collected;
* ``checks``: the figures and the checks of one session, read in the database and from the replicas;
* ``report``: the tables, the goals and the plot;
* ``__main__``: the command.
"""
