"""The delayed gain on FairScale's golden scenarios (``python -m benchmarks.delayed_fidelity``)."""
