"""The Grafana dashboards and provisioning: ``boards`` composes them from the ``grafana_panels`` builders."""
