"""Benchmarks with their committed results (``bench/RESULTS.md``).

Each is a module run from the repository root, ``python -m bench.ingest --steps 2000``, so that
``qkwatch`` and the other benchmarks import as they do everywhere else; nothing installs or
imports ``bench``.
"""
