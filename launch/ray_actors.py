"""The deployment's engine actors: where each goes, creating, replacing and stopping them
(:class:`RayScaler`), and finding them (:class:`RayDirectory`).

Each engine is a named actor (``prefill-N``/``decode-N``, N never reused) in the deployment's
namespace, hosting one engine process (``launch/ray_engine.py``). The scaler is the proxy's
scaling back end (``POST /pd/admin/scale``) and keeps each role at its declared size by the pure
rule of ``launch/replica_plan.py``; the directory is how the proxy finds the engines' urls.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from launch.ray_engine import EngineTemplate, died_for_good, engine_host_class
from launch.replica_plan import Replica, ReplicaRule, Strikes, judge, plan_replicas
from proxy.pool import EndpointInfo

log = logging.getLogger(__name__)

_NAME = re.compile(r"^(prefill|decode)-(\d+)$")
INFO_TIMEOUT_S = 2.0


#: What one engine asks of its role's placement resource: a marker, so that any node offering
#: it (``ray start --resources='{"pd_prefill": 100}'``) takes that role's engines as far as its
#: CPUs or GPUs allow.
PLACEMENT_SHARE = 0.01


def actor_resources(accelerator: str, node_resource: str | None = None) -> dict[str, Any]:
    """One GPU per engine on GPU clusters; one CPU per engine otherwise. ``node_resource``:
    only on the nodes that offer that Ray custom resource."""
    out: dict[str, Any] = ({"num_gpus": 1, "num_cpus": 1} if accelerator == "gpu"
                           else {"num_cpus": 1})
    if node_resource:
        out["resources"] = {node_resource: PLACEMENT_SHARE}
    return out


def unplaceable(placement: Mapping[str, tuple[str, ...]], cluster_resources: Mapping[str, float]
                ) -> list[tuple[str, str]]:
    """The (role, placement resource) pairs that no node of the cluster offers (yet)."""
    return [(role, resource) for role, resources in sorted(placement.items())
            for resource in resources if cluster_resources.get(resource, 0.0) < PLACEMENT_SHARE]


def placement_resource(placement: Mapping[str, tuple[str, ...]], role: str,
                       taken: Sequence[str | None]) -> str | None:
    """The resource a new engine of ``role`` asks for: of the role's list, the one its live
    engines (``taken``: the resource each asked for) use least, the first on a tie; so round
    robin from the start, and after a scale-down the nodes left short are filled first."""
    resources = placement.get(role, ())
    return min(resources, key=lambda r: (taken.count(r), resources.index(r)), default=None)


def resolve_accelerator(requested: str, cluster_resources: dict[str, float]) -> str:
    if requested in ("cpu", "gpu"):
        return requested
    return "gpu" if cluster_resources.get("GPU", 0) > 0 else "cpu"


def role_of(name: str) -> str:
    return name.rsplit("-", 1)[0]


def ordinal(name: str) -> int:
    return int(name.rsplit("-", 1)[1])


class RayScaler:
    """Creates and stops the deployment's engine actors (names ``prefill-N``/``decode-N``, N
    never reused), and replaces those dead for good (:meth:`reconcile`)."""

    def __init__(self, namespace: str, template: EngineTemplate, accelerator: str,
                 max_restarts: int, placement: Mapping[str, tuple[str, ...]] | None = None,
                 rule: ReplicaRule = ReplicaRule()):
        self._namespace = namespace
        self._template = template.to_dict()
        self._accelerator = accelerator
        self._placement = dict(placement or {})
        self._cls = engine_host_class(max_restarts)
        self.handles: dict[str, Any] = {}
        self._resource: dict[str, str | None] = {}  # the placement resource each asked for
        self._next = {"prefill": 0, "decode": 0}
        self._rule = rule
        self._strikes: dict[str, Strikes] = {}
        self._unproven: set[str] = set()  # replacements not yet seen ready
        self._deaths: dict[str, int] = {}  # ActorDiedErrors in a row
        self._ready_at: dict[str, float] = {}  # when each was created or last seen ready
        # Creating a named actor and killing one are blocking calls to Ray's GCS (a minute's
        # wait with the GCS gone): off the proxy's event loop, on threads of their own.
        self._calls = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ray-scaler")

    def create(self, role: str, count: int) -> list[str]:
        """Start ``count`` engines of ``role`` (blocking: at start-up; the proxy's paths use
        :meth:`_create`)."""
        return [self._created(name, self._spawn(name, role, resource), resource)
                for name, resource in (self._next_of(role) for _ in range(count))]

    async def _create(self, role: str, count: int) -> list[str]:
        """:meth:`create`, its calls to Ray off the event loop."""
        names = []
        for _ in range(count):
            name, resource = self._next_of(role)
            handle = await self._off_loop(self._spawn, name, role, resource)
            names.append(self._created(name, handle, resource))
        return names

    def _next_of(self, role: str) -> tuple[str, str | None]:
        """A new engine's name, and the placement resource it asks for."""
        name = f"{role}-{self._next[role]}"
        self._next[role] += 1
        return name, placement_resource(self._placement, role, [
            self._resource.get(n) for n in self.handles if role_of(n) == role])

    def _spawn(self, name: str, role: str, resource: str | None) -> Any:
        return self._cls.options(name=name, namespace=self._namespace,
                                 **actor_resources(self._accelerator, resource)
                                 ).remote(name, role, self._template)

    def _created(self, name: str, handle: Any, resource: str | None) -> str:
        self.handles[name] = handle
        self._resource[name] = resource
        self._ready_at[name] = time.monotonic()
        return name

    async def replicas(self, role: str) -> list[str]:
        """The role's engines, oldest first; those dead for good are stopped first (logged
        with their cause) and left out."""
        await self._settle({})
        return sorted((n for n in self.handles if role_of(n) == role), key=ordinal)

    async def reconcile(self, declared: Mapping[str, int]) -> dict[str, list[str]]:
        """Stop the engines dead for good and start fresh ones (new names, same role, the
        placement resource the role uses least) for each role short of ``declared``, within
        the crash-loop rule (``launch/replica_plan.py``); return the engines started, by
        role."""
        return await self._settle(declared)

    async def _settle(self, declared: Mapping[str, int]) -> dict[str, list[str]]:
        names = list(self.handles)
        looked = await asyncio.gather(*(self._replica(n) for n in names))
        now = time.monotonic()
        for r in looked:  # (one it did not create: its clock starts at its first look)
            if r.state == "ready" or r.name not in self._ready_at:
                self._ready_at[r.name] = now
        replicas = [judge(replace(r, unready_s=now - self._ready_at[r.name]), self._rule)
                    for r in looked]
        plan = plan_replicas(declared, replicas, self._strikes, now, self._rule)
        self._strikes = dict(plan.strikes)
        self._unproven -= {r.name for r in replicas if r.state == "ready"}
        for r in replicas:
            if r.state == "dead":
                log.error("%s is dead for good, stopping it: %s%s", r.name, r.cause,
                          f" (a replacement never ready: {r.role} strike "
                          f"{plan.strikes[r.role].count} of {self._rule.max_strikes})"
                          if r.replacement else "")
        for role in plan.gave_up:
            log.error("%s: %d replacement engines in a row failed before they were ever ready: "
                      "no more are started, %d %s engines left (their causes above; a scale "
                      "order, pdserve scale %s N, tries again)", role, plan.strikes[role].count,
                      sum(r.role == role and r.state != "dead" for r in replicas), role, role)
        await self.remove(plan.stop)
        started = {role: await self._create(role, count) for role, count in plan.start.items()}
        for role, new in started.items():
            self._unproven.update(new)
            log.warning("%s: started %s to keep %d engines", role, ", ".join(new),
                        declared[role])
        return started

    async def _replica(self, name: str) -> Replica:
        """The engine's state: dead when it will never serve (its actor died for good, or its
        engine failed before it was ever ready); starting while it may (restarting, slow to
        answer)."""
        from ray.exceptions import ActorDiedError

        role, unproven = role_of(name), name in self._unproven
        try:
            info = await asyncio.wait_for(self.handles[name].info.remote(), INFO_TIMEOUT_S)
        except ActorDiedError as exc:
            self._deaths[name] = self._deaths.get(name, 0) + 1
            if died_for_good(exc, self._deaths[name]):
                return Replica(name, role, "dead", unproven, f"its actor died: {exc}")
            log.info("%s died; Ray may be restarting it: %s", name, exc)
            return Replica(name, role, "starting", unproven)
        except Exception as exc:  # noqa: BLE001 - restarting or unreachable: may come back
            log.debug("no info from %s: %s", name, exc)
            return Replica(name, role, "starting", unproven)
        self._deaths.pop(name, None)
        if info["failed"]:
            return Replica(name, role, "dead", unproven, info["failed"])
        return Replica(name, role, "ready" if info.get("healthy") else "starting", unproven)

    async def add(self, role: str, count: int) -> list[str]:
        """An operator's order: also clears the role's crash-loop strikes (replacing again)."""
        self._strikes.pop(role, None)
        return await self._create(role, count)

    async def remove(self, names: Sequence[str]) -> None:
        await asyncio.gather(*(self._stop(n) for n in names))

    async def _stop(self, name: str) -> None:
        import ray

        handle = self.handles.pop(name, None)
        self._resource.pop(name, None)
        self._unproven.discard(name)
        self._deaths.pop(name, None)
        self._ready_at.pop(name, None)
        if handle is None:
            return
        try:
            await asyncio.wait_for(handle.stop.remote(), 30)
        except Exception as exc:  # noqa: BLE001 - dead or stuck: kill it regardless
            log.warning("stopping %s: %s", name, exc)
        await self._off_loop(ray.kill, handle, no_restart=True)

    async def _off_loop(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(
            self._calls, lambda: fn(*args, **kwargs))

    async def restart(self, name: str, url: str) -> None:
        """The proxy's ``Restarter`` (``proxy/directory.py``): kill the engine's actor so that
        Ray restarts it, and with it a fresh engine (its core hung behind a live /health,
        which the actor's own watchdog does not see)."""
        import ray

        handle = self.handles.get(name)
        if handle is None:
            log.warning("asked to restart %s (%s): not an engine of this deployment", name, url)
            return
        log.error("%s: killing its actor so Ray restarts it (its core hung: the proxy's "
                  "requests stalled and it generated no token)", name)
        await self._off_loop(ray.kill, handle, no_restart=False)

    def stop_all(self) -> None:
        """Blocking: stop every engine, then kill the actors (used at shutdown)."""
        import ray

        refs = {n: h.stop.remote() for n, h in self.handles.items()}
        ray.wait(list(refs.values()), num_returns=len(refs), timeout=30)
        for h in self.handles.values():
            ray.kill(h, no_restart=True)
        self.handles.clear()


class RayDirectory:
    """The engines of one namespace, found by listing Ray's named actors and asking each for
    its current url. An actor that is restarting (or slow to answer) keeps its last-known
    entry; health probes decide whether it is routed to."""

    def __init__(self, namespace: str):
        self._namespace = namespace
        self._handles: dict[str, Any] = {}
        self._last: dict[str, EndpointInfo] = {}
        # Ray's blocking calls run on threads of their own, not the event loop's default
        # executor: with the cluster gone such a call waits for its GCS for a minute, and the
        # loop joins its default executor's threads when it closes, so pdserve could not exit.
        self._calls = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ray-directory")

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._calls, fn, *args)

    def _list_names(self) -> list[str]:
        import ray

        found = ray.util.list_named_actors(all_namespaces=True)
        return [a["name"] for a in found
                if a.get("namespace") == self._namespace and _NAME.match(a["name"])]

    async def endpoints(self) -> list[EndpointInfo]:
        import ray

        names = await self._call(self._list_names)
        for gone in set(self._handles) - set(names):
            self._handles.pop(gone, None)
            self._last.pop(gone, None)

        async def one(name: str) -> None:
            try:
                if name not in self._handles:
                    self._handles[name] = await self._call(ray.get_actor, name,
                                                           self._namespace)
                info = await asyncio.wait_for(self._handles[name].info.remote(), INFO_TIMEOUT_S)
            except Exception as exc:  # noqa: BLE001 - restarting or unreachable: keep last
                log.debug("no info from %s: %s", name, exc)
                return
            self._last[name] = EndpointInfo(info["name"], info["role"], info["url"],
                                            info["kv_events"], f"{info['node_ip']}:{info['pid']}")

        await asyncio.gather(*(one(n) for n in names))
        return [self._last[n] for n in names if n in self._last]
