"""A pod's first container as a local process: its command, environment, volumes and working directory.

- command: `command` + `args` with `$(VAR)` expanded from the container's env as Kubernetes does; `python`,
  `python3` (any `python3.X`) become this interpreter (`sys.executable`), so the test's virtualenv is used, and
  the virtualenv's bin directory leads PATH (so `tandem` is found); exec probes and hooks run the same way
  (`executable`, no `$(VAR)` expansion), and the kubelet makes `0.0.0.0` the pod's address (network.py);
- environment: the process starts from a minimal environment, as a container does (PATH, HOME and TMPDIR in the
  pod's directory, LANG, HOSTNAME = the pod's hostname), plus the kubelet's `extra_env`, then the container's
  `envFrom` and `env`: `value` (with `$(VAR)`), `valueFrom.fieldRef` (metadata.name, namespace, uid, labels['k'],
  annotations['k'], spec.nodeName, spec.serviceAccountName, status.podIP(s), status.hostIP(s)),
  `resourceFieldRef` (limits/requests of cpu and memory), `configMapKeyRef` and `secretKeyRef` (`optional`
  honoured; a missing one is CreateContainerConfigError until it exists). KUBECONFIG points at the emulator (with
  the pod's own token) and KUBERNETES_SERVICE_HOST is unset, so the `kubernetes` client in the pod talks to the
  emulator; local volume directories in what the pod writes through the API are mapped back to their mount paths
  (`Emulator._map_pod_paths`), so a checkpoint path it reports reads as on a cluster. GPUs: the
  pod's assigned devices in CUDA_VISIBLE_DEVICES (none: empty, as a container without a GPU request sees none);
- volumes as local directories: ConfigMap and Secret volumes as files (all keys, or `items` at their paths),
  emptyDir a fresh directory per pod, a persistentVolumeClaim one directory per claim name in the namespace, shared
  by every pod and kept across restarts (`claim_dir`), hostPath the path itself; `volumeMounts` (with `subPath`)
  map each mount path to its directory, and every env value, arg and the workingDir that contains a mount path is
  rewritten to the local directory. The working directory is the mapped `workingDir`, or the pod's own directory;
- the termination message: the container's `terminationMessagePath` (default /dev/termination-log) is a file of
  the pod's own, mapped like a mount (a command given the path writes there); what it holds (up to 4096 bytes) is
  the terminated state's message, and only when it is empty does FallbackToLogsOnError take the log's tail.

Not emulated: a private filesystem (the process sees this machine's files; only paths under mounts are mapped, so a
process writing to another absolute path writes on this machine), `readOnly`, users and security contexts,
ConfigMap volumes updating when the ConfigMap changes, downwardAPI and projected
volumes (served as empty directories).
"""

from __future__ import annotations

import base64
import math
import os
import re
import sys
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kubernetes.utils import parse_quantity

Getter = Callable[[str], Awaitable["dict[str, Any] | None"]]  # GET an API path; None when 404


class NotReady(Exception):
    """The container cannot be created yet: `reason` (CreateContainerConfigError, ...) and `str(self)`."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


@dataclass
class Launch:
    argv: list[str]
    env: dict[str, str]
    cwd: Path
    mapped: list[tuple[str, Path]] = field(default_factory=list)  # (mount path, local directory): for exec hooks
    termination_message: Path | None = None
    """The local file standing for the container's terminationMessagePath."""


def pod_dir(root: Path, pod: Mapping[str, Any]) -> Path:
    meta = pod["metadata"]
    return root / "pods" / f"{meta['namespace']}_{meta['name']}_{meta['uid'][:8]}"


def claim_dir(root: Path, namespace: str, claim: str) -> Path:
    return root / "claims" / namespace / claim


async def _source(get: Getter, kind: str, namespace: str, name: str, optional: bool) -> dict[str, str] | None:
    """A ConfigMap's or Secret's keys as text (Secrets decoded); None when missing and optional."""
    obj = await get(f"/api/v1/namespaces/{namespace}/{kind}s/{name}")
    if obj is None:
        if optional:
            return None
        raise NotReady("CreateContainerConfigError", f'{kind} "{name}" not found')
    if kind == "secret":
        data = {k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("data") or {}).items()}
        return {**data, **(obj.get("stringData") or {})}
    binary = {k: base64.b64decode(v).decode(errors="replace") for k, v in (obj.get("binaryData") or {}).items()}
    return {**(obj.get("data") or {}), **binary}


