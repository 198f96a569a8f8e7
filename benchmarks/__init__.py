"""Benchmarks: scripts run from the repository root (``python benchmarks/NAME.py``), not installed."""
