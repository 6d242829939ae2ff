"""A correction factor on each route's predicted time to first token, learned from the
measured ÷ predicted ratio of the requests routed that way (Dynamo's SLA planner does the
same with its profiled TTFT: ``prefill_correction = actual_ttft / expected_ttft``).

The fits (``proxy/estimators.py``) learn a prompt's cost only from prompts timed alone: with
streams decoding beside it, or other prompt work queued, the model's own terms are trusted.
Under load that left a blind spot. On SmolLM2's decode-heavy goodput run (s45), 128-token local
prefills took 1.3-1.6x their prediction at the higher rate, the first requests of a point
included, while the fit timed alone still said 300 ms. Whatever slows an engine that way (the
box's other engine and the load generator sharing its cores here; on a GPU, a neighbour's
traffic, clocks, a cache reset) shows in every measured TTFT, so the correction learns from
all of them.

One factor per (engine or pair, route, prompt size class, queued or not): a long prompt's ratio
is not a short one's, and a prompt predicted behind queued prompt work is mispredicted by that
queue's model too. (The likeliest reason the first point after the capacity burst of SmolLM2's
decode-heavy run was over-predicted, 0.81, with one factor for both: it had learned from the
burst's queued requests.) Each measured ratio moves the factor by a recency weight in log space
(a ratio of 2 and one of 1/2 cancel), clipped first, so one request stalled by something else
cannot swing it.
Plain objects fed by ``observe``; no clock.
"""

from __future__ import annotations

import math

#: Weight of the newest ratio in the log-space average (half-life about 3 requests).
WEIGHT = 0.2
#: A single ratio counts as at most this far off (a request stalled by something else).
RATIO_CLIP = 4.0
#: The factor's range: outside it the model itself is wrong, not its calibration.
FACTOR_RANGE = (1 / 3, 3.0)
_LOG_RANGE = (math.log(FACTOR_RANGE[0]), math.log(FACTOR_RANGE[1]))


def size_class(prompt_tokens: int) -> int:
    """Prompt sizes in classes four times wide (edges at 8, 32, 128, 512, 2048, ...)."""
    return max(1, prompt_tokens).bit_length() // 2


class TtftCorrection:
    """The factor for one key: 1 until requests are measured."""

    def __init__(self) -> None:
        self._log = 0.0
        self.factor = 1.0
        self.samples = 0

    def observe(self, measured_over_predicted: float) -> None:
        """One request's measured TTFT over the prediction it was routed by (the factor at
        the time included: the residual moves the factor, as an integral controller)."""
        r = measured_over_predicted
        if not (math.isfinite(r) and r > 0):
            return
        r = min(max(r, 1 / RATIO_CLIP), RATIO_CLIP)
        lo, hi = _LOG_RANGE
        self._log = min(max(self._log + WEIGHT * math.log(r), lo), hi)
        self.factor = math.exp(self._log)
        self.samples += 1
