"""Long prompts do not stall the proxy: they are measured off the event loop, and one surely
over the context is refused without being tokenized (real tokenizer: the tiny model's)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import pytest

from harness.fake_engine import FakeEngine
from harness.live_proxy import proxy_config
from proxy import tokenizer_pool
from proxy.app import create_app
from proxy.costs import RouteCosts
from proxy.deadlines import Deadlines
from proxy.metrics import ProxyMetrics
from proxy.orchestrator import Orchestrator
from proxy.policy import parse_policy
from proxy.pool import EnginePool
from proxy.requests import ApiRequest
from proxy.tokenizer_pool import TokenizerPool
from proxy.tokens import PromptTokenizer, TokenizerInfo, surely_over_context
from transport.kv_events import BlocksStored

WORDS = "river stone lantern orbit meadow copper signal harbor velvet thunder".split()
BS = 16


@pytest.fixture(scope="module")
def tiny_dir() -> str:
    from launch.models import ensure_model

    return str(ensure_model("tiny"))


def words(n: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def max_lag_while(work: asyncio.Task, interval_s: float = 0.001) -> float:
    """The longest a 1 ms timer on this loop ran late while ``work`` ran."""
    loop = asyncio.get_running_loop()
    worst = 0.0
    while not work.done():
        due = loop.time() + interval_s
        await asyncio.sleep(interval_s)
        worst = max(worst, loop.time() - due)
    return worst


class _Named:
    def __init__(self, name: str):
        self.name = name


async def test_planning_a_100k_token_prompt_leaves_the_loop_free(tiny_dir):
    """While the orchestrator plans a ~100k-token prompt (tokenize, look its blocks up), a
    coroutine on the same loop keeps waking on time. On the loop, the same planning held it
    for the whole tokenization (124 ms for 168k tokens here)."""
    pool = await TokenizerPool.start(tiny_dir, workers=1, inline_chars=1000)
    try:
        engines = EnginePool([_Named("p0")], [_Named("d0")], ProxyMetrics())
        for e in engines.all():
            e.healthy = True
            e.index.apply([BlocksStored((1,), None, tuple(range(BS)), BS, "GPU")])
        orch = Orchestrator(engines, parse_policy("threshold:0"), Deadlines(), ProxyMetrics(),
                            RouteCosts(1000), prompts=pool)
        body = {"model": "m", "messages": [{"role": "user", "content": words(36_000)}]}
        t0 = time.perf_counter()
        planning = asyncio.create_task(orch.plan(ApiRequest("chat", body, False, "r")))
        lag = await max_lag_while(planning)
        plan = await planning
        took = time.perf_counter() - t0
        print(f"planned {plan.prompt_tokens} tokens in {took * 1e3:.0f} ms; "
              f"worst loop lag {lag * 1e3:.1f} ms")
        assert plan.prompt_tokens > 90_000  # really tokenized, not estimated
        assert lag < 0.05, f"the loop was held {lag * 1e3:.0f} ms"
    finally:
        await pool.close()


async def test_measurements_match_the_tokenizer_and_the_index(tiny_dir):
    """What the workers return is what tokenizing here gives: the length, and block keys that
    find the prefix an engine's index holds (keys hash the same in every process)."""
    pool = await TokenizerPool.start(tiny_dir, workers=1, inline_chars=0)
    try:
        body = {"prompt": words(3000, seed=7)}
        ids = PromptTokenizer(tiny_dir).ids(body)
        assert ids is not None
        measured = await pool.measure(body, [BS])
        assert measured is not None and measured.n_tokens == len(ids)
        engines = EnginePool([], [_Named("d0")], ProxyMetrics())
        index = engines.decode[0].index
        index.apply([BlocksStored(tuple(range(10)), None, tuple(ids[:10 * BS]), BS, "GPU")])
        assert index.cached_keys(measured.keys(BS)) == 10 * BS
        assert await pool.ids(body) == ids
    finally:
        await pool.close()


async def test_a_dead_worker_is_replaced(tiny_dir):
    pool = await TokenizerPool.start(tiny_dir, workers=1, inline_chars=0)
    try:
        (worker,) = pool._workers
        worker.proc.kill()  # a worker killed outright
        await worker.proc.wait()
        body = {"prompt": words(500)}
        assert await pool.measure(body, [BS]) is None  # the proxy estimates this one instead
        measured = await pool.measure(body, [BS])  # waits for the replacement, which answers
        assert measured is not None and measured.n_tokens > 0
        assert pool._workers[0] is not worker
    finally:
        await pool.close()


