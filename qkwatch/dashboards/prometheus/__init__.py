"""The Prometheus rules: ``alert_rules`` renders ``rules/qkwatch.yml`` from ``qkwatch.yml.template``."""
