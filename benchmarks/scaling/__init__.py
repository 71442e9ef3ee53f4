"""AdaScale against fixed scaling rules: a miniature of the paper's Table 2 (``python -m benchmarks.scaling``)."""
