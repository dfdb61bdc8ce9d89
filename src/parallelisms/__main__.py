"""``python -m parallelisms`` and the ``parallelisms`` command: the command line of :mod:`parallelisms.cli`."""

import os
import signal
import sys

INTERRUPTED = 130  # the shell's code for a process ended by Ctrl-C (128 + SIGINT)


def run() -> None:
    """Import the command line (torch: a second or more) and run it. A Ctrl-C while importing is held until the
    import is done (torch and numpy imports interrupted half-way swallow it or fail on re-import); then, as
    after the launcher has ended the ranks, ``interrupted`` is printed and the process ends at once
    (``os._exit``: a thread of the torn-down launcher's rendezvous store can abort the interpreter's shutdown)."""
    held = []
    default = signal.signal(signal.SIGINT, lambda *_: held.append(True))
    from parallelisms.cli import main
    signal.signal(signal.SIGINT, default)
    code = INTERRUPTED if held else main()
    if code == INTERRUPTED:
        if held:
            print("interrupted", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    run()
