"""ServerPool: the EngineClient over several Triton servers (one TritonEngineClient each).

Where a request goes:
- **Prefix affinity.** Requests whose prompts start alike go to the same server, so its prefix cache
  hits: the server is chosen by rendezvous hashing of the prompt's first `PREFIX_CHARS` characters
  (or `PREFIX_TOKENS` token ids) over the servers that can take it. Adding or losing a server moves
  only the prompts that hashed to it.
- **Unless it is much busier.** When the preferred server has `BUSY_MARGIN` more requests in flight
  than the least busy one (and more than twice as many), the least busy one takes the request.
- One engine request carries all n sequences of a prompt, so they stay on one server.
- **Health.** A server whose engine watchdog says the model is down gets no requests for it; one
  that refused `FAILURES_TO_EJECT` requests in a row before their first token is taken out (used
  only when no other server can take a request) until a check every `CHECK_INTERVAL_S` finds it
  ready again. A request refused before anything was streamed (server unreachable) is tried on the
  next server; a stream that breaks midway ends with an error event.
- **Discovery.** Each `--triton-url` is resolved; a name with several addresses (a Kubernetes headless
  Service) becomes one server per address, resolved again every `RESOLVE_INTERVAL_S`.

`/v1/models` is the union of what the healthy servers serve.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge

from openai_frontend.engine_client import ModelInfo
from openai_frontend.errors import EngineUnavailable, FrontendError, ModelNotFound
from openai_frontend.triton_client import TritonEngineClient
from protocol import AdmissionGroup, SamplingParams, StepOutput, Task

log = logging.getLogger("openai_frontend")

PREFIX_CHARS = 512
PREFIX_TOKENS = 128
BUSY_MARGIN = 4
FAILURES_TO_EJECT = 3
CHECK_INTERVAL_S = 2.0
RESOLVE_INTERVAL_S = 10.0


def affinity_key(prompt: str | Sequence[int]) -> bytes:
    """What decides a prompt's server: its first characters or token ids."""
    if isinstance(prompt, str):
        return prompt[:PREFIX_CHARS].encode("utf-8", "surrogatepass")
    return b",".join(str(t).encode() for t in prompt[:PREFIX_TOKENS])


def rendezvous_order(key: bytes, servers: Sequence[str]) -> list[str]:
    """Servers by preference for `key` (highest random weight first): stable as servers come and go."""
    return sorted(servers, key=lambda s: hashlib.blake2b(key + b"|" + s.encode(), digest_size=8).digest(), reverse=True)


@dataclass
class _Server:
    url: str
    client: TritonEngineClient
    in_flight: int = 0
    failures: int = 0  # consecutive
    ejected: bool = False
    models: set[str] = field(default_factory=set)


