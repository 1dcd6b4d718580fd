"""`polar rollout`: a harness over a task set, in sandboxes, verified, grouped, rewarded (Polar's rollout side).

Layers, each its own module: ``tasks`` (JSONL and Harbor task sets -> :class:`tasks.Task`), ``runtimes`` (where a
session runs: one module per sandbox runtime), ``harnesses`` (how a harness is configured and started: one module
per preset), ``runner`` (the INIT -> READY -> RUN -> POSTRUN stages).
"""
