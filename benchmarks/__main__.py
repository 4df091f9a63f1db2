"""`python -m benchmarks`: run every benchmark and write docs/BENCHMARKS.md (see runner.py)."""

import sys

from benchmarks.runner import main

if __name__ == "__main__":
    sys.exit(main())
