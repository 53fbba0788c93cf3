"""PID 1 of the locoswarm image, a minimal init (like tini): runs its arguments as a child in a process
group of its own, forwards the signals Docker sends (SIGTERM from ``docker stop``, SIGINT, SIGHUP,
SIGQUIT, SIGUSR1, SIGUSR2) to it, reaps the orphans re-parented to it, and exits with the child's status
(128 + N when signal N ended the child).

Why the node does not run as PID 1 itself: PID 1 must reap orphans, and to the node's DHT process a
parent with pid 1 means "the node is gone" (node/swarm/dht.py), so a node that is PID 1 cannot start its
DHT. The child leads its own process group so that a terminal's Ctrl+C (``docker run -it``) reaches it
once, through this forwarding, not twice.

Usage: init.py COMMAND [ARG...]
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys

FORWARD = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: init.py COMMAND [ARG...]", file=sys.stderr)
        return 2
    child = 0

    def forward(signum: int, frame: object) -> None:
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)

    for sig in FORWARD:
        signal.signal(sig, forward)
    # Signals that arrive while the child is being created wait until its pid is known.
    signal.pthread_sigmask(signal.SIG_BLOCK, FORWARD)
    child = os.fork()
    if child == 0:
        for sig in FORWARD:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARD)
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            print(f"init: cannot run {argv[0]}: {exc.strerror}", file=sys.stderr)
        os._exit(127)
    with contextlib.suppress(OSError):
        os.setpgid(child, child)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, FORWARD)
    while True:
        try:
            pid, status = os.wait()  # the child, or an orphan re-parented to PID 1
        except ChildProcessError:
            return 1
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
