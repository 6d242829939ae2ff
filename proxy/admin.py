"""The bodies of the admin API, validated once into typed values (``extra="forbid"``)."""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError, model_validator

from proxy.errors import InvalidRequest
from proxy.policy import PolicyMode, parse_policy

MAX_REPLICAS = 64


class ScaleRequest(BaseModel):
    """``POST /pd/admin/scale``: grow or shrink one role of a Ray deployment."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    role: Literal["prefill", "decode"]
    replicas: StrictInt
    #: How long engines being removed may take to finish what they serve (None: the
    #: deployment's whole-request deadline). Past it they are removed anyway: their streams
    #: are continued on the engines that stay (stream migration).
    drain_timeout_s: float | None = Field(default=None, gt=0, le=86400)

    @model_validator(mode="after")
    def _check_range(self) -> ScaleRequest:
        low = 1 if self.role == "decode" else 0
        if not low <= self.replicas <= MAX_REPLICAS:
            raise ValueError(f"'replicas' must be an integer from {low} to {MAX_REPLICAS}")
        return self


class RoutingRequest(BaseModel):
    """``POST /pd/admin/routing``: the policy and the engines' duties (each optional)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    policy: str | None = None
    prefill: list[str] | None = None
    decode: list[str] | None = None

    def policy_mode(self) -> PolicyMode | None:
        return None if self.policy is None else parse_policy(self.policy)


def parse_admin(model: type[BaseModel], raw: bytes) -> Any:
    """``raw`` (JSON) as ``model``, or an OpenAI-style 400 naming the first field at fault."""
    try:
        return model.model_validate(msgspec.json.decode(raw) if raw else {})
    except msgspec.DecodeError:
        raise InvalidRequest("request body is not valid JSON") from None
    except RecursionError:
        raise InvalidRequest("request body is nested too deeply") from None
    except ValidationError as exc:
        first = exc.errors()[0]
        where = first.get("loc") or ()
        param = str(where[0]) if where else _param_of(first.get("msg", ""))
        message = first.get("msg", "invalid request").removeprefix("Value error, ")
        raise InvalidRequest(message, param=param) from None


def _param_of(message: str) -> str | None:
    for name in ("replicas", "role", "drain_timeout_s", "policy", "prefill", "decode"):
        if f"'{name}'" in message:
            return name
    return None
