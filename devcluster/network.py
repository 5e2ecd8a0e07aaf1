"""Pod networking for processes that share this machine's one network namespace.

- addresses: each pod gets its own loopback address, 127.S.0.N (then 127.S.1.N, ...), as status.podIP, S from the
  process id: test sessions run at once on one machine (each with its own emulated cluster) then do not hand out
  the same addresses, where one session's pod could not bind its port or one's operator would ask another's
  servers. A pod with
  `hostname` and `subdomain` keeps the address of its DNS name across recreations, so a name another pod's
  environment already resolved keeps pointing at it;
- DNS: `<hostname>.<subdomain>`, `<hostname>.<subdomain>.<namespace>` and the same with `.svc` or
  `.svc.cluster.local`, found in an env value, become the address of the pod they name, when a pod with that
  hostname and subdomain exists in the namespace, or a Service named like the subdomain does (a headless Service);
- ports (an emulation of separate network namespaces): on a cluster every pod may bind the same port, MASTER_PORT
  29500; here they would all collide (torch's TCPStore binds the port on every interface). So the pods that share a
  MASTER_ADDR naming a pod get one free port in MASTER_PORT instead of the one in their spec, chosen when the first
  of them starts and kept while any of them runs: a group restarted after all its pods ended gets a fresh port;
- binding all interfaces (the same emulation): a server asked to listen on 0.0.0.0 would take the port on every
  pod's address, and the next pod of its Deployment, asked the same, could not start. So `bind_to_pod` rewrites an
  argument of the container's command/args, or an env value, that is `0.0.0.0` (also `--host=0.0.0.0`,
  `0.0.0.0:8000`) to the pod's own address: two pods of one Deployment both listen on port 8000, each on its podIP,
  where probes and tests reach them.

Not emulated: Services' virtual IPs and load balancing (a Service's own name is not rewritten), network policies, a
process that binds 0.0.0.0 (or a fixed port on 127.0.0.1) by itself rather than because an argument said so.
"""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

DnsName = tuple[str, str, str]  # namespace, hostname, subdomain
_HOST = re.compile(r"(?<![\w.-])([a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)+)(?![\w-])")
_SUFFIXES = ("", ".svc", ".svc.cluster.local")


def dns_name(namespace: str, token: str) -> DnsName | None:
    """The pod a host name in `namespace` would name, read from its form (whether such a pod exists is not
    checked here)."""
    for suffix in _SUFFIXES:
        if suffix and not token.endswith(suffix):
            continue
        parts = token[: len(token) - len(suffix)].split(".")
        if len(parts) == 2 and not suffix:
            return namespace, parts[0], parts[1]
        if len(parts) == 3:
            return parts[2], parts[0], parts[1]
    return None


_ALL_INTERFACES = re.compile(r"(.*=)?0\.0\.0\.0(:\d+)?")


def bind_to_pod(value: str, ip: str) -> str:
    """`value` (one argument, or one env value) with an all-interfaces address (`0.0.0.0`, `--host=0.0.0.0`,
    `0.0.0.0:8000`) made the pod's own address; any other value as it is."""
    match = _ALL_INTERFACES.fullmatch(value)
    return f"{match[1] or ''}{ip}{match[2] or ''}" if match else value


def free_port(taken: set[int] = frozenset()) -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        if port not in taken:
            return port


@dataclass
class _PortGroup:
    port: int
    holders: set[str] = field(default_factory=set)


class Network:
    def __init__(self) -> None:
        self._next = int(ipaddress.IPv4Address(f"127.{1 + os.getpid() % 250}.0.2"))
        self._by_name: dict[DnsName, str] = {}
        self._groups: dict[tuple[DnsName, str], _PortGroup] = {}

    def _fresh(self) -> str:
        while True:
            address = ipaddress.IPv4Address(self._next)
            self._next += 1
            if address.packed[-1] not in (0, 255):  # 127.S.0.N, N in 1..254, then 127.S.1.N...
                return str(address)

    def address_of(self, name: DnsName) -> str:
        if name not in self._by_name:
            self._by_name[name] = self._fresh()
        return self._by_name[name]

    def address_for_pod(self, pod: dict) -> str:
        spec, meta = pod.get("spec", {}), pod["metadata"]
        if spec.get("hostname") and spec.get("subdomain"):
            return self.address_of((meta["namespace"], spec["hostname"], spec["subdomain"]))
        return self._fresh()

    def resolve(self, namespace: str, value: str, known: Callable[[DnsName], bool]) -> tuple[str, DnsName | None]:
        """`value` with every known pod DNS name replaced by its address; also the (last) name replaced."""
        found: list[DnsName] = []

        def replace(match: re.Match[str]) -> str:
            name = dns_name(namespace, match[1])
            if name is None or not known(name):
                return match[0]
            found.append(name)
            return self.address_of(name)

        return _HOST.sub(replace, value), (found[-1] if found else None)

    def group_port(self, master: DnsName, original: str, holder: str) -> int:
        """The port the group whose master is `master` uses for `original` (MASTER_PORT's value in the spec)."""
        group = self._groups.get((master, original))
        if group is None:
            taken = {g.port for g in self._groups.values()}
            group = self._groups[master, original] = _PortGroup(free_port(taken))
        group.holders.add(holder)
        return group.port

    def release(self, holder: str) -> None:
        """`holder` (a pod's uid) no longer runs: a group none of whose pods runs forgets its port."""
        for key, group in list(self._groups.items()):
            group.holders.discard(holder)
            if not group.holders:
                del self._groups[key]
