"""Subscribe to each engine's KV cache events (ZMQ) and keep its :class:`PrefixIndex` current.

One task per engine: ``run_feed(endpoint, index)`` connects a SUB socket (ZMQ reconnects by
itself when an engine restarts), decodes each batch with ``transport.kv_events`` and applies it.
A gap in sequence numbers means lost events: the index is cleared rather than trusted, and
refills from new events. So does a batch that cannot be decoded or applied: the task ends only
when the caller cancels it (nobody awaits it, so an exception would freeze the index for good);
the socket is closed in ``finally``.
"""

from __future__ import annotations

import logging

import zmq
import zmq.asyncio

from proxy.prefix_index import PrefixIndex
from transport.kv_events import AllCleared, EventFormatError, decode_batch

log = logging.getLogger(__name__)


async def run_feed(endpoint: str, index: PrefixIndex, ctx: zmq.asyncio.Context) -> None:
    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    last_seq: int | None = None
    try:
        while True:
            parts = await sock.recv_multipart()
            if len(parts) != 3:
                continue
            _topic, seq_bytes, payload = parts
            seq = int.from_bytes(seq_bytes, "big")
            if last_seq is not None and seq != last_seq + 1:
                log.warning("KV events from %s: gap %d -> %d, index reset", endpoint, last_seq,
                            seq)
                index.apply([AllCleared()])
            last_seq = seq
            try:
                events = decode_batch(payload)
            except EventFormatError as exc:  # a batch not read is a batch lost
                log.warning("KV events from %s: %s; index reset", endpoint, exc)
                index.apply([AllCleared()])
                continue
            try:
                index.apply(events)
            except Exception:  # noqa: BLE001 - the feed outlives any one batch
                # Applied halfway, the index may now claim blocks the engine dropped.
                log.exception("KV events from %s: batch not applied, index reset", endpoint)
                index.apply([AllCleared()])
    finally:
        sock.close(0)
