"""``python -m parallelisms``: the same command line as ``parallelisms``."""

import sys

from parallelisms.cli import main

sys.exit(main())
