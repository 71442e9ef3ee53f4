import sys

from benchmarks.overhead.overhead import main

sys.exit(main())
