"""``pdserve node-watch`` (launch/node_watch.py): a worker node stops its Ray when the head's GCS
refuses connections, and never when the head is only out of reach. Its real test is
``tests/ray_up``: `ray down` on two nodes leaves nothing on the worker within 45 s."""

from __future__ import annotations

import socket
import threading

import pytest

from launch import node_watch
from launch.node_watch import head_is_gone, probe, watch


@pytest.mark.parametrize("recent, gone", [
    (["refused"] * 3, True),
    (["open", "refused", "refused", "refused"], True),
    (["refused", "refused"], False),  # not yet three
    (["refused", "silent", "refused"], False),  # out of reach once: maybe a partition
    (["silent"] * 10, False),
    (["refused", "refused", "open"], False),
])
def test_the_head_is_gone_only_after_three_refusals_in_a_row(recent, gone):
    assert head_is_gone(recent) is gone


def listener(backlog: int = 8) -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(backlog)
    return s


def test_a_probe_tells_open_refused_and_silent_apart():
    with listener() as s:
        address = "127.0.0.1:%d" % s.getsockname()[1]
        assert probe(address) == "open"
    assert probe(address) == "refused"  # closed: the host answers with a reset
    # A listener whose queue is full drops new SYNs (Linux): no answer, as over a cut link.
    with listener(backlog=0) as full:
        port = full.getsockname()[1]
        held = []
        for _ in range(4):
            c = socket.socket()
            c.setblocking(False)
            c.connect_ex(("127.0.0.1", port))
            held.append(c)
        try:
            assert probe(f"127.0.0.1:{port}", timeout_s=0.5) == "silent"
        finally:
            for c in held:
                c.close()


class Script:
    """The watch's world, scripted: what each probe finds and whether the raylet runs."""

    def __init__(self, probes: list[str], raylet: list[bool] | None = None) -> None:
        self.probes, self.raylet = list(probes), list(raylet or [True] * len(probes))
        self.stops = 0

    def run(self) -> str:
        def probe_head(_address: str) -> str:
            if not self.probes:
                raise AssertionError("the watch went on past the script")
            return self.probes.pop(0)

        def stop() -> None:
            self.stops += 1

        return watch("10.0.0.1:6379", probe_head=probe_head, stop=stop,
                     local_ray=lambda: self.raylet.pop(0) if self.raylet else True,
                     sleep=lambda _s: None)


def test_three_refusals_stop_this_nodes_ray_once():
    script = Script(["open", "open", "refused", "refused", "refused"])
    assert script.run() == "stopped"
    assert script.stops == 1 and not script.probes


def test_a_head_out_of_reach_never_stops_this_nodes_ray():
    # Silent for a long while, refusals never three in a row, then the raylet goes (Ray's own
    # reconnect timeout): the watch leaves without stopping anything.
    probes = ["silent"] * 30 + ["refused", "refused", "silent"] * 5 + ["silent"]
    script = Script(probes, raylet=[True] * (len(probes) - 1) + [False])
    assert script.run() == "raylet gone"
    assert script.stops == 0


def test_the_watch_waits_for_the_raylet_to_start_and_leaves_when_it_is_gone():
    script = Script(["open"] * 3, raylet=[False, True, False])
    assert script.run() == "raylet gone" and script.stops == 0


def test_a_real_gcs_port_that_closes_stops_the_node():
    """The real probe against a real port: open while it listens, then refused."""
    s = listener()
    address = "127.0.0.1:%d" % s.getsockname()[1]
    stops: list[float] = []
    seen: list[str] = []
    real_probe = node_watch.probe

    def probe_and_close(a: str) -> str:
        seen.append(real_probe(a))
        if len(seen) == 2:
            s.close()  # the head's `ray stop`
        return seen[-1]

    result: list[str] = []
    t = threading.Thread(target=lambda: result.append(watch(
        address, interval_s=0.01, probe_head=probe_and_close, local_ray=lambda: True,
        stop=lambda: stops.append(1))))
    t.start()
    t.join(10)
    assert result == ["stopped"] and stops == [1]
    assert seen == ["open", "open", "refused", "refused", "refused"]
