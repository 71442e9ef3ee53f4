import sys

from benchmarks.scaling.scaling import main

sys.exit(main())
