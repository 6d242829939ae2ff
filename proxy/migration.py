"""Stream migration: a decode engine lost mid-stream is not the client's problem.

A stream cut after some tokens is a new prompt: the original prompt's token ids plus the ids
already relayed (``proxy/transcript.py`` keeps both). Another healthy decode engine, given that
prompt, ``max_tokens`` less what was delivered and the same sampling parameters, continues the
answer; the continuation is planned like any request (``Orchestrator.serve`` with the decode
engine pinned), so the cost model chooses whether its KV is computed there, found in that
engine's prefix cache or tier, or prefilled elsewhere and moved. With greedy decoding the
client cannot tell: one ``id``, no token twice or missing, one ``finish_reason``, one
``[DONE]``, ``usage`` counting the original prompt once. Up to ``limit`` migrations per stream
(``--migration-limit``); past it, or with no other engine, the stream ends with the in-band
error it would have had without migration. Lost means: its connection dropped (``DecodeLost``),
silent past the idle deadline (``DecodeStalled``), or its own in-band error event with a 5xx
code (``DecodeErrored``: vLLM's engine core died while its API server lives on; the
transcript withholds that event).

What is not continued (:func:`not_migratable`; the in-band error as before): log
probabilities, ``echo``, stop strings (the engine holds text back while matching them: text a
continuation would lose), structured output (tools, ``response_format``, guided decoding: the
grammar's state does not carry over), media in a chat (its ids do not carry it), and tokens
delivered by an engine that sent no prompt ids (``unknown_prompt``). (``n`` > 1 never gets
this far: the proxy serves n=1 only.) Continued, but not what an uninterrupted run would have
sent: sampling (a ``seed`` restarts its generator: the continuation is a fresh sample, seeded),
and presence / frequency penalties (they count output tokens, and the delivered ones become
prompt). A non-streamed request that fails while answering has delivered nothing: it is served
again, whole, on another decode engine (``Orchestrator.serve``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import replace
from typing import Any

from proxy.engine_bodies import stated_output_budget
from proxy.errors import DecodeErrored, DecodeLost, DecodeStalled, ProxyError
from proxy.metrics import ProxyMetrics
from proxy.requests import ApiRequest, is_batch
from proxy.transcript import Transcript

log = logging.getLogger(__name__)

#: ``resume(request, failed engines)``: serve ``request`` on a decode engine other than those
#: that failed, returning its chunks and that engine's name (raises a ProxyError when it
#: cannot: a ``DecodeLost`` when the engine it tried failed before answering).
Resume = Callable[[ApiRequest, frozenset[str]],
                  Awaitable[tuple[AsyncIterator[bytes | ProxyError], str]]]

#: The chat fields a completion of token ids takes over (sampling and output controls).
_CARRIED_FROM_CHAT = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty",
    "frequency_penalty", "repetition_penalty", "logit_bias", "ignore_eos", "min_tokens",
    "stop_token_ids", "skip_special_tokens", "spaces_between_special_tokens", "user",
    "stream", "stream_options", "bad_words", "allowed_token_ids", "priority",
    "include_stop_str_in_output", "length_penalty", "vllm_xargs", "cache_salt",
)
#: A completion's fields a continuation leaves out: its prompt is new, and already cut to size.
_NOT_CARRIED = ("prompt", "suffix", "truncate_prompt_tokens", "truncation_side")
_STRUCTURED = ("tools", "functions", "guided_json", "guided_regex", "guided_choice",
               "guided_grammar", "structured_outputs")


def not_migratable(body: Mapping[str, Any]) -> str | None:
    """Why a continuation of this request could not be what the client asked for (None: it
    can be continued)."""
    logprobs = body.get("logprobs")
    if (logprobs is not None and logprobs is not False) or body.get("top_logprobs") or (
            body.get("prompt_logprobs") is not None):
        return "logprobs"
    if body.get("echo"):
        return "echo"
    if is_batch(body):
        return "batch"  # (its choices' token ids are interleaved in one stream)
    if body.get("stop"):
        return "stop_strings"
    format_ = body.get("response_format")
    if any(body.get(k) for k in _STRUCTURED) or (
            isinstance(format_, Mapping) and format_.get("type") not in (None, "text")):
        return "structured_output"
    if any(isinstance(m, Mapping) and isinstance(m.get("content"), list) and any(
            isinstance(part, Mapping) and part.get("type") != "text" for part in m["content"])
           for m in body.get("messages") or ()):
        return "multimodal"  # its token ids alone do not carry the image or sound
    return None


def with_token_ids(req: ApiRequest) -> ApiRequest:
    """``req`` asking its engines for the token ids a continuation needs."""
    return replace(req, body={**req.body, "return_token_ids": True})


#: vLLM's (and OpenAI's) ``max_tokens`` for a completion that sets none.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def budget_left(req: ApiRequest, transcript: Transcript, max_model_len: int | None
                ) -> int | None:
    """Tokens the request may still generate: its ``max_tokens`` (a completion's default when
    unset) less what was delivered; a chat request that set none may fill the context. None:
    not known (a chat request without ``max_tokens``, the context length not configured)."""
    budget = stated_output_budget(req.body)
    if budget is None:
        if req.endpoint == "completions":
            budget = COMPLETIONS_DEFAULT_MAX_TOKENS
        elif max_model_len is not None and transcript.prompt_ids is not None:
            budget = max_model_len - len(transcript.prompt_ids)
        else:
            return None
    return budget - len(transcript.output_ids)


def continuation(req: ApiRequest, transcript: Transcript, left: int) -> ApiRequest:
    """The request that continues ``req`` after what ``transcript`` delivered, ``left``
    tokens to go. Nothing delivered yet: ``req`` itself (on another engine). Else a completion
    of the prompt's ids plus the delivered ones, ``max_tokens`` ``left`` and ``min_tokens``
    less what was delivered."""
    if not transcript.output_ids or transcript.prompt_ids is None:
        return req
    done = len(transcript.output_ids)
    body = req.body
    if req.endpoint == "chat":
        out = {k: body[k] for k in _CARRIED_FROM_CHAT if k in body}
    else:
        out = {k: v for k, v in body.items() if k not in _NOT_CARRIED}
    out.pop("max_completion_tokens", None)
    out["prompt"] = transcript.prompt_ids + transcript.output_ids
    out["return_token_ids"] = True
    out["max_tokens"] = left
    if isinstance(body.get("min_tokens"), int):
        out["min_tokens"] = max(0, body["min_tokens"] - done)
    return replace(req, endpoint="completions", body=out, force_route=None)


async def migrating(req: ApiRequest, chunks: AsyncIterator[bytes | ProxyError], engine: str,
                    resume: Resume, limit: int, metrics: ProxyMetrics,
                    max_model_len: int | None, why_not: str | None
                    ) -> AsyncIterator[bytes | ProxyError]:
    """The client's stream: ``chunks`` (a relay from decode engine ``engine``),
    continued through ``resume`` when its engine is lost, up to ``limit`` times. ``req`` is
    the client's request (without the token ids asked for it); a request that is not
    migratable (``why_not``: :func:`not_migratable`'s answer, or why migration is off)
    passes through untouched.
    ``max_model_len``: the engines' context (a chat request without ``max_tokens`` may fill
    it)."""
    transcript = (Transcript(req.endpoint == "chat", bool(req.body.get("return_token_ids")))
                  if why_not is None else None)
    migrations = 0
    failed: set[str] = set()  # the engines lost from under this stream
    t_lost = 0.0  # when the engine being continued from was lost (0: not continuing)
    try:
        while True:
            failure: DecodeLost | DecodeStalled | None = None
            async for item in chunks:
                if isinstance(item, DecodeLost | DecodeStalled):
                    failure = item
                    break
                if isinstance(item, ProxyError):
                    yield item
                    continue
                out = item if transcript is None else transcript.feed(item)
                if out:
                    if t_lost:  # the continuation's first bytes: the gap the client saw
                        metrics.migration_seconds.labels("first_token").observe(
                            time.perf_counter() - t_lost)
                        t_lost = 0.0
                    yield out
                if transcript is not None and transcript.engine_error is not None:
                    log.warning("%s: decode %s failed mid-stream: %s", req.request_id, engine,
                                transcript.engine_error)
                    failure = DecodeErrored("the decode engine failed mid-stream",
                                            engine=engine)
                    break
            if failure is None:
                return
            t_lost = time.perf_counter()
            reason = ("decode_error" if isinstance(failure, DecodeErrored) else
                      "decode_lost" if isinstance(failure, DecodeLost) else "decode_timeout")
            await _close(chunks)  # the lost leg's cleanup (its claim, its stream) runs now
            left = budget_left(req, transcript, max_model_len) if transcript else None
            if transcript is not None and (transcript.finished or left == 0):
                # Every token is out, only the stream's end was lost: end it here.
                metrics.migrations_total.labels(f"{reason}_at_end").inc()
                yield transcript.closing(bool((req.body.get("stream_options") or {}).get(
                    "include_usage")))
                return
            failed.add(failure.engine)
            while True:
                refused = _refused(why_not, transcript, migrations, limit, left)
                if refused is not None or transcript is None or left is None:
                    metrics.migrations_failed_total.labels(refused or "disabled").inc()
                    yield _given_up(req, failure, reason, metrics)
                    return
                nxt = continuation(with_token_ids(req), transcript, left)
                try:
                    chunks, engine = await resume(nxt, frozenset(failed))
                    break
                except DecodeLost as exc:  # it failed before answering: another, if allowed
                    log.warning("%s: continuation on %s failed: %s", req.request_id,
                                exc.engine, exc.message)
                    migrations += 1
                    failed.add(exc.engine)
                    metrics.migrations_total.labels(reason).inc()
                except ProxyError as exc:
                    log.warning("%s: no continuation after %s (%s)", req.request_id, reason,
                                exc.message)
                    metrics.migrations_failed_total.labels("no_engine").inc()
                    yield _given_up(req, failure, reason, metrics)
                    return
            migrations += 1
            if req.spans is not None:
                req.spans.annotate(migrations=migrations)
            transcript.continued(as_completion=nxt.endpoint != req.endpoint)
            metrics.migrations_total.labels(reason).inc()
            resumed = time.perf_counter() - t_lost
            metrics.migration_seconds.labels("resumed").observe(resumed)
            log.info("%s: stream continued after %s (%d tokens delivered, %.0f ms to resume)",
                     req.request_id, reason, len(transcript.output_ids), 1e3 * resumed)
    finally:
        await _close(chunks)


def _refused(why_not: str | None, transcript: Transcript | None, migrations: int, limit: int,
             left: int | None) -> str | None:
    """Why the stream is not continued now (None: it is)."""
    if why_not is not None or transcript is None:
        return why_not or "disabled"
    if migrations >= limit:
        return "limit"
    if left is None:
        return "unknown_budget"
    if transcript.output_ids and transcript.prompt_ids is None:
        return "unknown_prompt"  # a continuation would start the answer over
    return None


def _given_up(req: ApiRequest, failure: ProxyError, reason: str, metrics: ProxyMetrics
              ) -> ProxyError:
    """The stream ends with ``failure`` in band: counted, and the request's trace says so."""
    metrics.stream_errors_total.labels(reason).inc()
    if req.spans is not None:
        req.spans.failed(failure.status, failure.type)
    return failure


async def _close(chunks: AsyncIterator[bytes | ProxyError]) -> None:
    aclose = getattr(chunks, "aclose", None)
    if aclose is not None:
        await aclose()
