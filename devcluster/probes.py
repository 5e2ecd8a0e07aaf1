"""A container's probes and its preStop hook, as the kubelet runs them: asyncio tasks on the kubelet's event loop.

- handlers (`check`): `httpGet` (GET `scheme://host:port/path`, the host the pod's IP unless the probe names one,
  the port by number or by the name of one of the container's `ports`, `httpHeaders` sent, redirects followed, a
  status 200-399 succeeds), `tcpSocket` (a connection is accepted), `exec` (the command as the container's own: its
  environment and working directory, mount paths rewritten, `python` this interpreter; exit 0 succeeds, its output
  is the message); each within `timeoutSeconds`. The failure messages are the kubelet's (`HTTP probe failed with
  statuscode: 503`, `Get "http://...": dial tcp ...: connect: connection refused`);
- `Prober`: the startupProbe first: the container is `started` when it succeeds (at once without one); the
  readinessProbe and livenessProbe only after that. Each probe runs first `initialDelaySeconds` after the container
  started, then every `periodSeconds`; `successThreshold` successes in a row make the container ready,
  `failureThreshold` failures in a row unready (it starts unready). A container without a readinessProbe is ready
  once started. A startup or liveness probe that fails `failureThreshold` times in a row asks the kubelet to kill
  the container (`Kill`, with the probe's `terminationGracePeriodSeconds` if it has one); the kubelet then restarts it
  as its restartPolicy says. Probing stops when the container's process ends (readiness goes on while the pod
  terminates);
- hooks: the kubelet runs a container's `lifecycle.preStop` handler (exec or httpGet) with `Target.check`.

Events, as the kubelet writes them (`on_event`): `Unhealthy` ("Readiness probe failed: ..."), once when a probe's
failures reach its threshold rather than at every failure; `Killing` ("Container server failed liveness probe,
will be restarted"); `FailedPreStopHook`.
Not emulated: `grpc` probes (they succeed), HTTPS certificates (not verified), the kubelet's jitter on the first probe.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import aiohttp

from . import sandbox
from .runs import Process, die_with_parent, quietly

Result = tuple[bool, str]  # success, and the message of a failure
OUTPUT_LIMIT = 10 * 1024  # what the kubelet reads of an exec probe's output or an HTTP probe's body


@dataclass(frozen=True)
class Kill:
    """A probe's verdict: the container must go (`message` is the kubelet's `Killing` event)."""

    message: str
    grace: float | None  # the probe's terminationGracePeriodSeconds; None: the pod's


@dataclass(frozen=True)
class Timing:
    initial_delay: float
    period: float
    timeout: float
    successes: int
    failures: int

    @classmethod
    def of(cls, probe: Mapping[str, Any]) -> Timing:
        return cls(float(probe.get("initialDelaySeconds", 0)), float(probe.get("periodSeconds", 10)),
                   float(probe.get("timeoutSeconds", 1)), int(probe.get("successThreshold", 1)),
                   int(probe.get("failureThreshold", 3)))


class Target:
    """Where a container's handlers run: its pod's address, ports, environment and directories."""

    def __init__(self, container: Mapping[str, Any], ip: str, launch: sandbox.Launch,
                 session: aiohttp.ClientSession) -> None:
        self.container, self.ip, self.launch, self.session = container, ip, launch, session

    def port(self, port: Any) -> int | None:
        if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
            return int(port)
        return next((p["containerPort"] for p in self.container.get("ports") or [] if p.get("name") == port), None)

    async def check(self, handler: Mapping[str, Any], timeout: float | None) -> Result:
        """Run one probe or hook handler; (whether it succeeded, the failure's message)."""
        if "httpGet" in handler:
            return await self.http_get(handler["httpGet"], timeout)
        if "tcpSocket" in handler:
            return await self.tcp_socket(handler["tcpSocket"], timeout)
        if "exec" in handler:
            return await self.run_command(handler["exec"].get("command") or [], timeout)
        return True, ""  # grpc: not emulated

    async def http_get(self, action: Mapping[str, Any], timeout: float | None) -> Result:
        host, port = action.get("host") or self.ip, self.port(action.get("port"))
        if port is None:
            return False, f"unable to find port {action.get('port')!r} in container {self.container['name']}"
        path = action.get("path") or "/"
        url = f"{action.get('scheme', 'HTTP').lower()}://{host}:{port}{'' if path.startswith('/') else '/'}{path}"
        headers = {"User-Agent": "kube-probe/1.33", "Accept": "*/*",
                   **{h["name"]: h["value"] for h in action.get("httpHeaders") or []}}
        try:
            async with self.session.get(url, headers=headers, ssl=False,
                                        timeout=aiohttp.ClientTimeout(total=timeout)) as response:
                await response.content.read(OUTPUT_LIMIT)
                if 200 <= response.status < 400:
                    return True, ""
                return False, f"HTTP probe failed with statuscode: {response.status}"
        except TimeoutError:
            return False, f'Get "{url}": context deadline exceeded (Client.Timeout exceeded while awaiting headers)'
        except aiohttp.ClientConnectorError:
            return False, f'Get "{url}": dial tcp {host}:{port}: connect: connection refused'
        except aiohttp.ClientError as error:
            return False, f'Get "{url}": {error}'

    async def tcp_socket(self, action: Mapping[str, Any], timeout: float | None) -> Result:
        host, port = action.get("host") or self.ip, self.port(action.get("port"))
        if port is None:
            return False, f"unable to find port {action.get('port')!r} in container {self.container['name']}"
        try:
            _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout)
        except TimeoutError:
            return False, f"dial tcp {host}:{port}: i/o timeout"
        except OSError:
            return False, f"dial tcp {host}:{port}: connect: connection refused"
        writer.close()
        return True, ""

    async def run_command(self, command: list[str], timeout: float | None) -> Result:
        argv = sandbox.executable(command, self.launch.mapped)
        with tempfile.TemporaryFile() as output:
            try:
                process = Process(subprocess.Popen(
                    argv, env=self.launch.env, cwd=self.launch.cwd, stdin=subprocess.DEVNULL, stdout=output,
                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent))
            except OSError as error:
                return False, f'exec: "{argv[0] if argv else ""}": {error.strerror}'
            try:
                code = await asyncio.wait_for(process.wait(), timeout)
            except TimeoutError:
                return False, f"command {command!r} timed out"
            finally:
                if process.returncode is None:
                    with quietly():
                        os.killpg(process.pid, signal.SIGKILL)
            output.seek(0)
            text = output.read(OUTPUT_LIMIT).decode(errors="replace")
        return (True, "") if code == 0 else (False, text or f"command {command!r} exited with {code}")


