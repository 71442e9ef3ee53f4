"""The small harness every study shares.

* ``cache``: one JSON file per grid cell, valid while the task's configuration is unchanged.
* ``stats``: mean ± std over seeds, "worse than S = 1" tests, log thinning.
* ``timing``: ratios of alternating timed blocks against a baseline (median, min–max).
* ``report``: a study's section in its README.md, keeping the hand-written reading; the command line.
* ``plots``: a headless pyplot, saving, seed-mean curves, τ at logged iterations.

Data come from ``examples/datasets.py`` (``from examples import datasets``): one loader per data set
in the repository.
"""
