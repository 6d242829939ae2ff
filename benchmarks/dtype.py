"""float32 or bfloat16 on a CPU engine: how fast, and does the model still answer?

pdserve's CPU default is float32 (``launch/engines.py`` ``default_dtype``), even where AMX makes
bf16 native. This measures what that costs: per round and arm, a fresh ``pdserve dev``
(SmolLM2 by default, ``--policy local``: the decode engine computes every prompt itself) with
``--dtype`` set, then

- the golden question ("What is the capital of France?", greedy): its answer, and whether it
  names Paris;
- ``--prompts`` prompts of ``--prompt-tokens`` tokens, each new (no prefix cache), one at a
  time: TTFT (a prefill) and the gaps between the answer's tokens (decode steps).

Arms alternate (ABAB...), since the dtype is fixed when an engine starts; each round starts
its stack from nothing. Reported per arm: TTFT and gap p50 per round, their bf16 / float32
ratios, and the answers.

Run: ``python -m benchmarks.dtype`` (``--help``). Writes ``benchmarks/results/dtype.json``
and ``.png``.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from typing import Any

import aiohttp

from benchmarks.common import ROOT, exit_on_sigterm, log, percentile, save_results, timed_stream
from harness.prompts import text_of_tokens
from harness.stack import start_dev

ARMS = ("float32", "bfloat16")
QUESTION = "What is the capital of France?"


async def measure(stack, prompts: int, prompt_tokens: int, max_tokens: int, seed: int,
                  model: str) -> dict[str, Any]:
    url = stack.proxy_url + "/v1/chat/completions"
    async with aiohttp.ClientSession() as session:
        golden = await timed_stream(session, url, {
            "model": stack.model_name, "messages": [{"role": "user", "content": QUESTION}],
            "max_tokens": 32, "temperature": 0, "stream": True})
        ttft, gaps = [], []
        for i in range(prompts):
            body = {"model": stack.model_name, "temperature": 0, "stream": True,
                    "max_tokens": max_tokens, "ignore_eos": True,
                    "messages": [{"role": "user", "content": text_of_tokens(
                        prompt_tokens, seed=seed + i, model=model)}]}
            t = await timed_stream(session, url, body)
            assert t.error is None and t.ttft_s is not None, t.error
            ttft.append(t.ttft_s)
            gaps.extend(t.gaps_s)
    return {"answer": golden.text, "paris": "Paris" in golden.text,
            "ttft_s": ttft, "ttft_p50_s": statistics.median(ttft),
            "gap_p50_s": percentile(gaps, 50), "gap_p90_s": percentile(gaps, 90)}


def run(args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict[str, Any]] = []
    log_dir = ROOT / ".pdserve" / "bench-dtype"
    for r in range(args.rounds):
        for arm in (ARMS if r % 2 == 0 else ARMS[::-1]):
            log(f"round {r + 1}/{args.rounds}: {arm}: starting pdserve dev ...")
            stack = start_dev(args.model, port=args.port, engine_base_port=args.port + 100,
                              side_channel_base_port=args.port + 200,
                              log_dir=log_dir / f"{r}-{arm}", policy="local",
                              extra=["--dtype", arm, "--probe-tokens", ""])
            try:
                got = measure(stack, args.prompts, args.prompt_tokens, args.max_tokens,
                              seed=1000 * (r + 1), model=args.model)
                result = asyncio.run(got)
            finally:
                stack.stop()
            log(f"  {arm}: TTFT p50 {1e3 * result['ttft_p50_s']:.0f} ms, gap p50 "
                f"{1e3 * result['gap_p50_s']:.1f} ms; golden answer: {result['answer'][:60]!r}")
            rounds.append({"round": r, "arm": arm, **result})
    summary: dict[str, Any] = {}
    for key in ("ttft_p50_s", "gap_p50_s"):
        by_round = [
            next(x[key] for x in rounds if x["round"] == r and x["arm"] == "bfloat16")
            / next(x[key] for x in rounds if x["round"] == r and x["arm"] == "float32")
            for r in range(args.rounds)]
        summary[f"{key}_bf16_over_f32"] = by_round
    summary["paris"] = {arm: [x["paris"] for x in rounds if x["arm"] == arm] for arm in ARMS}
    return {"config": vars(args), "rounds": rounds, "summary": summary}


def plot(payload: dict[str, Any]):
    def draw(fig) -> None:
        for i, (key, title) in enumerate((("ttft_p50_s", "TTFT p50 (prefill), ms"),
                                          ("gap_p50_s", "gap between tokens p50, ms"))):
            ax = fig.add_subplot(1, 2, i + 1)
            for arm in ARMS:
                xs = [x["round"] for x in payload["rounds"] if x["arm"] == arm]
                ys = [1e3 * x[key] for x in payload["rounds"] if x["arm"] == arm]
                ax.plot(xs, ys, "o-", label=arm)
            ax.set_title(title)
            ax.set_xlabel("round")
            ax.legend()
    return draw


def main() -> None:
    exit_on_sigterm()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--port", type=int, default=23400)
    args = p.parse_args()
    payload = run(args)
    for key, ratios in payload["summary"].items():
        log(f"{key}: {ratios}")
    json_path, png_path = save_results("dtype", payload, plot(payload))
    log(f"wrote {json_path} and {png_path}")


if __name__ == "__main__":
    main()
