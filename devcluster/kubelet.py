"""A test kubelet, and the scheduler of its nodes: runs each pod's FIRST container as a local process.

One kubelet stands for every node (one, `tandem-node`, by default; with `nodes=N` they are `tandem-node`,
`tandem-node-2`, ... `tandem-node-N`, each with the same capacity and labels): the pods of all of them are local
processes on this machine, on one pod network, and a pod's node is its `spec.nodeName`. It lists and watches pods
through the API like a kubelet (its own aiohttp client, on the emulator's event loop):

- scheduling (scheduling.py): an unscheduled pod with the default scheduler that fits a node's capacity is bound to
  one (`pods/NAME/binding`); one that fits none stays Pending with PodScheduled=False, reason Unschedulable and the
  scheduler's message; a persistentVolumeClaim must exist (it is Bound on first use, as WaitForFirstConsumer);
- images: an allow-list of patterns (default: everything); another image stays Pending, waiting with ErrImagePull
  and then ImagePullBackOff, the message naming the image;
- running (sandbox.py, network.py): Pending/ContainerCreating, then Running with containerStatuses[0].state.running;
  on exit `terminated` (exitCode, reason Completed/Error, message: the log's tail with FallbackToLogsOnError,
  podstatus.py), phase Succeeded/Failed for `restartPolicy: Never`; `OnFailure` and `Always` restart the container
  after a doubling back-off (CrashLoopBackOff, restartCount, lastState);
- probes (probes.py): startupProbe, readinessProbe, livenessProbe (httpGet at the pod's IP, tcpSocket, exec) with
  their timings and thresholds. containerStatuses[0].started and .ready, and the pod's ContainersReady and Ready
  conditions, follow them; a running container without probes is started and Ready at once. A startup or liveness
  probe's failure kills the container as a deletion would (preStop, SIGTERM, SIGKILL after the grace period) and it
  restarts as its restartPolicy says, with the kubelet's Unhealthy and Killing Events;
- deletion: the container's `lifecycle.preStop` hook (exec or httpGet) first, then SIGTERM to its main process (as
  a container's PID 1 gets it), SIGKILL to its whole process group when the grace period
  (deletionGracePeriodSeconds) is over: the hook's time counts against it, and a hook that outlasts it gets 2 s more
  after SIGTERM, as the kubelet gives. Meanwhile the pod stays Running and readiness is still probed. Then the pod
  is deleted for good (gracePeriodSeconds=0); a pod removed at once (force deletion) is killed at once, no hook;
- output: each container run's stdout+stderr in a log file (`log_path`, `logs`, and the API's `pods/NAME/log`);
- a node lost (`lose`, `Cluster.lose_node`): the process group of every pod bound to it is frozen at once (SIGSTOP),
  so its connections stay open and silent, as a dead machine's do (no FIN or RST: its peers see nothing until their
  own timeouts, not the instant close that a SIGKILL on this shared kernel would give), and its kubelet stops (no
  status, no probes, no restarts, no Events for its pods; it ignores what its watch says of them), while the other
  nodes' pods run on; the frozen processes are SIGKILLed when the node comes back (its machine rebooted) or when
  the kubelet stops, whichever is first. The node lifecycle controller and PodGC are emulated on a compressed
  clock (the Node's Ready Unknown, its unfinished pods Failed with reason NodeLost and a DisruptionTarget
  condition); the scheduler binds nothing to the node while it is not Ready (Unschedulable, "1 node(s) were not
  ready"). After `down_seconds` its kubelet comes back (same node, capacity free, Ready): it deletes for good
  (grace 0) the pods bound to it that were marked for deletion, leaves finished ones, and runs new ones;
- shutdown: every process group is killed (a lost node's frozen ones too); processes also die with this thread
  (PR_SET_PDEATHSIG), so none is orphaned; a process's end is awaited through a pidfd on the event loop, so no
  waiter thread outlives a test.

Accessors for tests (any thread): `node(name)` (a scheduling.Node; `nodes` by name), `log_path`, `logs`,
`claim_dir`, `pod_dir`, `pid`, and `kill` (a crash).
`restart_backoff` and `pull_backoff` (seconds) may be set at any time.
Not emulated: init containers, sidecars and any container but the first, postStart hooks, grpc probes, resource
limits (nothing is throttled or OOM-killed), image pulls, node pressure and eviction.
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import aiohttp
import kmock

from . import faults, network, podstatus, probes, sandbox
from .apiclient import Api, ApiError, Informer
from .network import Network
from .runs import PodRun, Process, die_with_parent, quietly
from .scheduling import Node, Scheduler

logger = logging.getLogger(__name__)


class Kubelet:
    def __init__(self, url: str, root: Path, kubeconfig: Path, *, nodes: int = 1,
                 capacity: Mapping[str, Any] | None = None, labels: Mapping[str, str] | None = None,
                 images: Iterable[str] = ("*",), extra_env: Mapping[str, str] | None = None,
                 pull_backoff: float = 0.3, restart_backoff: float = 1.0) -> None:
        self.api, self.root, self.kubeconfig = Api(url, token="client-kubelet"), Path(root), Path(kubeconfig)
        if nodes < 1:
            raise ValueError(f"a kubelet needs at least one node, not {nodes}")
        names = ["tandem-node", *(f"tandem-node-{number}" for number in range(2, nodes + 1))]
        self.nodes = {name: Node(name, capacity, labels) for name in names}  # in the scheduler's order
        self.network = Network()
        self.images, self.extra_env = list(images), dict(extra_env or {})
        self.pull_backoff, self.restart_backoff = pull_backoff, restart_backoff
        self.informer = Informer(self.api, "/api/v1/pods", self._observe)
        self.pods: dict[str, dict[str, Any]] = self.informer.objects  # every pod by uid
        self.runs: dict[str, PodRun] = {}  # the pods on the nodes, by uid
        self.done: dict[tuple[str, str], PodRun] = {}  # the last run of each removed pod, for its logs
        self.scheduler = Scheduler(self.api, list(self.nodes.values()), self.pods)
        self.writer: Any = None  # the emulator's Writer (set by the harness): `lose` writes the controllers' part
        self.pod_paths: dict[str, list[tuple[str, str]]] = {}  # pod token -> (local directory, mount path)
        self._tasks: list[asyncio.Task] = []
        self._lock = threading.Lock()
        self._probes: aiohttp.ClientSession | None = None  # probes' and hooks' HTTP client
        self._events: dict[asyncio.Task, str] = {}  # Events being written, to the node of the pod they are about
        self.grace_for_node_monitor = 0.2  # seconds between the loss and the node lifecycle controller's marks
        self._recoveries: list[asyncio.Task] = []  # of the nodes lost
        self._frozen: dict[str, PodRun] = {}  # the runs of the pods on lost nodes, by uid: SIGSTOPped, not yet killed

    # -- accessors for tests (any thread) -------------------------------------------------------------------------
    def node(self, name: str | None = None) -> Node:
        """The node of that name (KeyError if there is none); None: the first, `tandem-node`."""
        return self.nodes[name] if name is not None else next(iter(self.nodes.values()))

    def _find(self, namespace: str, name: str) -> PodRun | None:
        with self._lock:
            for run in self.runs.values():
                if (run.pod["metadata"]["namespace"], run.pod["metadata"]["name"]) == (namespace, name):
                    return run
            return self.done.get((namespace, name))

    def log_path(self, namespace: str, name: str, previous: bool = False) -> Path | None:
        run = self._find(namespace, name)
        logs = run.logs if run else []
        return logs[-2 if previous else -1] if len(logs) >= (2 if previous else 1) else None

    def logs(self, namespace: str, name: str) -> str:
        path = self.log_path(namespace, name)
        return path.read_text(errors="replace") if path and path.exists() else ""

    def read_log(self, namespace: str, name: str, container: str | None, previous: bool) -> bytes | None:
        path = self.log_path(namespace, name, previous)
        return path.read_bytes() if path and path.exists() else None

    def claim_dir(self, namespace: str, claim: str) -> Path:
        return sandbox.claim_dir(self.root, namespace, claim)

    def pod_dir(self, namespace: str, name: str) -> Path | None:
        run = self._find(namespace, name)
        return sandbox.pod_dir(self.root, run.pod) if run else None

    def pid(self, namespace: str, name: str) -> int | None:
        """The container's main process, while it runs."""
        run = self._find(namespace, name)
        return run.process.pid if run and run.process and run.process.returncode is None else None

    def kill(self, namespace: str, name: str, sig: int = signal.SIGKILL) -> int:
        """Signal the pod's main process (a crash, an OOM kill...); the kubelet reports its end as any other."""
        pid = self.pid(namespace, name)
        if pid is None:
            raise ProcessLookupError(f"pod {namespace}/{name} has no running process")
        os.kill(pid, sig)
        return pid

    # -- start and stop -------------------------------------------------------------------------------------------
    async def start(self) -> None:
        await self.api.open()
        for node in self.nodes.values():
            path = f"/api/v1/nodes/{node.name}"
            if await self.api.get(path) is None:
                await self.api.request("POST", "/api/v1/nodes", {"apiVersion": "v1", "kind": "Node", "metadata": {
                    "name": node.name, "labels": node.labels}})
            await self.api.patch_status(path, node.manifest())
        self._probes = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))  # no keep-alive
        await self.informer.start()
        self._tasks = [asyncio.create_task(self.scheduler.run(), name="scheduler")]

    async def stop(self) -> None:
        with self._lock:
            runs = [*self.runs.values(), *self._frozen.values()]  # SIGKILL ends a stopped process too
        await self._end_runs(runs, *self._tasks, *self._recoveries, *self._events)
        await self.informer.stop()
        if self._probes is not None:
            await self._probes.close()
        await self.api.close()

    async def _end_runs(self, runs: list[PodRun], *tasks: asyncio.Task) -> None:
        """SIGKILL the runs' process groups and cancel their tasks and `tasks`; returns once every process has
        ended."""
        for run in runs:
            self._kill(run, signal.SIGKILL)
        tasks = (*tasks, *(run.task for run in runs if run.task))
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for run in runs:
            if run.process is not None:
                await run.process.wait()

    # -- a node lost ----------------------------------------------------------------------------------------------
    async def lose(self, down_seconds: float = 5.0, node: str | None = None) -> None:
        """The node's machine (`node`, by name; None: the first, `tandem-node`) dies and comes back after
        `down_seconds` (a reboot, or a replacement under the same name). Returns once it is down; the recovery runs
        in the background (`Node.ready` again).

        At once: the process group of every pod bound to it is frozen (SIGSTOP), not killed: its connections stay
        open and silent, so its peers on the other nodes see no FIN or RST, only silence until their own timeouts
        (heartbeats, keep-alives), as with a dead machine; and its kubelet stops (its pods' run tasks and pending
        Events cancelled: no status, no probes, no restarts; it ignores what its watch says of them); the other
        nodes' pods are not touched. The frozen processes are SIGKILLed (and waited for) when the node comes back,
        its machine rebooted, before its kubelet starts again, or when the kubelet stops, whichever is first. Then, on a
        compressed clock (`grace_for_node_monitor`, 40 s on a cluster), the part of kube-controller-manager emulated
        here: the node lifecycle controller sets the Node's Ready condition to Unknown (NodeStatusUnknown), and PodGC
        marks each pod bound to it that had not finished Failed, reason NodeLost, with a DisruptionTarget condition
        (DeletionByPodGC) and Ready False (it does not delete them here). The scheduler binds nothing to the node
        while it is not Ready: a new pod that fits on no other node stays Pending, Unschedulable."""
        lost = self.node(node)
        if not lost.ready:
            raise RuntimeError(f"node {lost.name} is already down")
        lost.ready = False
        with self._lock:
            runs = [run for run in self.runs.values() if run.pod["spec"]["nodeName"] == lost.name]
            self._frozen.update((run.uid, run) for run in runs)  # before the tasks end: `_run` then kills nothing
        for run in runs:
            self._kill(run, signal.SIGSTOP)
        tasks = [*(run.task for run in runs if run.task),
                 *(task for task, on in self._events.items() if on == lost.name)]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(self.grace_for_node_monitor)  # any status write already sent is served before the marks
        self._mark_node_lost(lost.name)
        self.scheduler.kick.set()
        self._recoveries.append(asyncio.create_task(self._recover_after(lost, down_seconds),
                                                    name=f"recovery of {lost.name}"))

    def _mark_node_lost(self, name: str) -> None:
        """kube-controller-manager's node lifecycle controller and PodGC, written straight into the store."""
        writer = self.writer
        now = podstatus.timestamp()
        nodes = writer.catalog.lookup("nodes")
        key = writer.key(nodes, None, name)
        node = writer.store.get(key)
        if node is not None:
            status = node.get("status") or {}
            others = [c for c in status.get("conditions") or [] if c.get("type") != "Ready"]
            node["status"] = {**status, "conditions": [*others, *faults.node_unknown_conditions(now)]}
            writer.update(nodes, key, node, subresource="status", system=True)
        pods = writer.catalog.lookup("pods")
        for key in writer.store.keys(pods.resource):
            pod = writer.store.get(key)
            if pod is None or (pod.get("spec") or {}).get("nodeName") != name \
                    or (pod.get("status") or {}).get("phase") in ("Succeeded", "Failed"):
                continue
            pod["status"] = faults.node_lost_status(pod, name, now)
            with quietly(kmock.KubernetesError):
                writer.update(pods, key, pod, subresource="status", system=True)

    async def _recover_after(self, node: Node, down_seconds: float) -> None:
        await asyncio.sleep(down_seconds)
        await self._kill_frozen(node)  # the machine rebooted: what ran on it is gone
        while True:
            try:
                await self._recover(node)
                return
            except (ApiError, aiohttp.ClientError) as error:  # faults injected for the kubelet, say
                logger.warning("kubelet: recovering node %s: %s; trying again", node.name, error)
                await asyncio.sleep(0.5)

    async def _kill_frozen(self, node: Node) -> None:
        """SIGKILL the process groups frozen when `node` was lost and wait for them to end (what they held of the
        node, `_recover` releases with the rest)."""
        with self._lock:
            runs = [run for run in self._frozen.values() if run.pod["spec"]["nodeName"] == node.name]
        await self._end_runs(runs)
        with self._lock:
            for run in runs:
                self._frozen.pop(run.uid, None)

    async def _recover(self, node: Node) -> None:
        """The node's kubelet starts again: Ready, capacity free, each pod bound to the node looked at once more
        (those marked for deletion meanwhile are removed for good, finished ones left as they are, new ones run)."""
        for uid in list(node.allocated):
            node.release(uid)
        await self.api.patch_status(f"/api/v1/nodes/{node.name}", node.manifest())
        selector = {"fieldSelector": f"spec.nodeName={node.name}"}
        listing = await self.api.request("GET", "/api/v1/pods", params=selector)
        node.ready = True
        for pod in listing["items"]:
            meta = pod["metadata"]
            if meta.get("deletionTimestamp"):
                path = f"/api/v1/namespaces/{meta['namespace']}/pods/{meta['name']}"
                try:
                    await self.api.request("DELETE", path, {"gracePeriodSeconds": 0,
                                                            "preconditions": {"uid": meta["uid"]}})
                except ApiError as error:
                    if error.status not in (404, 409):
                        raise
            elif (held := self.pods.get(meta["uid"])) is not None:
                self._observe("MODIFIED", held)
        self.scheduler.kick.set()

    # -- the pods, as the API tells (`informer` holds them in `pods`) ----------------------------------------------
    def _observe(self, type_: str, pod: dict[str, Any]) -> None:
        uid, meta, spec = pod["metadata"]["uid"], pod["metadata"], pod.get("spec", {})
        run = self.runs.get(uid)
        self.scheduler.kick.set()
        if type_ == "DELETED":
            self.scheduler.pending.pop(uid, None)
            if run:
                run.pod, run.removed = pod, True
                run.changed.set()
            return
        if not spec.get("nodeName"):
            if spec.get("schedulerName", "default-scheduler") == "default-scheduler" \
                    and not meta.get("deletionTimestamp"):
                self.scheduler.pending[uid] = None
            return
        self.scheduler.pending.pop(uid, None)
        node = self.nodes.get(spec["nodeName"])
        if node is None or not node.ready:
            return  # not a node of ours, or one lost: its kubelet hears nothing (the scheduler above still does)
        if run is not None:
            run.pod = pod
            run.changed.set()
        elif pod.get("status", {}).get("phase") not in ("Succeeded", "Failed"):
            run = PodRun(uid, pod)
            with self._lock:
                self.runs[uid] = run
            run.task = asyncio.create_task(self._run(run), name=f"pod {meta['namespace']}/{meta['name']}")

    # -- one pod --------------------------------------------------------------------------------------------------
    def _node_of(self, run: PodRun) -> Node:
        return self.nodes[run.pod["spec"]["nodeName"]]

    async def _run(self, run: PodRun) -> None:
        try:
            await self._lifecycle(run)
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("kubelet: pod %s failed in the test kubelet", run.path)
        finally:
            if run.uid not in self._frozen:
                self._kill(run, signal.SIGKILL)
                self._node_of(run).release(run.uid)
            # A frozen run (its node lost) keeps its process and its node's allocation until `_kill_frozen`, but not
            # its MASTER_PORT group: a new group must get a fresh port, not the one a frozen rank 0's store may still
            # listen on (free_port binds every interface, so the kernel hands out no port a frozen process holds).
            # Its address is no problem either: a replacement pod with its hostname and subdomain gets the same
            # one (network.py keeps it by DNS name), which is harmless, as ranks listen on ephemeral ports and the
            # store, on rank 0 only, listens on the group's port on every interface anyway.
            self.network.release(run.uid)
            self.scheduler.kick.set()
            with self._lock:
                self.runs.pop(run.uid, None)
                meta = run.pod["metadata"]
                self.done[meta["namespace"], meta["name"]] = run

    async def _lifecycle(self, run: PodRun) -> None:
        container = run.pod["spec"]["containers"][0]
        ip = self.network.address_for_pod(run.pod)
        run.book = podstatus.StatusBook(run.pod, self._node_of(run).name, ip)
        image = container.get("image", "")
        if not run.deleting and not any(fnmatch.fnmatchcase(image, pattern) for pattern in self.images):
            await self._report(run, podstatus.waiting("ErrImagePull", f'failed to pull and unpack image "{image}": '
                                                      f"not in the test kubelet's images {self.images}"))
            if not await self._pause(run, self.pull_backoff):
                await self._report(run, podstatus.waiting("ImagePullBackOff", f'Back-off pulling image "{image}"'))
                await self._pause(run, float("inf"))
        restarts, last_state = 0, None
        while not run.deleting:
            await self._report(run, podstatus.waiting("ContainerCreating"), phase="Running" if restarts else "Pending",
                               restarts=restarts, last_state=last_state)
            try:
                launch = await self._prepare(run, ip)
            except sandbox.NotReady as error:
                await self._report(run, podstatus.waiting(error.reason, str(error)))
                await self._pause(run, 1.0)
                continue
            state = await self._execute(run, launch, restarts, last_state)
            code = state["terminated"]["exitCode"]
            policy = run.pod["spec"].get("restartPolicy", "Always")
            if run.deleting or policy == "Never" or (policy == "OnFailure" and code == 0):
                await self._report(run, state, phase="Succeeded" if code == 0 else "Failed", restarts=restarts,
                                   last_state=last_state)
                self._node_of(run).release(run.uid)
                self.scheduler.kick.set()
                await self._pause(run, float("inf"))
                break
            last_state, restarts = state, restarts + 1
            backoff = min(self.restart_backoff * 2 ** (restarts - 1), 30.0)
            await self._report(run, podstatus.waiting("CrashLoopBackOff", f"back-off {backoff:g}s restarting failed "
                                                      f"container={container['name']}"),
                               phase="Running", restarts=restarts, last_state=last_state)
            await self._pause(run, backoff)
        if not run.removed:  # the kubelet's last word: the pod may go now
            try:
                await self.api.request("DELETE", run.path, {"gracePeriodSeconds": 0,
                                                            "preconditions": {"uid": run.uid}})
            except ApiError as error:
                if error.status not in (404, 409):
                    raise

    async def _prepare(self, run: PodRun, ip: str) -> sandbox.Launch:
        pod, get = run.pod, self.api.get
        namespace, container = pod["metadata"]["namespace"], pod["spec"]["containers"][0]
        dirs = await sandbox.volumes(get, self.root, pod)
        termination = sandbox.termination_message_file(container, sandbox.pod_dir(self.root, pod))
        mapped = sorted([*sandbox.mounts(container, dirs), termination], key=lambda m: -len(m[0]))
        node = self._node_of(run)
        own = await sandbox.environment(get, pod, container, ip=ip, node=node.name, allocatable=node.capacity)
        known = await self._known_names()
        env, master = {}, None
        for key, value in own.items():
            env[key], name = self.network.resolve(namespace, sandbox.rewrite_paths(value, mapped), known)
            env[key] = network.bind_to_pod(env[key], ip)
            master = name if key == "MASTER_ADDR" else master
        if master is not None and env.get("MASTER_PORT"):
            env["MASTER_PORT"] = str(self.network.group_port(master, env["MASTER_PORT"], run.uid))
        home = sandbox.pod_dir(self.root, pod)
        kubeconfig = self._pod_kubeconfig(run, home, mapped)
        env = {**sandbox.base_environment(pod, home / "home", kubeconfig, node.gpus.get(run.uid, [])),
               **self.extra_env, **env, "KUBECONFIG": str(kubeconfig)}
        for variable in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT"):
            env.pop(variable, None)
        argv = [network.bind_to_pod(part, ip) for part in sandbox.command(container, env, mapped)]
        return sandbox.Launch(argv, env, sandbox.working_directory(container, mapped, home), mapped,
                              termination_message=termination[1])

    def _pod_kubeconfig(self, run: PodRun, home: Path, mapped: list[tuple[str, Path]]) -> Path:
        """The cluster's kubeconfig with the pod's own bearer token: the emulator maps the local directories in
        this pod's writes back to their mount paths (`Emulator.pod_paths`), so what it reports reads as on a cluster."""
        config = json.loads(self.kubeconfig.read_text())
        token = f"pod-{run.uid}"
        for user in config["users"]:
            user["user"] = {"token": token}
        self.pod_paths[token] = [(str(local), mount_path) for mount_path, local in mapped]
        path = home / "kubeconfig"
        path.write_text(json.dumps(config))
        return path

    async def _known_names(self):
        services = await self.api.request("GET", "/api/v1/services")
        named = {(s["metadata"]["namespace"], s["metadata"]["name"]) for s in services["items"]}
        hosts = {(p["metadata"]["namespace"], p["spec"]["hostname"], p["spec"]["subdomain"])
                 for p in self.pods.values() if p.get("spec", {}).get("hostname") and p["spec"].get("subdomain")}
        return lambda name: name in hosts or (name[0], name[2]) in named

    async def _execute(self, run: PodRun, launch: sandbox.Launch, restarts: int, last_state: dict | None) -> dict:
        container = run.pod["spec"]["containers"][0]
        log = sandbox.pod_dir(self.root, run.pod) / "logs" / f"{container['name']}-{restarts}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        run.logs.append(log)
        started = podstatus.timestamp()
        with open(log, "wb") as output:
            try:
                process = Process(subprocess.Popen(
                    launch.argv, env=launch.env, cwd=launch.cwd, stdin=subprocess.DEVNULL, stdout=output,
                    stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=die_with_parent))
            except OSError as error:
                message = f'exec: "{launch.argv[0]}": {error.strerror}'
                output.write(f"{message}\n".encode())
                self.network.release(run.uid)
                return podstatus.terminated(128, started, reason="StartError", message=message)
        run.process, run.stop = process, None
        target = probes.Target(container, run.book.ip, launch, self._probes)
        prober = probes.Prober(target, on_change=lambda: self._probed(run, prober),
                               on_kill=lambda kill: self._stop_for(run, kill),
                               on_event=lambda *event: self._event(run, *event))
        run.started, run.ready = prober.started, prober.ready
        container_id = f"tandem://{run.uid[:8]}-{restarts}"
        await self._report(run, podstatus.running(started), phase="Running", restarts=restarts,
                           last_state=last_state, container_id=container_id)
        probing = asyncio.create_task(prober.run(), name=f"probes {run.path}")
        try:
            await self._supervise(run, process, target)
        finally:
            probing.cancel()
            await asyncio.gather(probing, return_exceptions=True)
            run.started = run.ready = False
        self.network.release(run.uid)
        code = process.returncode if process.returncode >= 0 else 128 - process.returncode
        message = sandbox.termination_message(launch.termination_message)
        if not message and container.get("terminationMessagePolicy") == "FallbackToLogsOnError" and code != 0:
            message = podstatus.log_tail(log)
        return podstatus.terminated(code, started, message=message or None, container_id=container_id)

    @staticmethod
    def _probed(run: PodRun, prober: probes.Prober) -> None:
        """What the probes found changed: the run's next status tells it (see `_until`)."""
        run.started, run.ready = prober.started, prober.ready
        run.changed.set()

    def _stop_for(self, run: PodRun, kill: probes.Kill) -> None:
        """A probe failed: the container must go (unless the pod is going anyway)."""
        if run.stop is None and not run.deleting:
            run.stop = kill
            self._event(run, "Normal", "Killing", kill.message)
            run.changed.set()

    async def _supervise(self, run: PodRun, process: Process, target: probes.Target) -> None:
        """Wait for the process to end, writing what the probes find; when the pod is deleted, or a probe killed the
        container, stop it: the preStop hook, SIGTERM, and SIGKILL to its group when the grace period is over."""
        exited = asyncio.ensure_future(process.wait())
        await self._until(run, exited, lambda: 0.0 if run.deleting or run.stop else None)
        if not exited.done():
            await self._stop(run, process, exited, target)
        self._kill(run, signal.SIGKILL, leftovers=True)  # what the main process left behind goes with the container

    async def _stop(self, run: PodRun, process: Process, exited: asyncio.Future, target: probes.Target) -> None:
        asked = time.monotonic()

        def grace() -> float:
            if run.deleting or run.stop.grace is None:
                return run.grace
            return run.stop.grace

        hook = (target.container.get("lifecycle") or {}).get("preStop")
        overran = False
        if hook and grace() > 0:
            hooked = asyncio.ensure_future(target.check(hook, None))
            either = asyncio.ensure_future(asyncio.wait({hooked, exited}, return_when=asyncio.FIRST_COMPLETED))
            overran = not await self._until(run, either, lambda: asked + grace())
            either.cancel()
            if hooked.done() and hooked.exception() is None and not hooked.result()[0]:
                self._event(run, "Warning", "FailedPreStopHook", f"PreStopHook failed: {hooked.result()[1]}")
            hooked.cancel()
            await asyncio.gather(hooked, return_exceptions=True)
        if process.returncode is None:  # (an ended process's number may be reused)
            with quietly():
                os.kill(process.pid, signal.SIGTERM)
        signalled = time.monotonic()

        def kill_at() -> float:
            deadline = asked + grace()
            return deadline if run.removed or not overran else max(deadline, signalled + 2)

        if not await self._until(run, exited, kill_at):
            self._kill(run, signal.SIGKILL)
            await exited

    async def _until(self, run: PodRun, future: asyncio.Future, deadline: Callable[[], float | None]) -> bool:
        """Wait for `future` until `deadline()` (a time.monotonic() instant; None: no limit), read again whenever the
        pod changes; meanwhile write what the probes find. Returns whether `future` is done."""
        while not future.done():
            run.changed.clear()
            if (run.started, run.ready) != run.reported and run.last_report is not None:
                await self._report(run, **run.last_report)
            end = deadline()
            remaining = None if end is None else end - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            changed = asyncio.ensure_future(run.changed.wait())
            await asyncio.wait({future, changed}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            changed.cancel()
        return True

    def _kill(self, run: PodRun, sig: int, leftovers: bool = False) -> None:
        """Signal the container's process group: while its main process runs, or (`leftovers`) right after it
        ended (never later: its number could be reused)."""
        if run.process is not None and (leftovers or run.process.returncode is None):
            with quietly():
                os.killpg(run.process.pid, sig)

    async def _pause(self, run: PodRun, seconds: float) -> bool:
        """Sleep up to `seconds`, less if the pod is being deleted; returns whether it is."""
        end = time.monotonic() + seconds
        while not run.deleting and time.monotonic() < end:
            run.changed.clear()
            if run.deleting:
                break
            with quietly(TimeoutError):
                await asyncio.wait_for(run.changed.wait(), None if seconds == float("inf") else end - time.monotonic())
        return run.deleting

    async def _report(self, run: PodRun, state: dict[str, Any], *, phase: str = "Pending", restarts: int = 0,
                      last_state: dict | None = None, container_id: str | None = None) -> None:
        if run.removed:
            return
        run.last_report = {"state": state, "phase": phase, "restarts": restarts, "last_state": last_state,
                           "container_id": container_id}
        run.reported = (run.started, run.ready)
        status = run.book.status(state, phase=phase, restarts=restarts, last_state=last_state,
                                 container_id=container_id, started=run.started, ready=run.ready)
        try:
            await self.api.patch_status(run.path, status)
        except ApiError as error:
            if error.status != 404:
                logger.warning("kubelet: status of %s: %s", run.path, error)

    def _event(self, run: PodRun, type_: str, reason: str, message: str) -> None:
        """A core/v1 Event about the pod's container, as the kubelet writes them (in the background)."""
        meta, container = run.pod["metadata"], run.pod["spec"]["containers"][0]["name"]
        node, now = self._node_of(run).name, podstatus.timestamp()
        event = {"metadata": {"generateName": f"{meta['name']}."}, "type": type_, "reason": reason,
                 "message": message, "count": 1, "firstTimestamp": now, "lastTimestamp": now,
                 "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": meta["namespace"],
                                    "name": meta["name"], "uid": meta["uid"],
                                    "fieldPath": f"spec.containers{{{container}}}"},
                 "source": {"component": "kubelet", "host": node},
                 "reportingComponent": "kubelet", "reportingInstance": node}
        task = asyncio.get_running_loop().create_task(self._post_event(meta["namespace"], event))
        self._events[task] = node
        task.add_done_callback(self._events.pop)

    async def _post_event(self, namespace: str, event: dict[str, Any]) -> None:
        try:
            await self.api.request("POST", f"/api/v1/namespaces/{namespace}/events", event)
        except (ApiError, aiohttp.ClientError) as error:
            logger.warning("kubelet: event %s: %s", event["reason"], error)
