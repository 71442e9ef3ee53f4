import sys

from benchmarks.leaves.leaves import main

sys.exit(main())
