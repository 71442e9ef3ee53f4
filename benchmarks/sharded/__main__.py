import sys

from benchmarks.sharded.sharded import main

sys.exit(main())
