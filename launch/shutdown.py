"""How a launcher's proxy server stops on a signal.

SIGINT and SIGTERM are uvicorn's own: it stops serving (in-flight requests get their grace),
then raises them again for the launcher to unwind (``finally``: stop the engines). SIGHUP (the
terminal closed) must do the same, and :func:`run_server` makes it. A handler that raises
(``sys.exit``) while the server runs is not safe: the exception surfaces inside whatever
event-loop callback the signal interrupted, and uvloop logs it as a transport error and serves
on. CI saw exactly that: ``pdserve dev`` kept running after SIGHUP, was killed, and its engines
were orphaned.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

#: The exit code of a process stopped by SIGHUP (128 + 1), as a shell reports it.
HANGUP_EXIT = 128 + signal.SIGHUP


def run_server(server: Any) -> int:
    """Run a ``uvicorn.Server`` until a signal stops it; :data:`HANGUP_EXIT` when SIGHUP did,
    else 0 (SIGINT / SIGTERM are raised again by uvicorn once it has stopped)."""
    hung_up: list[int] = []

    def on_hangup(sig: int, frame: FrameType | None) -> None:
        hung_up.append(sig)
        server.handle_exit(sig, frame)

    previous = signal.signal(signal.SIGHUP, on_hangup)
    try:
        server.run()
    finally:
        signal.signal(signal.SIGHUP, previous)
    return HANGUP_EXIT if hung_up else 0