async def volumes(get: Getter, root: Path, pod: Mapping[str, Any]) -> dict[str, Path]:
    """Each volume of the pod as a local directory (or file tree)."""
    namespace, base = pod["metadata"]["namespace"], pod_dir(root, pod) / "volumes"
    dirs: dict[str, Path] = {}
    for volume in pod.get("spec", {}).get("volumes") or []:
        name, path = volume["name"], pod_dir(root, pod) / "volumes" / volume["name"]
        if "persistentVolumeClaim" in volume:
            path = claim_dir(root, namespace, volume["persistentVolumeClaim"]["claimName"])
        elif "hostPath" in volume:
            path = Path(volume["hostPath"]["path"])
        elif "configMap" in volume or "secret" in volume:
            source = volume.get("configMap") or volume.get("secret")
            kind = "configmap" if "configMap" in volume else "secret"
            data = await _source(get, kind, namespace, source.get("name") or source.get("secretName"),
                                 source.get("optional", False))
            _write_keys(path, data or {}, source.get("items"), kind, source.get("optional", False))
        path.mkdir(parents=True, exist_ok=True)
        dirs[name] = path
    base.mkdir(parents=True, exist_ok=True)
    return dirs


def _write_keys(path: Path, data: dict[str, str], items: list[dict] | None, kind: str, optional: bool) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for item in items or [{"key": key, "path": key} for key in data]:
        if item["key"] not in data:
            if optional:
                continue
            raise NotReady("ContainerCreating", f'{kind} key "{item["key"]}" not found')
        target = path / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(data[item["key"]])


def mounts(container: Mapping[str, Any], dirs: Mapping[str, Path]) -> list[tuple[str, Path]]:
    """(mountPath, local path) of each volumeMount, longest mount path first."""
    found = []
    for mount in container.get("volumeMounts") or []:
        if mount["name"] not in dirs:
            raise NotReady("CreateContainerConfigError", f'volumeMounts: volume "{mount["name"]}" not found')
        local = dirs[mount["name"]] / mount["subPath"] if mount.get("subPath") else dirs[mount["name"]]
        found.append((mount["mountPath"].rstrip("/") or "/", local))
    return sorted(found, key=lambda m: -len(m[0]))


TERMINATION_MESSAGE_PATH = "/dev/termination-log"
"""A container's terminationMessagePath when it names none."""
TERMINATION_MESSAGE_BYTES = 4096
"""The most of a termination message file the kubelet reports."""


def termination_message_file(container: Mapping[str, Any], pod_home: Path) -> tuple[str, Path]:
    """(the container's terminationMessagePath, the local file standing for it), the file created empty as the
    kubelet creates it: mapped like a mount, so a command told the path writes where the kubelet reads."""
    local = pod_home / "termination-log"
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_bytes(b"")
    return container.get("terminationMessagePath") or TERMINATION_MESSAGE_PATH, local


def termination_message(local: Path) -> str:
    """What the container wrote at its terminationMessagePath (its first 4096 bytes), or ''."""
    try:
        with open(local, "rb") as message:
            return message.read(TERMINATION_MESSAGE_BYTES).decode(errors="replace")
    except OSError:
        return ""


