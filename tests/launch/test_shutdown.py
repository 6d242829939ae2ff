"""A launcher's proxy server stops on SIGHUP like on SIGTERM: it stops serving, the launcher's
``finally`` runs (where the engines are stopped), and the exit code says SIGHUP. Checked under
constant requests, which is when a raising signal handler lands inside an event-loop callback
(uvloop then logs it and serves on: what CI saw)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx

CHILD = r"""
import signal, sys, uvicorn
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from launch.shutdown import run_server

async def hello(request):
    await request.body()
    return PlainTextResponse("ok")

signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))  # the launcher's, before serving
app = Starlette(routes=[Route("/", hello, methods=["GET", "POST"])])
server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=int(sys.argv[1]),
                                       loop="uvloop", log_level="warning"))
try:
    code = run_server(server)
finally:
    print("cleanup ran", flush=True)
sys.exit(code)
"""


def test_sighup_under_load_stops_the_server_and_runs_the_launchers_cleanup():
    port = 28950
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(port)], stdout=subprocess.PIPE,
                             text=True)
    stop = threading.Event()

    body = b"x" * (4 << 20)  # big bodies: many reads, the loop mostly inside transport callbacks

    def load() -> None:
        with httpx.Client(timeout=2) as c:
            while not stop.is_set():
                try:
                    c.post(f"http://127.0.0.1:{port}/", content=body)
                except httpx.HTTPError:
                    time.sleep(0.01)

    clients = [threading.Thread(target=load) for _ in range(6)]
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and child.poll() is None, "server never up"
            time.sleep(0.1)
        for t in clients:
            t.start()
        time.sleep(0.5)
        child.send_signal(signal.SIGHUP)
        out, _ = child.communicate(timeout=20)
    finally:
        stop.set()
        for t in clients:
            t.join(5)
        if child.poll() is None:
            child.kill()
    assert child.returncode == 129, child.returncode
    assert "cleanup ran" in out
