"""Faults the real engines can produce on demand, on the shared tiny `pdserve dev` stack: a
stalled engine (SIGSTOP of its process group), a client that hangs up at each stage, and 16
concurrent streams of mixed lengths. Each checks the client's answer and that neither engine
keeps a request (or, for the prefill engine, KV blocks) for a client that is gone.

The engine crash cases (prefill killed: tests/e2e/test_zz_prefill_down.py; decode killed
mid-stream: the same file, last; restart: tests/ray/) end with the engine gone.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import threading
import time

import httpx
import pytest

from harness import engine_io
from harness.prompts import text_of_tokens
from harness.routes import wait_for
from tests.e2e.conftest import HEADERS_DEADLINE_S, IDLE_DEADLINE_S, PREFILL_DEADLINE_S
from transport.connector import ConnectorOptions
from transport.engine_metrics import engine_load, sample_sums

#: A resumed engine must let go of a gone client's blocks well inside the lease: held for the
#: lease they would still be held a third of the way through it.
LEASE_S = ConnectorOptions.lease_s
FREED_WITHIN_S = LEASE_S / 3


def engine_metrics(url: str) -> str:
    return httpx.get(url + "/metrics", timeout=10).text


def engine_requests(url: str) -> int:
    return engine_load(engine_metrics(url)).requests


def kv_usage(url: str) -> float:
    usage = sample_sums(engine_metrics(url)).get("vllm:kv_cache_usage_perc")
    assert usage is not None, "no vllm:kv_cache_usage_perc"
    return usage


def generated_tokens(url: str) -> float:
    return sample_sums(engine_metrics(url)).get("vllm:generation_tokens_total", 0.0)


def proxy_metric(stack, name: str, **labels: str) -> float:
    return engine_io.proxy_metric(stack.proxy_url, name, **labels)


@contextlib.contextmanager
def stopped(pgid: int):
    """The engine's whole process group frozen (a hung engine), resumed on exit."""
    os.killpg(pgid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(pgid, signal.SIGCONT)


def settled(stack) -> None:
    """Both engines idle and the proxy ready again (after a test froze one)."""
    wait_for(lambda: httpx.get(stack.proxy_url + "/health", timeout=5).status_code == 200,
             "proxy ready", timeout_s=60)
    for url in (stack.prefill_url, stack.decode_url):
        wait_for(lambda u=url: engine_requests(u) == 0, f"{url} idle", timeout_s=60)


def chat(stack, n_tokens: int, seed: int, max_tokens: int = 8, stream: bool = False,
         **extra) -> dict:
    return {"model": stack.model_name, "temperature": 0, "max_tokens": max_tokens,
            "stream": stream, "messages": [{"role": "user",
                                            "content": text_of_tokens(n_tokens, seed=seed)}],
            **extra}


@pytest.fixture
def stack(tiny_stack):
    settled(tiny_stack)
    yield tiny_stack
    settled(tiny_stack)


def test_stalled_prefill_is_given_up_and_served_local(stack):
    before = proxy_metric(stack, "pd_fallbacks_total", reason="prefill_timeout")
    finished_before = engine_load(engine_metrics(stack.prefill_url)).requests_finished
    with stopped(stack.engine_pid("prefill")):
        t0 = time.monotonic()
        r = httpx.post(stack.proxy_url + "/v1/chat/completions", json=chat(stack, 300, 1),
                       timeout=60)
        elapsed = time.monotonic() - t0
    assert r.status_code == 200, r.text
    assert r.headers["x-pd-route"] == "local"
    assert PREFILL_DEADLINE_S - 0.5 <= elapsed < PREFILL_DEADLINE_S + 10, elapsed
    assert proxy_metric(stack, "pd_fallbacks_total", reason="prefill_timeout") == before + 1
    # Resumed, the prefill engine finds its client gone. Either vLLM aborts the prompt, or (a
    # short one, measured) it runs it first and then frees the blocks at once: nothing stays
    # running or waiting, and no block waits out the lease for a decode that will never read it.
    assert_lets_go(stack, finished_before)


def assert_lets_go(stack, finished_before: float) -> None:
    """The prefill engine, resumed after its client left, is idle and holds no blocks within a
    third of the lease (a prompt it finished for nobody would hold them for all of it)."""
    t0 = time.monotonic()
    wait_for(lambda: engine_requests(stack.prefill_url) == 0, "prefill drops the request",
             FREED_WITHIN_S)
    idle_s = time.monotonic() - t0
    wait_for(lambda: kv_usage(stack.prefill_url) == 0.0, "prefill holds no blocks",
             max(FREED_WITHIN_S - idle_s, 0.5))
    finished = engine_load(engine_metrics(stack.prefill_url)).requests_finished - finished_before
    print(f"prefill idle {idle_s:.1f}s, no blocks held {time.monotonic() - t0:.1f}s after "
          f"resuming (lease {LEASE_S}s); {'ran it first' if finished else 'aborted'}")


def test_stalled_decode_before_first_byte_is_a_504_and_aborted(stack):
    """A 3000-token answer asked of a frozen decode engine: the client gets its 504 at the
    deadline, and the engine, resumed, does not write the answer for nobody (its generated
    tokens stop far short of 3000; a request left open would run to its end), and the prefill
    engine does not hold the prompt's blocks for the rest of the lease (resumed, vLLM can drop
    the request before it sees the hand-off: the proxy's one-token read frees them)."""
    generated = generated_tokens(stack.decode_url)
    with stopped(stack.engine_pid("decode")):
        t0 = time.monotonic()
        r = httpx.post(stack.proxy_url + "/v1/chat/completions",
                       json=chat(stack, 300, 2, max_tokens=3000, stream=True,
                                 ignore_eos=True), timeout=60)
        elapsed = time.monotonic() - t0
    assert r.status_code == 504, r.text
    error = r.json()["error"]
    assert error["type"] == "timeout_error" and "Traceback" not in error["message"]
    assert HEADERS_DEADLINE_S - 0.5 <= elapsed < HEADERS_DEADLINE_S + 10, elapsed
    t_resumed = time.monotonic()
    wait_for(lambda: engine_requests(stack.decode_url) == 0, "decode drops the request", 30)
    assert generated_tokens(stack.decode_url) - generated < 2500, "the answer ran: not aborted"
    wait_for(lambda: kv_usage(stack.prefill_url) == 0.0, "prefill frees the prompt's blocks",
             max(FREED_WITHIN_S - (time.monotonic() - t_resumed), 0.5))
    print(f"prefill blocks freed {time.monotonic() - t_resumed:.1f}s after decode resumed "
          f"(lease {LEASE_S}s)")


def test_stalled_decode_mid_stream_ends_with_an_error_event(stack):
    """Frozen mid-answer: the client's stream ends with an in-band error at the idle deadline,
    and the engine, resumed, stops generating (far short of the 3000 tokens asked)."""
    body = chat(stack, 100, 3, max_tokens=3000, stream=True, ignore_eos=True)
    generated = generated_tokens(stack.decode_url)
    events: list[str] = []
    with httpx.Client(timeout=60) as c, c.stream("POST", stack.proxy_url
                                                   + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for line in lines:
            if line.startswith("data: {"):
                break
        with stopped(stack.engine_pid("decode")):
            t0 = time.monotonic()
            events = [ln for ln in lines if ln]  # until the proxy ends the stream
            elapsed = time.monotonic() - t0
    # An error event, then the terminator (so SSE clients end their read loops cleanly).
    assert events[-2:-1] and '"error"' in events[-2] and events[-1] == "data: [DONE]", events[-3:]
    assert json.loads(events[-2].removeprefix("data: "))["error"]["type"] == "timeout_error"
    assert elapsed < IDLE_DEADLINE_S + 10, elapsed
    wait_for(lambda: engine_requests(stack.decode_url) == 0, "decode aborts the stream", 30)
    assert generated_tokens(stack.decode_url) - generated < 2500, "the answer ran: not aborted"


def test_client_gone_mid_stream_aborts_decode(stack):
    """The client hangs up after a few tokens of a 3000-token answer: the decode engine stops
    generating at once (its token counter stops), instead of finishing for nobody."""
    body = chat(stack, 100, 4, max_tokens=3000, stream=True, ignore_eos=True)
    with httpx.Client(timeout=60) as c, c.stream("POST", stack.proxy_url
                                                   + "/v1/chat/completions", json=body) as r:
        lines = r.iter_lines()  # kept: dropping the generator would close the response
        seen = []
        while len(seen) < 3:
            line = next(lines)
            if line.startswith("data: {"):
                seen.append(line)
        assert all('"error"' not in line for line in seen), seen
        t0 = generated_tokens(stack.decode_url)
        wait_for(lambda: generated_tokens(stack.decode_url) > t0 + 20, "decode generating", 10)
    time.sleep(2.0)  # hung up; let the abort land
    stopped_at = generated_tokens(stack.decode_url)
    time.sleep(2.0)
    assert generated_tokens(stack.decode_url) == stopped_at, "decode still generating"
    assert stopped_at - t0 < 2500, "the answer ran to (near) its end: not aborted"
    wait_for(lambda: engine_requests(stack.decode_url) == 0, "decode idle", timeout_s=10)


def test_client_gone_during_prefill_aborts_it(stack):
    """The client hangs up while the prefill engine has the request (frozen, so the moment is
    certain): when it resumes it drops the request and holds no blocks for it."""
    finished_before = engine_load(engine_metrics(stack.prefill_url)).requests_finished
    with stopped(stack.engine_pid("prefill")):
        raw = socket.create_connection(("127.0.0.1", int(stack.proxy_url.rsplit(":", 1)[1])))
        payload = json.dumps(chat(stack, 800, 5)).encode()
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                    b"content-type: application/json\r\ncontent-length: "
                    + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        time.sleep(1.5)  # the proxy has sent the prefill leg; the engine holds it unread
        raw.close()
        time.sleep(1.0)
    assert_lets_go(stack, finished_before)
    wait_for(lambda: proxy_metric(stack, "pd_client_disconnects_total", stage="before_response")
             >= 1, "the proxy counts the disconnect", 30)


def test_client_gone_after_prefill_frees_its_blocks_before_the_lease(stack):
    """Prefill done, decode not answering yet (frozen), client hangs up: the proxy has the
    decode engine read the blocks at once, so the prefill engine frees them in seconds
    instead of holding them for the whole lease (30 s here)."""
    prefill_done = engine_load(engine_metrics(stack.prefill_url)).requests_finished
    with stopped(stack.engine_pid("decode")):
        raw = socket.create_connection(("127.0.0.1", int(stack.proxy_url.rsplit(":", 1)[1])))
        payload = json.dumps(chat(stack, 2000, 6, stream=True)).encode()
        raw.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n"
                    b"content-type: application/json\r\ncontent-length: "
                    + str(len(payload)).encode() + b"\r\n\r\n" + payload)
        wait_for(lambda: engine_load(engine_metrics(stack.prefill_url)).requests_finished
                 > prefill_done, "prefill finished", timeout_s=5)
        held = kv_usage(stack.prefill_url)
        raw.close()
        time.sleep(1.0)
    t_resumed = time.monotonic()
    assert held > 0, "prefill should hold the prompt's blocks for decode"
    wait_for(lambda: kv_usage(stack.prefill_url) == 0.0, "prefill frees the blocks", 15)
    freed_after = time.monotonic() - t_resumed
    print(f"prefill blocks ({held:.2%} of its cache) freed {freed_after:.1f}s after decode "
          "resumed (lease: 30 s)")
    assert proxy_metric(stack, "pd_client_disconnects_total", stage="after_prefill") >= 1


def test_sixteen_concurrent_mixed_streams(stack):
    """16 streams of 50-2000 prompt tokens at once: all complete with [DONE], each text equals
    the decode engine's own greedy answer, and afterwards neither engine holds a request."""
    lengths = [50, 120, 300, 600, 1000, 1500, 2000, 80] * 2
    bodies = [chat(stack, n, 700 + i, max_tokens=12 + i % 5, stream=True)
              for i, n in enumerate(lengths)]
    texts: dict[int, str] = {}
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            with httpx.Client(timeout=300) as c, c.stream(
                    "POST", stack.proxy_url + "/v1/chat/completions", json=bodies[i]) as r:
                assert r.status_code == 200, r.read()
                lines = [ln for ln in r.iter_lines() if ln]
            assert lines[-1] == "data: [DONE]", lines[-2:]
            texts[i] = "".join(
                (json.loads(ln[6:])["choices"][0]["delta"].get("content") or "")
                for ln in lines[:-1] if json.loads(ln[6:])["choices"])
        except Exception as exc:  # noqa: BLE001 - reported below with the request's index
            errors.append(f"{i}: {type(exc).__name__}: {exc}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(bodies))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    assert not errors, errors
    assert len(texts) == 16
    settled(stack)  # zero running and waiting on both engines
    with httpx.Client(timeout=300) as c:
        for i, body in enumerate(bodies):
            direct = c.post(stack.decode_url + "/v1/chat/completions",
                            json=dict(body, stream=False), headers=stack.engine_headers).json()
            assert texts[i] == direct["choices"][0]["message"]["content"], i
