"""The Grafana dashboards and provisioning: ``boards`` renders them; each other module is one part of them."""
