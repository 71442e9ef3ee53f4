"""AdaScale with AdamW: which gain rule keeps S = 1 quality (``python -m benchmarks.adam``)."""
