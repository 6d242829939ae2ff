"""What each route is predicted to cost: the arriving request's time to first token, and the
longest gap it puts between the tokens of the streams decoding beside it. Pure functions of
the frozen inputs (``proxy/route_inputs.py``); the policy decides from them
(``proxy/policy.py``)."""

from __future__ import annotations

from proxy.route_inputs import CostInputs, RouteInputs, exposure
from transport.cost import StepModel


def predict(inputs: RouteInputs, costs: CostInputs) -> tuple[float, float]:
    """Predicted seconds to first token: (disaggregated, local)."""
    n = inputs.prompt_tokens
    remote_new = max(0, n - inputs.prefill_cached_tokens)
    local_new = max(0, n - inputs.decode_cached_tokens)
    moved = local_new  # decode loads its own cached prefix and pulls only the rest
    # The decode engine takes the KV in and computes the first token in its own steps, after
    # the prompt work queued there before it (vLLM schedules what runs before what waits): a
    # short prompt prefilled elsewhere while a long one is computed there waits for it too
    # (SmolLM2, 64 tokens behind 1,024 prefilled on the decode engine: 4.4-4.8 s, as local).
    # A prefill engine that decodes too (one pool) computes the prompt beside its streams.
    remote = costs.remote_prefill.seconds(remote_new) + sum(
        _beside_streams(costs.prefill_step, inputs.prefill_streams, remote_new, chunk)
        for chunk in (0, costs.chunk_tokens))
    # Each route's factor: what its requests measured against the model (``ttft_correction``).
    to_disagg, to_local = costs.ttft_correction
    disagg = to_disagg * (max(costs.prefill_queue_s + remote, costs.decode_queue_s)
                          + costs.link.seconds(moved, costs.kv_bytes_per_token))
    local = to_local * (costs.decode_queue_s + costs.local_prefill.seconds(local_new)
                        + _beside_streams(costs.decode_step, inputs.streams, local_new, 0))
    streams, _ = exposure(inputs, local)  # the ones that decode while its chunks run
    local += to_local * _beside_streams(costs.decode_step, streams, local_new, costs.chunk_tokens)
    return disagg, local


def _beside_streams(step: StepModel | None, streams: int, new_tokens: int,
                    chunk_tokens: int) -> float:
    """What streams decoding on the engine add to a prompt computed there (its fit is timed
    alone). ``chunk_tokens`` 0: the wait for the step in flight, half of one on average (beside
    streams, 64-token prompts took 4.6-11 ms more on tiny, 17-32 ms on SmolLM2, growing with
    the streams; goodput runs s36, s37); else each chunk's step decoding them too."""
    if step is None or streams <= 0 or new_tokens <= 0:
        return 0.0
    if chunk_tokens <= 0:
        return 0.5 * step.seconds(0, streams)
    return _chunks(new_tokens, chunk_tokens) * step.stream_s * streams


def _chunks(tokens: int, chunk_tokens: int) -> int:
    return -(-tokens // max(1, chunk_tokens)) if tokens > 0 else 0


def predict_gaps(inputs: RouteInputs, costs: CostInputs,
                 predicted: tuple[float, float] | None = None
                 ) -> tuple[float | None, float | None]:
    """The longest gap between the running streams' tokens each route causes: (disaggregated,
    local): the step during which the KV comes in, or the one that computes the largest prompt
    chunk (``StepModel.handover_gap``, ``local_gap``), with the streams exposed until the
    route's first token (``predicted``: the TTFTs, else ``predict``'s); None for none, or no
    step model."""
    step = costs.decode_step
    if step is None:
        return None, None
    predicted = predicted or predict(inputs, costs)
    new = max(0, inputs.prompt_tokens - inputs.decode_cached_tokens)
    disagg, local = exposure(inputs, predicted[0])[0], exposure(inputs, predicted[1])[0]
    return (step.handover_gap(disagg, new) if disagg > 0 else None,
            step.local_gap(new, costs.chunk_tokens, local) if local > 0 else None)


def predict_prefill_gap(inputs: RouteInputs, costs: CostInputs) -> float | None:
    """The longest gap the disaggregated route's prefill puts between the tokens of the streams
    decoding on the prefill engine (an engine serving both roles): its largest chunk's step, as
    a local prefill there would. None: no streams there, nothing to compute, or no step model."""
    new = max(0, inputs.prompt_tokens - inputs.prefill_cached_tokens)
    step = costs.prefill_step
    if step is None or inputs.prefill_streams <= 0 or new == 0 or not inputs.prefill_available:
        return None
    return step.local_gap(new, costs.chunk_tokens, inputs.prefill_streams)
