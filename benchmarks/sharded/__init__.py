"""Collectives and memory under TP, FSDP, TP×FSDP and ZeRO (``python -m benchmarks.sharded``)."""
