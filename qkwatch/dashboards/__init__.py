"""qkwatch's monitoring stack beside the collector: Grafana dashboards, Prometheus rules, Alertmanager config.

Not installed with ``qkwatch``; it is a package only so that its generator runs as a module from the
repository root: ``python -m qkwatch.dashboards.generate`` (see that module).
"""
