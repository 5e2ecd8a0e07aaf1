"""`Cluster`: the emulator and the test kubelet, for synchronous tests.

    with Cluster(tmp_path) as cluster:
        cluster.apply({"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "x"}, "data": {"k": "v"}})
        cluster.core.create_namespaced_pod("default", pod)               # the `kubernetes` client, configured
        pod = cluster.wait_for(lambda: cluster.get("pods", "default", "p")["status"]["phase"] == "Succeeded",
                               timeout=10, what="p to succeed")
        cluster.logs("default", "p")                                      # what the pod's process printed
        cluster.kubelet.claim_dir("default", "data")                      # a PVC's local directory
        operator = cluster.spawn([sys.executable, "-m", "kopf", "run", ...], name="operator")  # KUBECONFIG set

On entering: the emulator serves on a real TCP port of 127.0.0.1 (`url`), `kubeconfig` points at it, namespace
`default` exists, the repository's CRDs (crds/) are applied, and the kubelet and the Deployment controller
(deployments.py: Deployments keep their pods, owned directly with no ReplicaSets, and roll them) run; all of it on an
event loop in a background thread. `shutdown()` (on leaving) kills every process (pods' and spawned ones), stops the
server and the loop and joins the thread, so nothing is left between tests.

Nodes: one, `tandem-node`, by default; `Cluster(nodes=N)` registers N, `tandem-node`, `tandem-node-2`, ...
`tandem-node-N`, each with `capacity` and `node_labels` (and its own `kubernetes.io/hostname`), all run by the one
kubelet (`cluster.kubelet.node(name)`, `cluster.kubelet.nodes`). A pod's node is its `spec.nodeName`; the scheduler
puts a pod on the Ready node where it fits with the fewest pods (scheduling.py), so pods of equal requests spread.

Kueue (kueue.py): `Cluster(kueue=True)` also installs Kueue's CRDs (`KUEUE_CRDS`: Workload, ClusterQueue,
LocalQueue, ResourceFlavor, WorkloadPriorityClass, kueue.x-k8s.io/v1beta2) and runs `cluster.kueue`, an emulation of
Kueue's admission (quota, queue order, preemption, the Workload's conditions) beside the kubelet; its `history` lists
what it decided. The other projects' CRDs go in `crds`: `Cluster(crds=[CRDS, COSCHEDULING_CRDS, VOLCANO_CRDS])`
(PodGroups of scheduler-plugins and Volcano, validated against their schemas; nothing acts on them). All three are
written here after those projects' APIs, modelling what Tandem and devcluster use (devcluster/crds/README.md).

CRDs: the rules of their schemas (`x-kubernetes-validations`) are enforced as on a cluster (a create that breaks one
answers 422 naming the field and the rule's message; devcluster/cel.py); `crd_without_rules(name)` serves a CRD
without them for a block, to store an object only an older CRD lets in (the operator's own checks then meet it).

kubectl: `KUBECONFIG=<cluster.kubeconfig> kubectl get ptj` prints the CRD's printer columns, and `apply`, `describe`,
`scale`, `patch`, `delete`, `get -w`, `logs` work as on a cluster (the emulator's discovery.py, tables.py, openapi.py;
tests/integration/test_kubectl.py).

Also: `cluster.api` (a configured `kubernetes.client.ApiClient`; `core`, `custom`, `apps` are APIs over it),
`request(method, path, body, content_type)` for raw HTTP, `apply(manifest)`, `history(...)` (every version of an
object), `environ()` (the environment for a process of your own against this cluster), `process_log(name)`,
`stop_process(name)`, `emulator.bugs` (the emulator's own failures, which should stay empty). Faults can be injected
with kmock's DSL on `cluster.emulator` (e.g. `cluster.emulator["patch", re.compile(".*/status")] << 503`); while
any such reaction exists every request goes through kmock's slower matching.

Faults (faults.py), per test: `kubeconfig_for(client)` (a kubeconfig whose bearer token names the client) and
`spawn(argv, name, client="operator")`; `inject(Faults(...))` / `with cluster.faulty(Faults(...)):` (write errors,
latency, hung requests, ended or cut watches, 410 on resume, for the named clients), counted in `emulator.injected`;
`after(predicate, action)` (a `Hook` called once after a served request, e.g. to `kill_process(name)`, a SIGKILL of
the process's group, between two of its writes; `spawn` it again under the same name, its log appended to);
`lose_node(down_seconds, node=None)` (a node's machine dies, the first node's unless `node` names another: its
pods' processes frozen (SIGSTOP: their connections stay open and silent, as a dead machine's), the Node NotReady,
its unfinished pods Failed with NodeLost, nothing scheduled on it; the other nodes' pods run on; it comes back after
`down_seconds`, its frozen processes SIGKILLed first (or when the cluster stops), `node_ready(node)`; see
`Kubelet.lose`).

For Deployments and Services: `deployment_pods(namespace, name)` (the pods a Deployment owns, oldest first; each
pod's own address is `pod["status"]["podIP"]`, where a server told to bind 0.0.0.0 listens: network.py) and
`endpoints(namespace, service)` (`ip:port` of each ready pod behind a Service, as its Endpoints would list them;
a Service has no virtual IP here).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import aiohttp.web
import kubernetes
import yaml

from .deployments import DeploymentController, controller_uid, is_active, is_ready
from .emulator import Emulator
from .faults import Faults, Hook, Served
from .kubelet import Kubelet
from .kueue import KUEUE_CRDS, KueueController
from .runs import die_with_parent

REPO = Path(__file__).resolve().parents[1]
CRDS = REPO / "crds"
T = TypeVar("T")
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # 127.0.0.1 never goes via a proxy
_YAML_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml where there is one: CRDs read faster
_TRANSIENT = (kubernetes.client.ApiException, KeyError, IndexError, TypeError, AttributeError)


class Cluster:
    def __init__(self, workdir: Path | str | None = None, *, crds: Path | Iterable[Path] | None = CRDS,
                 capacity: Mapping[str, Any] | None = None, node_labels: Mapping[str, str] | None = None,
                 images: Iterable[str] = ("*",), extra_env: Mapping[str, str] | None = None,
                 namespaces: Iterable[str] = ("default",), kubelet: bool = True, deployments: bool = True,
                 kueue: bool = False, nodes: int = 1) -> None:
        """`nodes` (how many), `capacity` (cpu, memory, nvidia.com/gpu..., each node's), `node_labels`, `images`
        (the allow-list's patterns) and `extra_env` (added to every pod's process) configure the kubelet;
        `kubelet=False` serves the API alone (pods then stay Pending, unscheduled), as a benchmark of the operator may
        want; `deployments=False` runs no Deployment controller (a Deployment then makes no pods); `kueue=True`
        installs KUEUE_CRDS (besides `crds`) and runs the emulated Kueue admission (`self.kueue`, kueue.py)."""
        self._workdir, self._crds, self._namespaces = workdir, crds, list(namespaces)
        self._with_kubelet, self._with_deployments, self._with_kueue = kubelet, deployments, kueue
        self._kubelet_options = {"nodes": nodes, "capacity": capacity, "labels": node_labels, "images": images,
                                 "extra_env": extra_env}
        self._processes: dict[str, tuple[subprocess.Popen, Path]] = {}
        self.kubelet: Kubelet | None = None
        self.deployments: DeploymentController | None = None
        self.kueue: KueueController | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    # -- start and stop -------------------------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def start(self) -> None:
        if self._workdir is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="tandem-cluster-")
        self.root = Path(self._workdir or self._tmp.name)
        self.root.mkdir(parents=True, exist_ok=True)
        self.kubeconfig = self.root / "kubeconfig"
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cluster", daemon=True)
        self._thread.start()
        try:
            self._call(self._start())
            configuration = kubernetes.client.Configuration()
            kubernetes.config.load_kube_config(str(self.kubeconfig), client_configuration=configuration)
            self.api = kubernetes.client.ApiClient(configuration)
            self.core = kubernetes.client.CoreV1Api(self.api)
            self.custom = kubernetes.client.CustomObjectsApi(self.api)
            self.apps = kubernetes.client.AppsV1Api(self.api)
        except BaseException:
            self.shutdown()
            raise

    async def _start(self) -> None:
        self.emulator = Emulator()
        await self.emulator.__aenter__()
        self._runner = aiohttp.web.ServerRunner(aiohttp.web.Server(self.emulator), shutdown_timeout=2)
        await self._runner.setup()
        site = aiohttp.web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "emulator", "preferences": {},
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                          "namespace": "default"}}]}))
        writer, catalog = self.emulator.writer, self.emulator.catalog
        for namespace in self._namespaces:
            writer.create(catalog.lookup("namespaces"), None, {"metadata": {"name": namespace}})
        crd_kind = catalog.lookup("customresourcedefinitions")
        for path in self._crd_files():
            for document in yaml.load_all(path.read_text(), Loader=_YAML_LOADER):
                if document:
                    writer.create(crd_kind, None, document)
        if self._with_kubelet:
            self.kubelet = Kubelet(self.url, self.root, self.kubeconfig, **self._kubelet_options)
            self.emulator.pod_logs, self.emulator.pod_paths = self.kubelet.read_log, self.kubelet.pod_paths
            self.kubelet.writer = self.emulator.writer
            await self.kubelet.start()
        if self._with_deployments:
            self.deployments = DeploymentController(self.url)
            await self.deployments.start()
        if self._with_kueue:
            self.kueue = KueueController(self.url)
            await self.kueue.start()

    def _crd_files(self) -> list[Path]:
        if self._crds is None and not self._with_kueue:
            return []
        paths = [self._crds] if isinstance(self._crds, (str, Path)) else list(self._crds or [])
        if self._with_kueue:
            paths.append(KUEUE_CRDS)
        return sorted({p.resolve() for path in map(Path, paths)
                       for p in ([path] if path.is_file() else path.glob("*.yaml"))})

    def shutdown(self) -> None:
        """Stop everything this cluster started; safe to call twice."""
        for name in list(self._processes):
            self.stop_process(name)
        if self._loop is not None and self._thread is not None and self._thread.is_alive():
            try:
                self._call(self._stop(), timeout=30)
            finally:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(timeout=10)
        if self._loop is not None and not self._loop.is_running():
            self._loop.close()
        self._loop = None
        if getattr(self, "api", None) is not None:
            self.api.close()
            self.api = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    async def _stop(self) -> None:
        if self.kueue is not None:
            await self.kueue.stop()
        if self.deployments is not None:
            await self.deployments.stop()
        if self.kubelet is not None:
            await self.kubelet.stop()
        if getattr(self, "emulator", None) is not None:
            self.emulator.store.close()
            if getattr(self, "_runner", None) is not None:
                await self._runner.cleanup()
            await self.emulator.__aexit__(None, None, None)
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _call(self, coroutine: Any, timeout: float = 30) -> Any:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop).result(timeout)

    # -- the store, for assertions --------------------------------------------------------------------------------
    def get(self, resource: str, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object as stored now (a copy), or None; `resource` as in 'pods', 'ptj', 'v1/configmaps'."""
        return self.emulator.get(resource, namespace, name)

    def list(self, resource: str, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.emulator.list(resource, namespace)

    def history(self, resource: str, namespace: str | None, name: str) -> list[dict[str, Any] | None]:
        return self.emulator.history(resource, namespace, name)

    def deployment_pods(self, namespace: str, name: str, terminating: bool = False) -> list[dict[str, Any]]:
        """The pods the Deployment owns, oldest first; without `terminating`, only those not being deleted (nor
        ended)."""
        deployment = self.get("deployments", namespace, name)
        if deployment is None:
            return []
        owned = [pod for pod in self.list("pods", namespace) if controller_uid(pod) == deployment["metadata"]["uid"]
                 and (terminating or is_active(pod))]
        return sorted(owned, key=lambda pod: (pod["metadata"]["creationTimestamp"], int(pod["metadata"][
            "resourceVersion"])))

    def endpoints(self, namespace: str, service: str) -> list[str]:
        """`ip:port` of each ready pod (not terminating) the Service selects, for its first port (a named
        targetPort resolved through the pod's container ports), sorted."""
        spec = (self.get("services", namespace, service) or {}).get("spec") or {}
        selector, ports = spec.get("selector") or {}, spec.get("ports") or []
        if not selector or not ports:
            return []
        target = ports[0].get("targetPort", ports[0]["port"])
        found = []
        for pod in self.list("pods", namespace):
            labels = pod["metadata"].get("labels") or {}
            if any(labels.get(k) != v for k, v in selector.items()) or not is_active(pod) or not is_ready(pod):
                continue
            port = target if isinstance(target, int) else next(
                (p["containerPort"] for c in pod["spec"]["containers"] for p in c.get("ports") or []
                 if p.get("name") == target), None)
            if port is not None:
                found.append(f"{pod['status']['podIP']}:{port}")
        return sorted(found)

    def logs(self, namespace: str, pod: str) -> str:
        """The output of the pod's (latest) container run."""
        return self.kubelet.logs(namespace, pod) if self.kubelet else ""

    # -- doing things ---------------------------------------------------------------------------------------------
    def wait_for(self, predicate: Callable[[], T], timeout: float = 10, what: str = "the condition",
                 interval: float = 0.05) -> T:
        """Poll `predicate` until it returns something truthy, and return that. API errors, missing keys and the
        like count as not yet; on timeout the last of them is in the TimeoutError."""
        deadline, last = time.monotonic() + timeout, None
        while True:
            try:
                result = predicate()
                if result:
                    return result
            except _TRANSIENT as error:
                last = error
            if time.monotonic() > deadline:
                raise TimeoutError(f"timed out after {timeout}s waiting for {what}"
                                   + (f" (last error: {last!r})" if last else ""))
            time.sleep(interval)

    def request(self, method: str, path: str, body: Any = None, content_type: str = "application/json",
                ) -> tuple[int, Any]:
        """A raw HTTP request to the API: (status, decoded JSON body or text)."""
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": content_type})
        try:
            with _NO_PROXY.open(req, timeout=30) as response:
                status, raw = response.status, response.read()
        except urllib.error.HTTPError as error:
            status, raw = error.code, error.read()
        try:
            return status, json.loads(raw) if raw else None
        except ValueError:
            return status, raw.decode(errors="replace")

    def apply(self, manifest: Mapping[str, Any] | Path | str, namespace: str = "default") -> list[dict[str, Any]]:
        """Create the object(s) of a manifest (a dict, or a YAML file of one or more documents) through the API."""
        if isinstance(manifest, Mapping):
            documents = [manifest]
        else:
            documents = [d for d in yaml.safe_load_all(Path(manifest).read_text()) if d]
        created = []
        for document in documents:
            kind = self.emulator.catalog.of(document["apiVersion"], document["kind"])
            if kind is None:
                raise KeyError(f"the emulator serves no {document['apiVersion']} {document['kind']}")
            prefix = f"/apis/{kind.group}/{kind.version}" if kind.group else f"/api/{kind.version}"
            ns = document.get("metadata", {}).get("namespace") or namespace
            path = f"{prefix}/namespaces/{ns}/{kind.plural}" if kind.namespaced else f"{prefix}/{kind.plural}"
            status, body = self.request("POST", path, document)
            if status >= 300:
                raise RuntimeError(f"creating {document['kind']} failed: {status} {body}")
            created.append(body)
        return created

    # -- other processes against this cluster --------------------------------------------------------------------
    def environ(self, **extra: str) -> dict[str, str]:
        """This process's environment for a process that should use this cluster (an operator): KUBECONFIG set,
        in-cluster variables removed."""
        env = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")}
        return {**env, "KUBECONFIG": str(self.kubeconfig), **extra}

    def kubeconfig_for(self, client: str) -> Path:
        """A kubeconfig like `kubeconfig` whose user's bearer token is `client-<client>`: the emulator knows the
        requests made with it as `client`'s (the name `Faults.clients` and `Served.client` use)."""
        path = self.root / "kubeconfigs" / f"{client}.json"
        if not path.exists():
            config = json.loads(self.kubeconfig.read_text())
            for user in config["users"]:
                user["user"] = {"token": f"client-{client}"}
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".tmp")
            partial.write_text(json.dumps(config))
            partial.replace(path)
        return path

    def spawn(self, argv: list[str], name: str, env: Mapping[str, str] | None = None,
              cwd: Path | str | None = None, client: str | None = None) -> subprocess.Popen:
        """Start a process against this cluster, its output in `process_log(name)` (appended to: a process spawned
        again under its name keeps the earlier output); stopped by `shutdown`. With `client`, its KUBECONFIG is
        `kubeconfig_for(client)`: the emulator knows its requests as `client`'s."""
        log = self.root / "processes" / f"{name}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        env = dict(env) if env is not None else self.environ()
        if client is not None:
            env["KUBECONFIG"] = str(self.kubeconfig_for(client))
        with open(log, "ab") as output:
            process = subprocess.Popen(argv, env=env, cwd=cwd,
                                       stdout=output, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                       start_new_session=True, preexec_fn=die_with_parent)
        self._processes[name] = (process, log)
        return process

    def process_log(self, name: str) -> str:
        return self._processes[name][1].read_text(errors="replace") if name in self._processes else ""

    def stop_process(self, name: str, grace: float = 5.0) -> int | None:
        """SIGTERM the spawned process, SIGKILL its group after `grace`; its exit code."""
        process, _ = self._processes[name]
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        return process.wait()

    def kill_process(self, name: str) -> int:
        """SIGKILL the spawned process's whole group at once, no SIGTERM (a crash); its exit code. Safe to call from
        a hook's action (the wait is for a process already killed)."""
        process, _ = self._processes[name]
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        return process.wait(10)

    # -- CRDs ---------------------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def crd_without_rules(self, name: str) -> Iterator[dict[str, Any]]:
        """`with cluster.crd_without_rules("paralleltrainingjobs.tandem.dev"):` the CRD is updated (through the API)
        with every `x-kubernetes-validations` rule removed, as an older CRD (or a server that evaluates no CEL)
        serves it, so an object a rule refuses can be stored; the CRD's rules are put back on leaving. Objects
        written inside keep their values: on later writes that leave them unchanged the rules are ratcheted (cel.py),
        as on a server since 1.30."""
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"

        def put(spec: dict[str, Any]) -> dict[str, Any]:
            status, current = self.request("GET", path)
            if status != 200:
                raise RuntimeError(f"reading CRD {name} failed: {status} {current}")
            status, body = self.request("PUT", path, {**current, "spec": spec})
            if status != 200:
                raise RuntimeError(f"updating CRD {name} failed: {status} {body}")
            return body

        def stripped(value: Any) -> Any:
            if isinstance(value, dict):
                return {k: stripped(v) for k, v in value.items() if k != "x-kubernetes-validations"}
            return [stripped(v) for v in value] if isinstance(value, list) else value

        original = self.get("customresourcedefinitions", None, name)
        if original is None:
            raise KeyError(f"no CRD {name}")
        try:
            yield put(stripped(original["spec"]))
        finally:
            put(original["spec"])

    # -- faults (faults.py) ---------------------------------------------------------------------------------------
    def inject(self, faults: Faults | None) -> None:
        """Switch the emulator's faults on (`Faults`), or off (None); any thread."""
        self.emulator.inject(faults)

    @contextlib.contextmanager
    def faulty(self, faults: Faults) -> Iterator[Faults]:
        """`with cluster.faulty(Faults(...)):` the faults hold inside the block, and are cleared on its exit."""
        self.inject(faults)
        try:
            yield faults
        finally:
            self.inject(None)

    def after(self, predicate: Callable[[Served], bool], action: Callable[[Served], Any]) -> Hook:
        """Call `action(served)` once, after the emulator served (and committed) the first request with a successful
        answer for which `predicate(served)` is true, before that answer goes out. Both run on the emulator's event
        loop: keep them quick (`kill_process` is)."""
        return self.emulator.hooks.add(predicate, action)

    def lose_node(self, down_seconds: float = 5.0, node: str | None = None) -> None:
        """The node (by name; None: the first, `tandem-node`) dies and comes back after `down_seconds`
        (Kubelet.lose): returns once it is down, its pods' processes frozen (SIGSTOP: their connections stay open
        and silent; SIGKILLed when the node comes back, or when the cluster stops), the Node NotReady (Unknown) and
        its unfinished pods Failed (NodeLost); see `node_ready`."""
        if self.kubelet is None:
            raise RuntimeError("this cluster runs no kubelet")
        self._call(self.kubelet.lose(down_seconds, node))

    def node_ready(self, node: str | None = None) -> bool:
        """Whether the node (by name; None: the first) is up and Ready (after `lose_node`, once it recovered)."""
        if self.kubelet is None or not self.kubelet.node(node).ready:
            return False
        stored = self.get("nodes", None, self.kubelet.node(node).name) or {}
        return any(c.get("type") == "Ready" and c.get("status") == "True"
                   for c in (stored.get("status") or {}).get("conditions") or [])
