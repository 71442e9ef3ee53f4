"""MaxText 0.2.5's pre-training with AdaScale: ``use_adascale()`` in the process that runs MaxText, then its ``main``.

    PYTHONPATH=integrations/maxtext python integrations/maxtext/adascale_train.py maxtext/configs/base.yml \\
        run_name=... steps=T ...        # MaxText's own arguments, as for python -m maxtext.trainers.pre_train.train

``train_step.patch`` must be applied to the installed ``train.py`` (``run.sh`` does). ``use_adascale()`` has to run
before ``train.main`` builds the optimizer (``train_utils.setup_train_loop`` calls ``get_optimizer``), in the same
Python process: ``python -m maxtext.trainers.pre_train.train`` alone never calls it, and the patched step then stays
MaxText's own (it warns once when the step is traced). ``ADASCALE_RAMP=K`` adds ``BatchRamp(1, K)``.
"""

import os

import adascale_maxtext
from absl import app

import optax_adascale

if __name__ == "__main__":
    from maxtext.trainers.pre_train import train

    ramp = os.environ.get("ADASCALE_RAMP")
    adascale_maxtext.use_adascale(optax_adascale.BatchRamp(1, int(ramp)) if ramp else None)
    app.run(train.main)