def rewrite_paths(value: str, mapped: list[tuple[str, Path]]) -> str:
    for mount_path, local in mapped:
        value = re.sub(rf"(?<![\w.\-/]){re.escape(mount_path)}(?=$|/|[^\w.\-])", lambda _, local=local: str(local),
                       value)
    return value


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined variables are replaced, `$$` is `$`, the rest stays as written."""
    return _REFERENCE.sub(lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), value)


def _field_ref(pod: Mapping[str, Any], path: str, ip: str, node: str) -> str:
    meta, spec = pod["metadata"], pod.get("spec", {})
    if match := re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path):
        return (meta.get(match[1]) or {}).get(match[2], "")
    fields = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"], "metadata.uid": meta["uid"],
              "spec.nodeName": node, "spec.serviceAccountName": spec.get("serviceAccountName", "default"),
              "status.podIP": ip, "status.podIPs": ip, "status.hostIP": "127.0.0.1", "status.hostIPs": "127.0.0.1"}
    if path not in fields:
        raise NotReady("CreateContainerConfigError", f"unsupported fieldRef fieldPath: {path!r}")
    return fields[path]


def _resource_ref(container: Mapping[str, Any], ref: Mapping[str, Any], allocatable: Mapping[str, Any]) -> str:
    kind, _, resource = ref["resource"].partition(".")
    resources = container.get("resources") or {}
    amount = (resources.get(kind) or {}).get(resource) or (resources.get("limits") or {}).get(resource) \
        or allocatable.get(resource, 0)
    divisor = parse_quantity(ref.get("divisor", "1"))
    return str(math.ceil(parse_quantity(amount) / divisor))


async def environment(get: Getter, pod: Mapping[str, Any], container: Mapping[str, Any], *, ip: str, node: str,
                      allocatable: Mapping[str, Any]) -> dict[str, str]:
    """The container's own variables (envFrom, then env), references resolved."""
    namespace = pod["metadata"]["namespace"]
    env: dict[str, str] = {}
    for source in container.get("envFrom") or []:
        ref = source.get("configMapRef") or source.get("secretRef") or {}
        kind = "configmap" if "configMapRef" in source else "secret"
        data = await _source(get, kind, namespace, ref["name"], ref.get("optional", False)) or {}
        env.update({source.get("prefix", "") + key: value for key, value in data.items()})
    for var in container.get("env") or []:
        source = var.get("valueFrom")
        if source is None:
            env[var["name"]] = expand(str(var.get("value", "")), env)
        elif "fieldRef" in source:
            env[var["name"]] = _field_ref(pod, source["fieldRef"]["fieldPath"], ip, node)
        elif "resourceFieldRef" in source:
            env[var["name"]] = _resource_ref(container, source["resourceFieldRef"], allocatable)
        else:
            ref = source.get("configMapKeyRef") or source.get("secretKeyRef")
            kind = "configmap" if "configMapKeyRef" in source else "secret"
            data = await _source(get, kind, namespace, ref["name"], ref.get("optional", False))
            if data is not None and ref["key"] in data:
                env[var["name"]] = data[ref["key"]]
            elif not ref.get("optional", False):
                raise NotReady("CreateContainerConfigError", f'couldn\'t find key {ref["key"]} in {kind} '
                                                             f'{namespace}/{ref["name"]}')
    return env


def base_environment(pod: Mapping[str, Any], home: Path, kubeconfig: Path, gpus: list[int]) -> dict[str, str]:
    home.mkdir(parents=True, exist_ok=True)
    (home / "tmp").mkdir(exist_ok=True)
    venv_bin = str(Path(sys.executable).parent)
    return {
        "PATH": os.pathsep.join([venv_bin, os.environ.get("PATH", "/usr/bin:/bin")]),
        "HOME": str(home), "TMPDIR": str(home / "tmp"), "LANG": "C.UTF-8",
        "HOSTNAME": pod.get("spec", {}).get("hostname") or pod["metadata"]["name"],
        "KUBECONFIG": str(kubeconfig), "CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus)),
    }


def command(container: Mapping[str, Any], env: Mapping[str, str], mapped: list[tuple[str, Path]]) -> list[str]:
    if not container.get("command"):
        raise NotReady("CreateContainerError", "the test kubelet runs a container's explicit `command` (it knows "
                                               "no image entrypoints)")
    return executable([expand(str(part), env) for part in [*container["command"], *(container.get("args") or [])]],
                      mapped)


def executable(parts: list[str], mapped: list[tuple[str, Path]]) -> list[str]:
    """A command as this machine runs it (a container's, or an exec probe's or hook's): mount paths rewritten to their
    directories, `python` this interpreter."""
    argv = [rewrite_paths(str(part), mapped) for part in parts]
    if argv and re.fullmatch(r"python(3(\.\d+)?)?", Path(argv[0]).name):
        argv[0] = sys.executable
    return argv


def working_directory(container: Mapping[str, Any], mapped: list[tuple[str, Path]], own: Path) -> Path:
    wanted = container.get("workingDir")
    if not wanted:
        path = own / "rootfs"
    else:
        path = Path(rewrite_paths(wanted, mapped))
        if str(path) == wanted:  # not under a mount: inside the pod's own root
            path = own / "rootfs" / wanted.lstrip("/")
    path.mkdir(parents=True, exist_ok=True)
    return path
