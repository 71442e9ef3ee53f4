"""Where quality breaks as S grows, and why: ``python -m benchmarks.scale_quality``."""
