"""A tokenizer worker process: ``python -m proxy.tokenizer_worker MODEL_DIR NICE``.

Reads framed requests on stdin and answers each on stdout, one at a time, in order. A frame is a
4-byte big-endian length and a pickle. Requests: ``("measure", body, block_sizes)`` →
``(n_tokens, {block_size: keys as int64 bytes})`` or None; ``("ids", body)`` → a list of ids or
None; ``("info",)`` → :class:`proxy.tokens.TokenizerInfo`. Before the first request it loads the
tokenizer and writes one frame, ``"ready"``. It exits at end of input (the proxy closed the pipe
or died), not on SIGINT (a terminal's Ctrl-C, meant for the proxy). The proxy's side is
:mod:`proxy.tokenizer_pool`; nothing else speaks this.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
import sys
from typing import Any, BinaryIO

HEADER = struct.Struct("!I")


def read_frame(stream: BinaryIO) -> Any | None:
    head = stream.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    (n,) = HEADER.unpack(head)
    data = stream.read(n)
    if len(data) < n:
        return None
    return pickle.loads(data)


def frame(obj: Any) -> bytes:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def serve(model_dir: str, stdin: BinaryIO, stdout: BinaryIO) -> None:
    from proxy.tokens import PromptTokenizer

    tokenizer = PromptTokenizer(model_dir)
    tokenizer.ids({"messages": [{"role": "user", "content": "warm up"}]})  # compile the template
    stdout.write(frame("ready"))
    stdout.flush()
    while (request := read_frame(stdin)) is not None:
        kind, *args = request
        reply: Any
        if kind == "measure":
            measured = tokenizer.measure(*args)
            # Keys travel as bytes: one memcpy to unpickle, not one Python int per block.
            reply = None if measured is None else (measured.n_tokens, {
                bs: keys.tobytes() for bs, keys in measured.block_keys.items()})  # type: ignore
        elif kind == "ids":
            reply = tokenizer.ids(*args)
        elif kind == "info":
            reply = tokenizer.info()
        else:
            reply = None
        stdout.write(frame(reply))
        stdout.flush()


def main() -> None:
    # A terminal's Ctrl-C reaches the whole foreground group, this worker too: the proxy is
    # then draining, its requests still in flight need their tokenizer. The worker ends when
    # the proxy closes its stdin (or dies).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    model_dir, nice = sys.argv[1], int(sys.argv[2])
    os.nice(nice)
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    sys.stdout = sys.stderr  # nothing but frames on the pipe (library prints go to the log)
    serve(model_dir, stdin, stdout)


if __name__ == "__main__":
    main()
