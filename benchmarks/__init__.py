"""The benchmark studies of optax_adascale, one package per study, run from the repository root.

    python -m benchmarks.scaling            # AdaScale vs fixed scaling rules (the paper's Table 2)
    python -m benchmarks.overhead           # step time against SGD + pmean; compiled-HLO facts
    python -m benchmarks.sharded            # collectives and memory under TP, FSDP, ZeRO
    python -m benchmarks.gpu                # the accelerator suite, FairScale side by side
    python -m benchmarks.delayed_fidelity   # the delayed gain on FairScale's golden scenarios
    python -m benchmarks.adam               # AdaScale with AdamW
    python -m benchmarks.leaves             # many small leaves; the flagship CNN's drop-in step

Each study writes its results into its own README.md; ``RESULTS.md`` is the index. The studies
share ``benchmarks.harness`` (cell cache, statistics, timing summaries, report sections, plots)
and load their data through ``examples/datasets.py``.
"""