class Prober:
    """The probes of one run of a container. `started` and `ready` are read by the kubelet when it writes status;
    `on_change()` says they changed, `on_kill(Kill)` that the container must go, `on_event(type, reason, message)` an
    Event to write."""

    def __init__(self, target: Target, on_change: Callable[[], None], on_kill: Callable[[Kill], None],
                 on_event: Callable[[str, str, str], None]) -> None:
        self.target, self.on_change, self.on_kill, self.on_event = target, on_change, on_kill, on_event
        container = target.container
        self.startup, self.readiness, self.liveness = (container.get(f"{kind}Probe")
                                                       for kind in ("startup", "readiness", "liveness"))
        self.started = self.startup is None
        self.ready = self.started and self.readiness is None
        self.since = time.monotonic()  # the container's start

    async def run(self) -> None:
        if self.startup is not None:
            if not await self._probe("Startup", self.startup):
                return
            self.started, self.ready = True, self.readiness is None
            self.on_change()
        loops = [self._probe(kind, probe) for kind, probe in (("Readiness", self.readiness),
                                                               ("Liveness", self.liveness)) if probe is not None]
        await asyncio.gather(*loops)

    async def _probe(self, kind: str, probe: Mapping[str, Any]) -> bool:
        """Probe until the verdict ends this probe: a startup probe's success (True), a startup or liveness probe's
        failure (False, the container killed); a readiness probe goes on."""
        timing, name = Timing.of(probe), self.target.container["name"]
        next_at = max(self.since + timing.initial_delay, time.monotonic())
        successes = failures = 0
        while True:
            await asyncio.sleep(max(next_at - time.monotonic(), 0))
            next_at = time.monotonic() + timing.period
            ok, message = await self.target.check(probe, timing.timeout)
            successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
            if kind == "Startup" and ok:
                return True
            if kind == "Readiness" and ok != self.ready and (successes >= timing.successes
                                                              or failures >= timing.failures):
                self.ready = ok
                self.on_change()
            if failures == timing.failures:
                self.on_event("Warning", "Unhealthy", f"{kind} probe failed: {message}")
                if kind != "Readiness":
                    grace = probe.get("terminationGracePeriodSeconds")
                    self.on_kill(Kill(f"Container {name} failed {kind.lower()} probe, will be restarted",
                                      None if grace is None else float(grace)))
                    return False
