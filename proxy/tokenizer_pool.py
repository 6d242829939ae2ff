"""Measure prompts (tokenize, hash their blocks) off the proxy's event loop.

Tokenizing is the proxy's one piece of work that grows with the prompt: a 96k-token chat prompt
took 313 ms to encode with SmolLM2's tokenizer here, and while a thread encodes, the loop's
thread still waited up to 18 ms at a time for the GIL (HF tokenizers holds it for part of the
work). So prompts go to worker processes (:mod:`proxy.tokenizer_worker`), each with its own
tokenizer, over pipes the event loop reads and writes without blocking: no thread of this
process touches a prompt. (``concurrent.futures.ProcessPoolExecutor`` was tried first: its
feeder and manager threads cost ~4 ms per round trip at 1k tokens, and hold the GIL meanwhile.)
Prompts of at most ``inline_chars`` characters are measured in the caller: the hop costs more.

Call order: ``pool = await TokenizerPool.start(model_dir, workers, inline_chars)`` (starts the
workers, waits until each has loaded its tokenizer) → ``await pool.measure(body, block_sizes)``
/ ``await pool.ids(body)`` any number of times, concurrently → ``await pool.close()`` once (the
owner's ``finally``). Each worker takes one prompt at a time; more wait here for a free one, so
a burst of long prompts queues instead of starving the relay. A worker that dies, answers
garbage or hangs (no answer in ``CALL_TIMEOUT_S``: it is killed) is replaced; the call it had
answers None, and the proxy sizes that prompt from its
characters, as without a tokenizer. A call cancelled while its worker works leaves the worker
to finish (its answer is dropped, the worker is then free again).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import sys
from array import array
from collections.abc import Mapping, Sequence
from typing import Any

from proxy.tokenizer_worker import HEADER, frame
from proxy.tokens import (
    PromptTokenizer,
    PromptTokens,
    TokenizerInfo,
    prompt_chars,
    renders_here,
)

log = logging.getLogger(__name__)

#: Workers run below the proxy's own priority: when the event loop wakes, the kernel gives it a
#: core a worker holds at once instead of after the worker's time slice.
WORKER_NICE = 10
_START_TIMEOUT_S = 120.0
#: A call unanswered this long has a hung worker (stopped, stuck, or out of step on its pipe):
#: it is killed and replaced, the caller sizes the prompt from its characters. 30x the longest
#: measure seen here (a 96k-token chat, 313 ms).
CALL_TIMEOUT_S = 10.0


class _Worker:
    """One worker process and its pipes; used by one call at a time."""

    def __init__(self, proc: asyncio.subprocess.Process):
        self.proc = proc

    @classmethod
    async def start(cls, model_dir: str) -> _Worker:
        return await (await cls.spawn(model_dir)).ready()

    @classmethod
    async def spawn(cls, model_dir: str) -> _Worker:
        """The process, started; :meth:`ready` waits until it has loaded its tokenizer."""
        return cls(await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy.tokenizer_worker", model_dir, str(WORKER_NICE),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE))

    async def ready(self) -> _Worker:
        try:
            async with asyncio.timeout(_START_TIMEOUT_S):
                if await self._read() != "ready":
                    raise RuntimeError("the tokenizer worker did not start")
        except BaseException:
            await self.stop()
            raise
        return self

    async def call(self, *request: Any) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(frame(request))  # buffered by the transport: never blocks
        await self.proc.stdin.drain()
        return await self._read()

    async def _read(self) -> Any:
        assert self.proc.stdout is not None
        head = await self.proc.stdout.readexactly(HEADER.size)
        return pickle.loads(await self.proc.stdout.readexactly(HEADER.unpack(head)[0]))

    async def stop(self) -> None:
        if self.proc.returncode is None:
            if self.proc.stdin is not None:
                self.proc.stdin.close()
            try:
                async with asyncio.timeout(5):
                    await self.proc.wait()
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()


class TokenizerPool:
    def __init__(self, model_dir: str, local: PromptTokenizer, inline_chars: int,
                 workers: list[_Worker]):
        self._model_dir = model_dir
        self._local = local
        self._inline_chars = inline_chars
        self._workers = list(workers)
        self._idle: asyncio.Queue[_Worker] = asyncio.Queue()
        for w in workers:
            self._idle.put_nowait(w)
        self._replacing: set[asyncio.Task] = set()
        self.info: TokenizerInfo = local.info()

    @classmethod
    async def start(cls, model_dir: str, workers: int, inline_chars: int) -> TokenizerPool:
        """``inline_chars``: prompts of at most this many characters are measured in the
        caller's thread (``ProxyConfig.tokenizer_inline_chars``)."""
        # The worker processes first, the local tokenizer after: starting a process forks, and
        # a fork while another thread imports (loading the tokenizer) can deadlock. Seen in CI:
        # the fork's before-hooks held logging's lock and waited for the import lock, which the
        # loading thread held while a garbage-collected logging handler waited for logging's.
        # Once all are forked, the local one loads while they load theirs (a first start here:
        # 7.9 s against 9.3 s one after the other, measured once).
        spawned: list[_Worker] = []
        try:
            for _ in range(workers):
                spawned.append(await _Worker.spawn(model_dir))
            local, started = await asyncio.gather(
                asyncio.to_thread(_warm_tokenizer, model_dir),
                asyncio.gather(*(w.ready() for w in spawned)))
        except BaseException:
            await asyncio.gather(*(w.stop() for w in spawned), return_exceptions=True)
            raise
        return cls(model_dir, local, inline_chars, list(started))

    async def measure(self, body: Mapping[str, Any], block_sizes: Sequence[int]
                      ) -> PromptTokens | None:
        """The prompt's length and block keys for each of ``block_sizes``; None when it cannot
        be tokenized here (or its worker died)."""
        sizes = tuple(sorted(set(block_sizes)))
        if not renders_here(body):
            return None
        if prompt_chars(body) <= self._inline_chars:
            return self._local.measure(body, sizes)
        result = await self._call("measure", _prompt_only(body), sizes)
        if result is None:
            return None
        n_tokens, raw = result
        return PromptTokens(n_tokens, {bs: array("q", keys) for bs, keys in raw.items()})

    async def ids(self, body: Mapping[str, Any]) -> list[int] | None:
        """The prompt's token ids (start-up probes build prompts of exact lengths with it)."""
        if not renders_here(body):
            return None
        if prompt_chars(body) <= self._inline_chars:
            return self._local.ids(body)
        return await self._call("ids", _prompt_only(body))

    async def _call(self, *request: Any) -> Any:
        worker = await self._idle.get()
        answer = asyncio.get_running_loop().create_task(worker.call(*request))
        answer.add_done_callback(lambda task: self._release(worker, task))
        try:
            # Shielded: a caller that gives up leaves the worker to finish, so the next
            # request on its pipe does not read this one's answer.
            async with asyncio.timeout(CALL_TIMEOUT_S):
                return await asyncio.shield(answer)
        except TimeoutError:
            log.warning("tokenizer worker %s did not answer in %.0f s: replacing it",
                        worker.proc.pid, CALL_TIMEOUT_S)
            worker.proc.kill()  # its call fails, and _release replaces it
            return None
        except (OSError, EOFError, asyncio.IncompleteReadError, pickle.UnpicklingError) as exc:
            log.warning("tokenizer worker %s failed (%r): replacing it", worker.proc.pid, exc)
            return None

    def _release(self, worker: _Worker, answer: asyncio.Task) -> None:
        if not answer.cancelled() and answer.exception() is None:
            self._idle.put_nowait(worker)
        else:  # dead or out of step: a fresh one takes its place
            task = asyncio.get_running_loop().create_task(self._replace(worker))
            self._replacing.add(task)
            task.add_done_callback(self._replacing.discard)

    async def _replace(self, worker: _Worker) -> None:
        self._workers.remove(worker)
        await worker.stop()
        while True:
            try:
                fresh = await _Worker.start(self._model_dir)
                break
            except (OSError, RuntimeError, EOFError, asyncio.IncompleteReadError, TimeoutError):
                log.exception("could not start a tokenizer worker; retrying in 5 s")
                await asyncio.sleep(5)
        self._workers.append(fresh)
        self._idle.put_nowait(fresh)

    async def close(self) -> None:
        for task in list(self._replacing):
            task.cancel()
        await asyncio.gather(*self._replacing, return_exceptions=True)
        await asyncio.gather(*(w.stop() for w in self._workers))


def _warm_tokenizer(model_dir: str) -> PromptTokenizer:
    """A tokenizer whose chat template is compiled already (the first render took ~3 ms)."""
    tokenizer = PromptTokenizer(model_dir)
    tokenizer.ids({"messages": [{"role": "user", "content": "warm up"}]})
    return tokenizer


def _prompt_only(body: Mapping[str, Any]) -> dict[str, Any]:
    """The part of a request body measuring reads (what is sent to a worker)."""
    return {k: body[k] for k in ("messages", "prompt", "cache_salt") if k in body}
