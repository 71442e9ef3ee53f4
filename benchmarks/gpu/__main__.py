import sys

from benchmarks.gpu.gpu import main

sys.exit(main())
