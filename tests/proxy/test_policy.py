"""proxy/policy.py: which route a request takes, table-driven."""

from __future__ import annotations

import pydantic
import pytest

from proxy.config import ProxyConfig
from proxy.policy import Decision, PolicyMode, RouteInputs, decide, parse_policy

VALID = [
    ("disaggregate", PolicyMode("disaggregate")),
    ("local", PolicyMode("local")),
    ("threshold:0", PolicyMode("threshold", 0)),
    ("threshold:1", PolicyMode("threshold", 1)),
    ("threshold:512", PolicyMode("threshold", 512)),
]


@pytest.mark.parametrize(("text", "mode"), VALID, ids=[t for t, _ in VALID])
def test_parse_policy_valid(text: str, mode: PolicyMode) -> None:
    assert parse_policy(text) == mode
    assert str(parse_policy(text)) == text  # prints back the way it was written


INVALID = [
    "",
    "Local",
    "DISAGGREGATE",
    "always",
    "threshold",
    "threshold:",
    "threshold:-1",
    "threshold:abc",
    "threshold:1.5",
    "threshold=5",
    "local:5",
]


@pytest.mark.parametrize("text", INVALID)
def test_parse_policy_invalid(text: str) -> None:
    with pytest.raises(ValueError):
        parse_policy(text)


@pytest.mark.parametrize("text", ["bogus", "threshold:-3"])
def test_config_rejects_bad_policy_at_the_edge(text: str) -> None:
    with pytest.raises(pydantic.ValidationError):
        ProxyConfig(prefill_urls=(), decode_urls=("http://d",), served_model_names=("m",),
                    policy=text)


T100 = "threshold:100"

# (policy, prompt_tokens, decode_cached_tokens, prefill_available) -> (route, reason)
DECISIONS = [
    # disaggregate
    ("disaggregate", 1, 0, True, "disaggregated", "policy_disaggregate"),
    ("disaggregate", 0, 0, True, "disaggregated", "policy_disaggregate"),
    ("disaggregate", 5000, 5000, True, "disaggregated", "policy_disaggregate"),
    ("disaggregate", 5000, 0, False, "local", "prefill_unavailable"),
    # local
    ("local", 5000, 0, True, "local", "policy_local"),
    ("local", 5000, 0, False, "local", "prefill_unavailable"),
    # threshold edges: == threshold disaggregates
    (T100, 99, 0, True, "local", "under_threshold"),
    (T100, 100, 0, True, "disaggregated", "over_threshold"),
    (T100, 101, 0, True, "disaggregated", "over_threshold"),
    (T100, 0, 0, True, "local", "under_threshold"),
    (T100, 100_000, 0, False, "local", "prefill_unavailable"),
    # cached tokens on decode reduce the uncached count
    (T100, 150, 50, True, "disaggregated", "over_threshold"),  # 100 uncached
    (T100, 150, 51, True, "local", "under_threshold"),  # 99 uncached
    (T100, 150, 150, True, "local", "under_threshold"),
    (T100, 150, 400, True, "local", "under_threshold"),  # more cached than prompt: 0, not negative
    # threshold 0: everything disaggregates, even a fully cached prompt
    ("threshold:0", 0, 0, True, "disaggregated", "over_threshold"),
    ("threshold:0", 10, 50, True, "disaggregated", "over_threshold"),
    ("threshold:1", 10, 10, True, "local", "under_threshold"),
]


@pytest.mark.parametrize(
    ("policy", "prompt", "cached", "available", "route", "reason"),
    DECISIONS,
    ids=[f"{p}-p{n}-c{c}-{'up' if a else 'down'}" for p, n, c, a, _, _ in DECISIONS],
)
def test_decide(
    policy: str, prompt: int, cached: int, available: bool, route: str, reason: str
) -> None:
    inputs = RouteInputs(
        prompt_tokens=prompt, decode_cached_tokens=cached, prefill_available=available
    )
    assert decide(parse_policy(policy), inputs) == Decision(route, reason)  # type: ignore[arg-type]


def test_route_inputs_defaults() -> None:
    inputs = RouteInputs(prompt_tokens=10)
    assert inputs.decode_cached_tokens == 0
    assert inputs.prefill_available is True


def test_policy_disaggregated_is_disaggregate():
    """The route's spelling names the policy that always picks it."""
    assert parse_policy("disaggregated") == parse_policy("disaggregate") == PolicyMode(
        "disaggregate")