class ServerPool:
    def __init__(
        self,
        urls: Sequence[str],
        *,
        make_client: Callable[[str], TritonEngineClient] = TritonEngineClient,
        resolve: Callable[[str], list[str]] | None = None,
    ) -> None:
        if not urls:
            raise ValueError("ServerPool needs at least one Triton URL")
        self.urls = list(urls)
        self._make_client = make_client
        self._resolve = resolve or resolve_url
        self._servers: dict[str, _Server] = {}
        self._task: asyncio.Task | None = None
        self._last_resolve = float("-inf")
        self.registry = CollectorRegistry()
        self._m_in_flight = Gauge(
            "frontend_server_in_flight",
            "Engine requests in flight per Triton server",
            ["server"],
            registry=self.registry,
        )
        self._m_routed = Counter(
            "frontend_server_routed", "Engine requests routed per Triton server", ["server"], registry=self.registry
        )
        self._m_failures = Counter(
            "frontend_server_failures", "Engine requests a Triton server failed", ["server"], registry=self.registry
        )
        self._m_healthy = Gauge(
            "frontend_server_healthy", "1 while a Triton server takes traffic", ["server"], registry=self.registry
        )
        for url in self.urls:  # known at once, resolved for real on first use
            self._add(url)

    # -- the EngineClient protocol ------------------------------------------------------------------

    async def ready(self) -> bool:
        await self._refresh()
        return any([await s.client.ready() for s in self._servers.values()])

    async def list_models(self) -> list[ModelInfo]:
        await self._refresh()
        merged: dict[str, ModelInfo] = {}
        errors: list[FrontendError] = []
        for server in self._healthy():
            try:
                models = await server.client.list_models()
            except FrontendError as e:
                errors.append(e)
                continue
            server.models = {m.name for m in models}
            for m in models:
                merged.setdefault(m.name, m)
        if not merged and errors:
            raise errors[0]
        return sorted(merged.values(), key=lambda m: m.name)

    async def model_config(self, model: str) -> ModelInfo:
        await self._refresh()
        unavailable: FrontendError | None = None
        for server in self._healthy() or list(self._servers.values()):
            try:
                return await server.client.model_config(model)
            except ModelNotFound:
                continue
            except FrontendError as e:
                unavailable = unavailable or e
        raise unavailable or ModelNotFound(model)

    async def generate(
        self,
        model: str,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str,
        admission_group: AdmissionGroup | None = None,
        task: Task = Task.GENERATE,
        headers: Mapping[str, str] | None = None,
    ) -> AsyncIterator[StepOutput]:
        await self._refresh()
        tried: set[str] = set()
        while True:
            server = self._choose(model, prompt, exclude=tried)
            if server is None:
                raise EngineUnavailable(
                    f"no Triton server can serve model `{model}` now ({len(self._servers)} known, {len(tried)} tried)",
                    retry_after_s=5,
                )
            tried.add(server.url)
            started = False
            server.in_flight += 1
            self._m_in_flight.labels(server.url).inc()
            self._m_routed.labels(server.url).inc()
            try:
                stream = server.client.generate(model, prompt, params, request_id, admission_group, task, headers)
                try:
                    async for out in stream:
                        started = True
                        yield out
                finally:
                    await stream.aclose()
                server.failures = 0
                return
            except EngineUnavailable:
                if started:  # tokens were sent: the stream ends with an error event, not a second answer (an
                    raise  # engine that died midway is its watchdog's business, not a mark against the server)
                self._failed(server)
            finally:
                server.in_flight -= 1
                self._m_in_flight.labels(server.url).dec()

    def abort_all(self, reason: str) -> int:
        return sum(s.client.abort_all(reason) for s in self._servers.values())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for server in self._servers.values():
            await server.client.close()

    # -- routing --------------------------------------------------------------------------------------

    def _choose(self, model: str, prompt: str | list[int], exclude: set[str]) -> _Server | None:
        usable = [
            s
            for s in self._servers.values()
            if s.url not in exclude and (not s.models or model in s.models) and not s.client.watchdog.is_down(model)
        ]
        # Taken-out servers only as a last resort (a lone server is still tried while it is being checked).
        candidates = [s for s in usable if not s.ejected] or usable
        if not candidates:
            return None
        by_url = {s.url: s for s in candidates}
        preferred = by_url[rendezvous_order(affinity_key(prompt), list(by_url))[0]]
        idlest = min(candidates, key=lambda s: s.in_flight)
        if preferred.in_flight >= max(idlest.in_flight + BUSY_MARGIN, 2 * idlest.in_flight + 1):
            return idlest
        return preferred

    def _healthy(self) -> list[_Server]:
        return [s for s in self._servers.values() if not s.ejected]

    def _failed(self, server: _Server) -> None:
        server.failures += 1
        self._m_failures.labels(server.url).inc()
        if server.failures >= FAILURES_TO_EJECT and not server.ejected:
            log.error("Triton server %s failed %d requests in a row: taken out", server.url, server.failures)
            self._eject(server)

    def _eject(self, server: _Server) -> None:
        server.ejected = True
        self._m_healthy.labels(server.url).set(0)
        self._ensure_checking()

    def _add(self, url: str) -> None:
        if url not in self._servers:
            self._servers[url] = _Server(url, self._make_client(url))
            self._m_healthy.labels(url).set(1)

    # -- discovery and health checks --------------------------------------------------------------------

    async def _refresh(self) -> None:
        now = time.monotonic()
        if now - self._last_resolve < RESOLVE_INTERVAL_S:
            return
        self._last_resolve = now
        resolved: list[str] = []
        for url in self.urls:
            try:
                resolved += await asyncio.to_thread(self._resolve, url)
            except OSError as e:
                log.warning("cannot resolve %s: %s", url, e)
                resolved.append(url)
        for url in resolved:
            self._add(url)
        for url in list(self._servers):
            if url not in resolved and self._servers[url].in_flight == 0:
                await self._servers.pop(url).client.close()
        self._ensure_checking()

    def _ensure_checking(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._check_ejected())

    async def _check_ejected(self) -> None:
        while any(s.ejected for s in self._servers.values()):
            await asyncio.sleep(CHECK_INTERVAL_S)
            for server in [s for s in self._servers.values() if s.ejected]:
                if await server.client.ready():
                    log.warning("Triton server %s is ready again: back in the pool", server.url)
                    server.ejected, server.failures = False, 0
                    self._m_healthy.labels(server.url).set(1)


def resolve_url(url: str) -> list[str]:
    """host:port -> one host:port per IPv4 address of host (the URL itself for an IP or one address)."""
    host, _, port = url.rpartition(":")
    try:
        ipaddress.ip_address(host.strip("[]"))
        return [url]
    except ValueError:
        pass
    infos = socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)
    addresses = sorted({info[4][0] for info in infos})
    return [url] if len(addresses) <= 1 else [f"{a}:{port}" for a in addresses]
