"""``python -m parallelisms`` and the ``parallelisms`` command: the command line of :mod:`parallelisms.cli`."""

import os
import signal
import sys

INTERRUPTED = 130  # the shell's code for a process ended by Ctrl-C (128 + SIGINT)
RANK_STARTING = "PARALLELISMS_RANK_STARTING"  # set by the launcher while it spawns the ranks

if __name__ != "__main__" and os.environ.get(RANK_STARTING):
    # A rank spawned by the command's launcher runs this file first, before it imports torch (multiprocessing's
    # spawn re-runs the parent's main script): Ctrl-C then ends the rank at once and silently, as it does a
    # running rank, rather than as a KeyboardInterrupt traceback out of torch's import; the launcher reports
    # the interrupted run in one line.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run() -> None:
    """Import the command line (torch: a second or more) and run it. A Ctrl-C while importing is held until the
    import is done (torch and numpy imports interrupted half-way swallow it or fail on re-import); then, as
    after the launcher has ended the ranks, ``interrupted`` is printed and the process ends at once
    (``os._exit``: a thread of the torn-down launcher's rendezvous store can abort the interpreter's shutdown),
    as it does after any failure."""
    held = []
    default = signal.signal(signal.SIGINT, lambda *_: held.append(True))
    from parallelisms.cli import main
    signal.signal(signal.SIGINT, default)
    code = INTERRUPTED if held else main()
    if code:  # interrupted or failed: nothing is left to finalize (on a failed launch that took 1.2 s here)
        if held:
            print("interrupted", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    __spec__ = None  # spawned ranks re-run this file by its path (spawn skips re-running a ``pkg.__main__`` by name)
    run()
