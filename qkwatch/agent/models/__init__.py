"""Where each model keeps its attention: the adapters that find the layers (:mod:`.adapters`), what
the agent knows of one layer and the read-only taps on it (:mod:`.sites`), explicit layouts, the
HuggingFace and training-framework models, q/k norms, and the line that names an unknown model's layout.

Nothing here measures: the probe (``qkwatch.agent.probe``) hooks the sites these modules find.
"""
