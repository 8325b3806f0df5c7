"""Benchmarks of raylazy: `python -m benchmarks.loaders` (loaders compared) and plan_405b.py (planning)."""
