"""Fake engine actors for the Ray scaler's unit tests (no cluster)."""

from __future__ import annotations

from typing import Any


class FakeActor:
    """A fake engine actor: ``info`` answers with ``answer`` (raised when an exception)."""

    def __init__(self, answer: Any):
        self.answer = answer
        self.stopped = False
        self.info = self._Method(self._info)
        self.stop = self._Method(self._stop)

    class _Method:
        def __init__(self, fn):
            self.remote = fn

    async def _info(self):
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer

    async def _stop(self):
        self.stopped = True


class FakeActorClass:
    """Stands in for ``engine_host_class()``: records the resources each named actor asked
    for; its actors answer ``answer`` (starting: not yet healthy) until a test changes it."""

    def __init__(self, answer: Any = None):
        self.answer = answer if answer is not None else {"failed": None, "healthy": False}
        self.asked: dict[str, dict] = {}

    def options(self, name, namespace, **resources):
        self.asked[name] = resources.get("resources", {})
        answer = self.answer
        return type("Remote", (), {"remote": lambda _, *a: FakeActor(answer)})()
