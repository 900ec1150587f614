"""Experiments and benchmarks: scripts run with ``python -m experiments.<name>``; public APIs only."""
