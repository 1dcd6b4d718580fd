"""`polar eval`: pass@k of a harness over a task set (metrics.py: the math; report.py: sessions -> report)."""
