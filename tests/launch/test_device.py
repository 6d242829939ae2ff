"""Which device the engines run on: torch is asked only on a machine with a GPU device node."""

from __future__ import annotations

import sys
import types

import pytest

from launch import engines


@pytest.fixture
def torch_sees_a_gpu(monkeypatch):
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: True))
    monkeypatch.setitem(sys.modules, "torch", fake)


@pytest.mark.parametrize("nodes, dxg, device", [
    ([], False, "cpu"),              # no device node: torch is not asked (it would say cuda)
    (["/dev/nvidia0"], False, "cuda"),
    ([], True, "cuda"),              # WSL
])
def test_torch_is_asked_only_where_a_gpu_node_exists(monkeypatch, torch_sees_a_gpu, nodes, dxg,
                                                      device):
    monkeypatch.setattr(engines.glob, "glob", lambda pattern: nodes)
    monkeypatch.setattr(engines.os.path, "exists", lambda path: dxg and path == "/dev/dxg")
    assert engines.detect_device() == device