async def test_a_worker_outlives_the_terminals_ctrl_c(tiny_dir):
    """Ctrl-C reaches the whole foreground group: the proxy drains, and its workers, which
    used to die of it, must keep serving the requests still in flight."""
    pool = await TokenizerPool.start(tiny_dir, workers=1, inline_chars=0)
    try:
        (worker,) = pool._workers
        worker.proc.send_signal(signal.SIGINT)
        measured = await pool.measure({"prompt": words(500)}, [BS])
        assert measured is not None and pool._workers[0] is worker
        assert worker.proc.returncode is None
    finally:
        await pool.close()


async def test_a_hung_worker_is_replaced_and_holds_no_caller(tiny_dir, monkeypatch):
    """A worker that stops answering (SIGSTOP here; a stuck tokenizer, a pipe out of step)
    would hold its caller, and every prompt queued behind it, for good."""
    monkeypatch.setattr(tokenizer_pool, "CALL_TIMEOUT_S", 0.5)
    pool = await TokenizerPool.start(tiny_dir, workers=1, inline_chars=0)
    try:
        (worker,) = pool._workers
        os.kill(worker.proc.pid, signal.SIGSTOP)
        body = {"prompt": words(500)}
        assert await asyncio.wait_for(pool.measure(body, [BS]), 5) is None
        measured = await asyncio.wait_for(pool.measure(body, [BS]), 60)
        assert measured is not None and measured.n_tokens > 0
        assert pool._workers[0] is not worker
    finally:
        await pool.close()


@pytest.mark.parametrize(("body", "over"), [
    ({"prompt": "x" * 6401}, True),  # 6401 chars, at most 2 chars a token: > 3200 tokens
    ({"prompt": "x" * 6400}, False),  # may fit: the engine decides
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "x" * 7000}]}]}, True),
    ({"prompt": list(range(3201))}, True),  # token ids: exact
    ({"prompt": list(range(3200))}, False),
])
def test_surely_over_context(body, over):
    info = TokenizerInfo(max_token_chars=2, normalizes=False)
    assert (surely_over_context(body, 3200, info) is not None) is over


def test_a_normalizing_tokenizer_gets_a_margin():
    info = TokenizerInfo(max_token_chars=2, normalizes=True)
    assert surely_over_context({"prompt": "x" * 6401}, 3200, info) is None


async def test_an_over_context_prompt_is_refused_untokenized(tiny_dir, prefill: FakeEngine,
                                                             decode: FakeEngine, monkeypatch):
    """A prompt far beyond the context gets its 400 from the character bound alone: the
    tokenizer is never called for it and no engine sees it. One that may fit is tokenized."""
    calls = []
    real_ids = PromptTokenizer.ids

    def counting_ids(self, body):
        calls.append(len(str(body)))
        return real_ids(self, body)

    monkeypatch.setattr(PromptTokenizer, "ids", counting_ids)  # everything inline: counted
    config = proxy_config(prefill, decode, tokenizer=tiny_dir, max_model_len=4096,
                          policy="threshold:0", tokenizer_inline_chars=1 << 30)
    app = create_app(config)
    async with app.router.lifespan_context(app):
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://proxy") as client:
            calls.clear()  # start-up itself tokenizes (the pool's warm-up)
            huge = {"model": "m", "messages": [{"role": "user", "content": words(200_000)}]}
            r = await client.post("/v1/chat/completions", json=huge)
            assert r.status_code == 400, r.text
            err = r.json()["error"]
            assert err["type"] == "invalid_request_error" and err["param"] == "messages"
            assert "maximum context length is 4096 tokens" in err["message"]
            assert calls == []  # never tokenized
            assert prefill.completion_requests == [] and decode.completion_requests == []

            fits = {"model": "m", "messages": [{"role": "user", "content": words(100)}]}
            r = await client.post("/v1/chat/completions", json=fits)
            assert r.status_code == 200, r.text
            assert len(calls) == 1  # a prompt that may fit is tokenized (once)


