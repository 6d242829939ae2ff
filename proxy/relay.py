"""Relay a decode stream to the client, bytes exactly as the engine framed them (and read a
whole reply: :func:`whole_reply`).

Yields each chunk as it arrives (the client has it before any bookkeeping runs), then, when the
engine fails mid-stream, one :class:`~proxy.errors.DecodeLost` or ``DecodeStalled``: the stream
is continued elsewhere (``proxy/migration.py``, which counts what reaches the client) or the
renderer turns it into an in-band error event (``proxy/render.py``). Past the request's own
deadline (``ApiRequest.deadline``, the whole request's, kept across continuations) it yields a
:class:`~proxy.errors.RequestDeadline` instead, which is never continued. Whatever way the stream
ends (done, engine lost or silent, client gone) the decode request is closed (vLLM aborts it)
and the request's decode claim released, in ``finally``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from proxy.decode_leg import DecodeLeg
from proxy.engine_client import EngineStream, EngineTimeout, EngineUnreachable
from proxy.errors import DecodeLost, DecodeStalled, ProxyError, RequestDeadline

_DONE = b"data: [DONE]"


def tokens_in(chunk: bytes) -> int:
    """The token events that end in ``chunk`` of a vLLM stream: its events end in a blank line
    (a JSON string holds no raw newline, so the generated text cannot fake one), less those
    that carry no token: a chat stream's opening ``role`` event, the closing usage event (no
    choices) and ``[DONE]``. They were counted as tokens once, so a ``[DONE]`` read on its own
    taught the step model a step of a few microseconds. (An event split across two reads is
    counted in the read that ends it; the markers are keys, which the text cannot fake either.
    A role event split so that its marker and its end fall in two reads counts once: rare.)
    """
    return max(0, chunk.count(b"\n\n") - chunk.count(b'"role":') - chunk.count(b'"choices":[]')
               - chunk.count(b"[DONE]\n\n"))


async def whole_reply(leg: DecodeLeg, metrics, pool) -> bytes:
    """The decode engine's whole (unstreamed) reply; the claim ends with it."""
    stream = await leg.open()
    assert leg.req.deadline is not None  # set by Orchestrator.serve
    try:
        async with asyncio.timeout_at(leg.req.deadline):
            data = await stream.read_all()
    except TimeoutError:
        raise RequestDeadline("the request did not finish within its deadline") from None
    except EngineTimeout:
        pool.stalled(leg.decode)
        raise DecodeStalled("the decode engine stalled while answering",
                            engine=leg.decode.name) from None
    except Exception as exc:
        if isinstance(exc, EngineUnreachable):
            pool.mark_down(leg.decode)
        raise DecodeLost("the decode engine failed while answering",
                         engine=leg.decode.name) from None
    finally:
        stream.close()
        leg.claim.release()
        leg.ended(time.perf_counter())  # (its pull is over)
    leg.decode.stalls = 0  # it generated (``proxy/stalls.py``)
    # A whole reply has no first-token time: only its total is recorded.
    metrics.stage_seconds.labels("total", leg.route).observe(
        time.perf_counter() - leg.trace.t_start)
    return data


async def relay(leg: DecodeLeg, stream: EngineStream, deadline: float, metrics, pool
                ) -> AsyncIterator[bytes | ProxyError]:
    """``deadline``: when the whole request must be over (``loop.time()``)."""
    t_first = 0.0
    tail = b""
    engine = leg.decode
    engine.open_streams.add(stream)
    try:
        # The deadline times each read (``EngineStream.chunks``): a timer around the loop would
        # fire while this generator waits at a ``yield`` and cancel the consumer, the client's
        # writer, instead (no in-band error, a traceback in the server's log).
        async for chunk in stream.chunks(deadline):
            # Bytes first, bookkeeping after: the consumer writes ``chunk`` to the client
            # before this generator resumes.
            if not t_first:
                t_first = time.perf_counter()
                yield chunk
                leg.first_byte(t_first)
            else:
                yield chunk
            tail = (tail + chunk)[-32:]
            engine.stalls = 0  # it generates (``proxy/stalls.py``)
            leg.frames(time.perf_counter(), tokens_in(chunk))
        if _DONE not in tail:
            raise EngineUnreachable("decode stream ended without [DONE]")
    except TimeoutError:  # the request's own deadline (the engine's silence is EngineTimeout)
        metrics.stream_errors_total.labels("deadline").inc()
        late = RequestDeadline("the request did not finish within its deadline")
        if leg.req.spans is not None:  # the trace says so, as for a stream given up
            leg.req.spans.failed(late.status, late.type)
        yield late
    except (EngineUnreachable, EngineTimeout) as exc:
        lost = isinstance(exc, EngineUnreachable)
        if lost and not stream.moved:  # (moved: cut by a drain, the engine answers still)
            pool.mark_down(leg.decode)
        elif not lost:
            pool.stalled(leg.decode)
        yield (DecodeLost("the decode engine failed mid-stream", engine=leg.decode.name)
               if lost else DecodeStalled("the decode engine stalled mid-stream",
                                          engine=leg.decode.name))
    except (asyncio.CancelledError, GeneratorExit):
        # The client went away: closing the decode stream (below) makes vLLM abort it.
        metrics.client_disconnects_total.labels("streaming").inc()
        raise
    finally:
        engine.open_streams.discard(stream)
        stream.close()
        leg.ended(time.perf_counter())
        metrics.stage_seconds.labels("total", leg.route).observe(
            time.perf_counter() - leg.trace.t_start)
