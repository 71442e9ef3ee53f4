import sys

from benchmarks.delayed_fidelity.delayed_fidelity import main

sys.exit(main())
