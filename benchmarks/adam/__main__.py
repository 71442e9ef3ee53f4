import sys

from benchmarks.adam.adam import main

sys.exit(main())
