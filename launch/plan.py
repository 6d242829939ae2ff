"""``pdserve plan``: size a prefill->decode link before buying it.

Given a model config, a prefill rate and a link, it answers two questions with the same formulas
the proxy decides with (``transport/cost.py``):

* the **breakeven bandwidth**: below it, recomputing a token is faster than moving its KV,
  whatever the prompt length;
* the **crossover prompt length**: above the breakeven, the number of cached tokens from which
  moving them (link fixed cost + bytes / bandwidth) beats recomputing them on the decode engine.

The link presets are planning figures (per-direction payload bandwidth one transfer can use, and
the per-request fixed cost of a NIXL hand-over on that fabric), not measurements of your
hardware; pass ``--link <Gb/s>`` and ``--fixed-ms`` for your own numbers. The prefill model here is
linear (``--prefill-rate`` tokens/s); the live proxy fits a quadratic term as well.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transport.cost import LinkModel, PrefillModel, breakeven_bytes_per_s, crossover_tokens
from transport.kv_size import kv_bytes_per_token, kv_shape


@dataclass(frozen=True)
class LinkPreset:
    name: str
    gbit_per_s: float
    fixed_ms: float
    what: str


PRESETS: dict[str, LinkPreset] = {p.name: p for p in (
    LinkPreset("nvlink", 3600.0, 0.2, "NVLink 4 within a node (450 GB/s per direction)"),
    LinkPreset("pcie5", 400.0, 0.5, "PCIe Gen5 x16 via host/peer (~50 GB/s usable)"),
    LinkPreset("pcie4", 200.0, 0.5, "PCIe Gen4 x16 (~25 GB/s usable)"),
    LinkPreset("rdma400", 400.0, 1.0, "InfiniBand NDR / RoCE 400 Gb/s NIC"),
    LinkPreset("rdma200", 200.0, 1.0, "InfiniBand HDR / RoCE 200 Gb/s NIC"),
    LinkPreset("eth100", 100.0, 3.0, "100 Gb/s Ethernet over TCP"),
    LinkPreset("eth25", 25.0, 3.0, "25 Gb/s Ethernet over TCP"),
    LinkPreset("eth10", 10.0, 3.0, "10 Gb/s Ethernet over TCP"),
)}

TABLE_TOKENS = (128, 512, 2048, 8192, 32768)


@dataclass(frozen=True)
class LinkPlan:
    link: str
    gbit_per_s: float
    fixed_ms: float
    kv_bytes_per_token: int
    prefill_tokens_per_s: float
    breakeven_gbit_per_s: float
    crossover_tokens: int | None  # None: recompute always wins (link under the breakeven)
    rows: tuple[tuple[int, float, float], ...]  # (tokens, transfer ms, recompute ms)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "rows": [list(r) for r in self.rows]}


def resolve_link(link: str, fixed_ms: float | None) -> LinkPreset:
    """A preset name, or a bandwidth in Gb/s (fixed cost from ``fixed_ms``, default 1 ms)."""
    if link.lower() in PRESETS:
        preset = PRESETS[link.lower()]
        return preset if fixed_ms is None else LinkPreset(
            preset.name, preset.gbit_per_s, fixed_ms, preset.what)
    try:
        gbit = float(link)
    except ValueError:
        raise ValueError(
            f"unknown link {link!r}: give Gb/s or one of {', '.join(PRESETS)}") from None
    if not math.isfinite(gbit) or gbit <= 0:
        raise ValueError("link bandwidth must be a positive number of Gb/s")
    return LinkPreset(f"{gbit:g}Gb/s", gbit, 1.0 if fixed_ms is None else fixed_ms, "custom")


def plan_link(kv_bytes: int, prefill_tokens_per_s: float, link: LinkPreset) -> LinkPlan:
    """Pure: the breakeven and crossover for one model x prefill rate x link."""
    if prefill_tokens_per_s <= 0:
        raise ValueError("prefill rate must be positive tokens/s")
    if link.fixed_ms < 0:
        raise ValueError("fixed cost must be >= 0 ms")
    model = LinkModel(fixed_s=link.fixed_ms / 1e3, bytes_per_s=link.gbit_per_s * 1e9 / 8)
    recompute = PrefillModel(fixed_s=0.0, tokens_per_s=prefill_tokens_per_s)
    already_computed = PrefillModel(fixed_s=0.0, tokens_per_s=math.inf)  # KV sits on prefill
    rows = tuple(
        (n, model.seconds(n, kv_bytes) * 1e3, recompute.seconds(n) * 1e3) for n in TABLE_TOKENS)
    return LinkPlan(
        link=link.name, gbit_per_s=link.gbit_per_s, fixed_ms=link.fixed_ms,
        kv_bytes_per_token=kv_bytes, prefill_tokens_per_s=prefill_tokens_per_s,
        breakeven_gbit_per_s=breakeven_bytes_per_s(kv_bytes, prefill_tokens_per_s) * 8 / 1e9,
        crossover_tokens=crossover_tokens(kv_bytes, model, already_computed, recompute),
        rows=rows,
    )


def load_config(model: str) -> Mapping[str, Any]:
    """``model``: a config.json, a model directory, or a pdserve built-in name (built if needed)."""
    path = Path(model)
    if path.is_file():
        return json.loads(path.read_text())
    if path.is_dir():
        return json.loads((path / "config.json").read_text())
    from launch.models import KNOWN_MODELS, ensure_model

    if model in KNOWN_MODELS:
        return json.loads((Path(ensure_model(model)) / "config.json").read_text())
    raise ValueError(f"no model config at {model!r} (a config.json, a model directory, "
                     f"or one of {', '.join(KNOWN_MODELS)})")


def plan(config: Mapping[str, Any], kv_dtype: str, tp: int, prefill_tokens_per_s: float,
         links: list[LinkPreset]) -> list[LinkPlan]:
    kv_bytes = kv_bytes_per_token(kv_shape(config), kv_dtype, tp)
    return [plan_link(kv_bytes, prefill_tokens_per_s, link) for link in links]


def render(plans: list[LinkPlan]) -> str:
    first = plans[0]
    out = [f"KV per token (per TP rank's link): {first.kv_bytes_per_token:,} bytes; "
           f"prefill {first.prefill_tokens_per_s:,.0f} tokens/s",
           f"breakeven link bandwidth: {first.breakeven_gbit_per_s:.2f} Gb/s "
           "(below it, recomputing beats moving KV at any prompt length)", ""]
    header = f"{'link':<12}{'Gb/s':>8}{'fixed':>8}  {'moving cached KV wins from':<28}"
    header += "".join(f"{f'{n:,} tok':>18}" for n in TABLE_TOKENS)
    out += [header + "   (transfer / recompute ms)", "-" * len(header)]
    for p in plans:
        wins = ("never (under breakeven)" if p.crossover_tokens is None
                else f"{p.crossover_tokens:,} tokens")
        cells = "".join(f"{f'{t:.0f}/{r:.0f}':>18}" for _, t, r in p.rows)
        out.append(f"{p.link:<12}{p.gbit_per_s:>8g}{p.fixed_ms:>6g}ms  {wins:<28}{cells}")
    return "\n".join(out)
