"""Integrations with training frameworks: import the one you use."""