async def test_a_cancelled_call_leaves_the_worker_in_step(tiny_dir):
    """A caller that gives up (its client left) does not desynchronise the worker: the next
    call on it gets its own answer, not the abandoned one's."""
    pool = await TokenizerPool.start(tiny_dir, workers=1, inline_chars=0)
    try:
        local = PromptTokenizer(tiny_dir)
        long_call = asyncio.create_task(pool.measure({"prompt": words(20_000, seed=1)}, [BS]))
        await asyncio.sleep(0.01)
        long_call.cancel()
        short = {"prompt": words(300, seed=2)}
        measured = await pool.measure(short, [BS])
        assert measured is not None and measured.n_tokens == len(local.ids(short))
    finally:
        await pool.close()


async def test_a_burst_queues_and_every_answer_is_its_own(tiny_dir):
    pool = await TokenizerPool.start(tiny_dir, workers=2, inline_chars=0)
    try:
        local = PromptTokenizer(tiny_dir)
        bodies = [{"prompt": words(200 + 150 * i, seed=i)} for i in range(8)]
        got = await asyncio.gather(*(pool.measure(b, [BS]) for b in bodies))
        assert [m.n_tokens for m in got] == [len(local.ids(b)) for b in bodies]
    finally:
        await pool.close()


@pytest.mark.parametrize("extra", [
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
    {"chat_template_kwargs": {"enable_thinking": False}},
    {"continue_final_message": True, "add_generation_prompt": False},
    {"add_generation_prompt": False},
    {"chat_template": "{{ messages[0]['content'] }}"},
    {"add_special_tokens": True},
])
async def test_a_chat_vllm_renders_otherwise_is_not_measured_here(tiny_dir, extra):
    """The proxy renders a chat's messages alone: with any of these, vLLM's prompt is another
    length, with other blocks. Its characters size it instead, as when no tokenizer is loaded."""
    pool = await TokenizerPool.start(tiny_dir, workers=1, inline_chars=1000)
    try:
        chat = {"messages": [{"role": "user", "content": words(50)}]}
        assert await pool.measure(chat, [BS]) is not None
        assert await pool.measure({**chat, **extra}, [BS]) is None  # (measured in the caller)
        long = {"messages": [{"role": "user", "content": words(500)}], **extra}
        assert await pool.measure(long, [BS]) is None  # (a worker's)
    finally:
        await pool.close()


def test_a_completion_without_special_tokens_is_not_measured_here(tiny_dir):
    tokenizer = PromptTokenizer(tiny_dir)
    assert tokenizer.ids({"prompt": "hello"}) is not None
    assert tokenizer.ids({"prompt": "hello", "add_special_tokens": False}) is None


async def test_a_salted_prompt_is_measured_with_its_salt(tiny_dir):
    """``cache_salt`` is in vLLM's hash of block 0 and so of every block: the keys the proxy
    looks up carry it (computed in the worker), or the prompt's own cached blocks go unseen."""
    from proxy.prefix_index import block_keys

    pool = await TokenizerPool.start(tiny_dir, workers=1, inline_chars=0)
    try:
        body = {"prompt": words(200, seed=3)}
        ids = PromptTokenizer(tiny_dir).ids(body)
        salted = await pool.measure({**body, "cache_salt": "tenant-a"}, [BS])
        plain = await pool.measure(body, [BS])
        assert list(salted.keys(BS)) == list(block_keys(ids, BS, "tenant-a"))
        assert list(plain.keys(BS)) == list(block_keys(ids, BS))
        assert not set(salted.keys(BS)) & set(plain.keys(BS))
    finally:
        await pool.close()


@pytest.mark.parametrize("body", [{"prompt": 5}, {"messages": 5}, {"prompt": ""},
                                  {"model": "other", "prompt": "hi"}])
async def test_a_bad_lookup_body_is_a_4xx_not_a_500(tiny_dir, prefill, decode, body):
    """``/pd/lookup`` checks the body as the API routes do."""
    app = create_app(proxy_config(prefill, decode, tokenizer=tiny_dir))
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, raise_app_exceptions=False)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            resp = await client.post("/pd/lookup", json=body)
            good = await client.post("/pd/lookup", json={"prompt": "hello there"})
    assert resp.status_code in (400, 404), resp.text
    assert resp.json()["error"]["type"] in ("invalid_request_error", "not_found_error")
    assert good.status_code == 200 and good.json()["prompt_tokens"] > 0
