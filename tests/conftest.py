"""The suite launches its ranks from a forkserver that has imported torch once (``PARALLELISMS_START_METHOD``):
an 8-rank launch takes half a second instead of eight. The fault tests pin the default, ``spawn``, where they
need it; ``test_launch`` checks both."""

import os

os.environ.setdefault("PARALLELISMS_START_METHOD", "forkserver")
