"""The composition root's lifecycle (``proxy/service.py``): a background task that dies is
logged when it dies, and ``stop()`` closes everything whatever its tasks did before.

No engines: a pool of one fake client, the service built around it without ``start()``.
"""

from __future__ import annotations

import asyncio
import logging

import zmq.asyncio

from proxy.config import ProxyConfig
from proxy.engine_client import new_session
from proxy.metrics import ProxyMetrics
from proxy.pool import EnginePool
from proxy.service import ProxyService


class Client:
    name = "decode-0"
    base_url = "http://127.0.0.1:1"


class Prompts:
    """The tokenizer workers: only their close is seen."""

    closed = False

    async def close(self):
        self.closed = True


def service_of(prompts=None) -> ProxyService:
    metrics = ProxyMetrics()
    config = ProxyConfig(decode_urls=("http://127.0.0.1:1",), served_model_names=("m",),
                         policy="local", warmup=False)
    return ProxyService(config, None, None, new_session(), EnginePool([], [Client()], metrics),
                        prompts, metrics, zmq.asyncio.Context())


async def died(exc: Exception):
    raise exc


async def test_stop_closes_everything_after_a_background_task_had_died(caplog):
    """``stop()`` re-raised the exception of a task that had died (the health loop, a KV-event
    feed ...) and closed nothing after it: the tokenizer's workers, the HTTP pools, the ZMQ
    context stayed (the app's shutdown failed)."""
    prompts = Prompts()
    service = service_of(prompts)
    dead = ProxyService._background(died(ValueError("cannot convert float NaN")), "health")
    service._tasks += [dead, ProxyService._background(asyncio.Event().wait(), "discovery")]
    await asyncio.wait([dead])
    await service.stop()
    assert prompts.closed and service._zmq.closed
    assert all(t.done() for t in service._tasks)
    assert "background task health had failed: ValueError" in caplog.text


async def test_a_background_task_that_dies_is_logged_when_it_dies(caplog):
    service = service_of()
    with caplog.at_level(logging.ERROR, "proxy.service"):
        task = ProxyService._background(died(KeyError("engine_id")), "KV events of decode-0")
        await asyncio.wait([task])
    (record,) = caplog.records
    assert record.getMessage() == ("background task KV events of decode-0 died; the proxy goes"
                                   " on without it")
    assert record.exc_info is not None and record.exc_info[1] is task.exception()
    await service.stop()
