"""What AdaScale costs per step, and the compiled-HLO facts (``python -m benchmarks.overhead``)."""
