"""The accelerator suite: AdaScale's cost per step on one GPU (``python -m benchmarks.gpu``)."""
