"""qkwatch: see, and act on, what attention is doing inside a model while it trains."""

__version__ = "0.1.0"
