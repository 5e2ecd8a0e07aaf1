"""End to end on a real cluster: kind, the Dockerfile's two images, the Helm chart, the digits job and a pool.

`make e2e` runs it (it sets TANDEM_E2E=1). In order:

1. builds both images (`docker build --target operator|worker`, tagged tandem-operator:e2e and tandem-worker:e2e;
   the worker with the CPU build of torch unless TANDEM_E2E_DOCKER_BUILD_ARGS says otherwise), creates a kind
   cluster of its own (a unique name and its own kubeconfig: yours is never touched; deleted at the end, on a
   failure too) and `kind load docker-image`s both;
2. `helm install tandem charts/tandem` with those images (the `helm` binary, or helm-python-sdk's in-process
   install when there is none);
3. trains examples/digits-train.yaml on CPU with its checkpoints on a PersistentVolumeClaim (kind's default
   StorageClass, the local-path provisioner), with the README's `kubectl patch --local` and smaller CPU requests,
   waits for Succeeded and checks `kubectl get trainingjobs` against the CRD's printer columns;
4. serves the job with examples/digits-pool.yaml (one replica and no autoscaler: kind has no metrics adapter),
   waits for Ready, checks `kubectl get tip`, and classifies held-out digits with tritonclient.http through
   `kubectl port-forward svc/digits`;
5. deletes the pool and the job and checks that nothing they owned is left, then `helm uninstall`s and checks that
   every object of the release is gone (the CRDs stay: Helm never deletes a chart's crds/).

On a failure it prints what a person would look at: the objects, `kubectl describe` of the jobs, pools and pods,
the operator's and every pod's logs, the events.

Skipped, with the reason, without a Docker engine (`docker info` fails), kind, kubectl or helm (the binary or
helm-python-sdk), and, where they are all present, unless TANDEM_E2E=1: `make test` never builds images.

Environment knobs: TANDEM_E2E_DOCKER_BUILD_ARGS (default `--build-arg TORCH_INDEX_URL=<PyTorch's CPU wheel index>`;
set it empty to test the default CUDA worker image), TANDEM_E2E_SKIP_BUILD=1 (use the :e2e images already built),
TANDEM_E2E_KEEP_CLUSTER=1 (leave the cluster for a look: its name and kubeconfig are printed),
TANDEM_E2E_NODE_IMAGE (kind's --image, e.g. kindest/node:v1.33.1).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import yaml
from kubectl_tables import table

from tandem.columns import four_figures

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "charts" / "tandem"
TAG = "e2e"
OPERATOR_IMAGE, WORKER_IMAGE = f"tandem-operator:{TAG}", f"tandem-worker:{TAG}"
RELEASE, SYSTEM_NAMESPACE, NAMESPACE = "tandem", "tandem-system", "tandem-e2e"
JOB, POOL, CLAIM = "digits-train", "digits", "digits-checkpoints"
CPU_TORCH = "--build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu"
JOB_PATCH = {"spec": {"checkpoint": {"persistentVolumeClaim": CLAIM},
                      # The example asks 1 CPU per rank: two ranks and the operator would not fit a 2-core node.
                      "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}}}}
"""examples/digits-train.yaml's checkpoints on a claim (a pool needs them there: an emptyDir cannot be shared)."""
POOL_PATCH = {"spec": {"replicas": 1, "autoscaling": None}}
"""examples/digits-pool.yaml with one replica and no autoscaler: kind has no metrics adapter for the HPA's metric."""

# Generous: the first image build downloads torch, a kind node starts in a minute or two, and the digits job's
# 230 steps take about a minute on two pods.
BUILD_S, CLUSTER_S, LOAD_S, INSTALL_S = 3600, 600, 900, 600
TRAIN_S, SERVE_S, DELETE_S = 1200, 900, 600

# What the job and the pool may own (checked for leftovers after they are deleted).
OWNED_KINDS = ("pods,services,configmaps,serviceaccounts,roles.rbac.authorization.k8s.io,"
               "rolebindings.rbac.authorization.k8s.io,deployments.apps,replicasets.apps,"
               "poddisruptionbudgets.policy,horizontalpodautoscalers.autoscaling")


# --- what the test needs, and why it skips ---------------------------------------------------------------------

def missing_requirements() -> list[str]:
    """Every missing piece, each in a phrase; empty when the test can run."""
    missing = []
    docker = shutil.which("docker")
    if docker is None:
        missing.append("no Docker: `docker` is not on PATH")
    else:
        try:
            info = subprocess.run([docker, "info", "--format", "{{.ServerVersion}}"], capture_output=True, text=True,
                                  timeout=60)
            failure = None if info.returncode == 0 else (info.stderr or info.stdout).strip().splitlines()[-1:]
        except subprocess.TimeoutExpired:
            failure = ["no answer within 60 s"]
        if failure is not None:
            missing.append(f"no Docker engine: `docker info` fails ({' '.join(failure) or 'no output'})")
    missing += [f"`{tool}` is not on PATH" for tool in ("kind", "kubectl") if shutil.which(tool) is None]
    if shutil.which("helm") is None and not _helm_sdk_present():
        missing.append("no helm: neither the `helm` binary nor helm-python-sdk (`pip install helm-python-sdk`)")
    return missing


def _helm_sdk_present() -> bool:
    try:
        import helm_python  # noqa: F401
    except ImportError:
        return False
    return True


# --- commands ---------------------------------------------------------------------------------------------------

def say(text: str) -> None:
    print(f"[e2e {time.strftime('%H:%M:%S')}] {text}", flush=True)


def run(command: list[str], *, timeout: float, env: dict[str, str] | None = None, input: str | None = None,
        capture: bool = True, check: bool = True, echo: bool = True) -> subprocess.CompletedProcess:
    if echo:
        say("$ " + shlex.join(command))
    result = subprocess.run(command, cwd=ROOT, env=env, input=input, text=True, timeout=timeout,
                            capture_output=capture)
    if check and result.returncode != 0:
        raise AssertionError(f"`{shlex.join(command)}` exited with {result.returncode}\n"
                             f"stdout:\n{result.stdout or ''}\nstderr:\n{result.stderr or ''}")
    return result


def wait_for(what: str, probe: Callable[[], Any], *, timeout: float, every: float = 5.0) -> Any:
    """Call `probe` until it returns something truthy (returned); it may raise AssertionError to stop at once."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def wait_until_gone(what: str, find: Callable[[], list[str]], *, timeout: float) -> None:
    """Call `find` until it finds nothing; on a timeout, say what was still there."""
    left: list[str] = []

    def gone() -> bool:
        left[:] = find()
        return not left

    try:
        wait_for(f"{what} to be gone", gone, timeout=timeout)
    except AssertionError as error:
        raise AssertionError(f"{error}; still there: {', '.join(left)}") from None


class Cluster:
    """A kind cluster of the test's own, reached through its own kubeconfig."""

    def __init__(self, name: str, kubeconfig: Path):
        self.name, self.kubeconfig = name, kubeconfig
        self.env = {**os.environ, "KUBECONFIG": str(kubeconfig)}

    def create(self) -> None:
        image = os.environ.get("TANDEM_E2E_NODE_IMAGE")
        run(["kind", "create", "cluster", "--name", self.name, "--kubeconfig", str(self.kubeconfig), "--wait", "300s",
             *(["--image", image] if image else [])], timeout=CLUSTER_S, capture=False)

    def load(self, *images: str) -> None:
        """`kind load docker-image`; where that fails (Docker's containerd image store, say), through an archive."""
        for image in images:
            loaded = run(["kind", "load", "docker-image", image, "--name", self.name], timeout=LOAD_S, check=False)
            if loaded.returncode != 0:
                say(f"kind load docker-image failed ({loaded.stderr.strip()}); loading {image} from an archive")
                with tempfile.TemporaryDirectory() as directory:
                    archive = str(Path(directory) / "image.tar")
                    run(["docker", "save", "-o", archive, image], timeout=LOAD_S)
                    run(["kind", "load", "image-archive", archive, "--name", self.name], timeout=LOAD_S)

    def delete(self) -> None:
        if os.environ.get("TANDEM_E2E_KEEP_CLUSTER") == "1":
            say(f"kept kind cluster {self.name} (TANDEM_E2E_KEEP_CLUSTER=1): KUBECONFIG={self.kubeconfig}; "
                f"delete it with `kind delete cluster --name {self.name}`")
            return
        run(["kind", "delete", "cluster", "--name", self.name, "--kubeconfig", str(self.kubeconfig)],
            timeout=CLUSTER_S, check=False)

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 120, check: bool = True,
                echo: bool = True) -> subprocess.CompletedProcess:
        return run(["kubectl", *args], env=self.env, input=input, timeout=timeout, check=check, echo=echo)

    def get(self, kind: str, name: str, namespace: str = NAMESPACE) -> dict[str, Any]:
        """One object as JSON (polled: the command is not echoed)."""
        return json.loads(self.kubectl("get", kind, name, "-n", namespace, "-o", "json", echo=False).stdout)

    def diagnose(self) -> None:
        """What a person would look at, printed (a failure's aftermath: every command may fail too)."""
        commands = [
            ["get", "nodes", "-o", "wide"],
            ["get", "all,pvc,paralleltrainingjobs,inferencepools,poddisruptionbudgets,configmaps", "-A", "-o", "wide"],
            *(["describe", kind, "-n", NAMESPACE] for kind in ("paralleltrainingjobs", "inferencepools", "pvc",
                                                                 "deployments", "pods")),
            *(["describe", kind, "-n", SYSTEM_NAMESPACE] for kind in ("deployments", "pods")),
            ["logs", "-n", SYSTEM_NAMESPACE, f"deployment/{RELEASE}", "--all-containers", "--tail", "400"],
            ["get", "events", "-A", "--sort-by", ".lastTimestamp"],
        ]
        pods = self.kubectl("get", "pods", "-n", NAMESPACE, "-o", "name", check=False).stdout.split()
        for pod in pods:
            commands += [["logs", "-n", NAMESPACE, pod, "--all-containers", "--tail", "200"],
                         ["logs", "-n", NAMESPACE, pod, "--all-containers", "--tail", "200", "--previous"]]
        for command in commands:
            result = self.kubectl(*command, check=False, timeout=60)
            print(f"\n===== kubectl {shlex.join(command)} (exit {result.returncode})\n{result.stdout}{result.stderr}",
                  flush=True)


# --- helm: the binary, else helm-python-sdk in process ---------------------------------------------------------

class HelmBinary:
    def __init__(self, cluster: Cluster):
        self.cluster = cluster

    def install(self, values: dict[str, str]) -> None:
        run(["helm", "install", RELEASE, str(CHART), "--namespace", SYSTEM_NAMESPACE, "--create-namespace",
             "--set", ",".join(f"{key}={value}" for key, value in values.items()), "--wait", "--timeout",
             f"{INSTALL_S}s"], env=self.cluster.env, timeout=INSTALL_S + 60)

    def manifest(self) -> str:
        return run(["helm", "get", "manifest", RELEASE, "--namespace", SYSTEM_NAMESPACE], env=self.cluster.env,
                   timeout=120).stdout

    def uninstall(self) -> None:
        run(["helm", "uninstall", RELEASE, "--namespace", SYSTEM_NAMESPACE, "--wait", "--timeout", f"{DELETE_S}s"],
            env=self.cluster.env, timeout=DELETE_S + 60)


class HelmSdk:
    """helm-python-sdk: Helm's own install and uninstall actions, in process (its wheel bundles Helm's library)."""

    def __init__(self, cluster: Cluster):
        import helm_python

        self.config = helm_python.Config(kubeconfig_path=cluster.kubeconfig, namespace=SYSTEM_NAMESPACE)

    def install(self, values: dict[str, str]) -> None:
        nested: dict[str, Any] = {}
        for key, value in values.items():
            *parents, leaf = key.split(".")
            node = nested
            for parent in parents:
                node = node.setdefault(parent, {})
            node[leaf] = value
        say(f"helm-python-sdk: install {RELEASE} {CHART} --namespace {SYSTEM_NAMESPACE} {nested}")
        self.config.install(str(CHART), RELEASE, nested, namespace=SYSTEM_NAMESPACE, create_namespace=True,
                            wait="watcher", timeout=INSTALL_S)

    def manifest(self) -> str:
        return self.config.status(RELEASE)["manifest"]

    def uninstall(self) -> None:
        say(f"helm-python-sdk: uninstall {RELEASE} --namespace {SYSTEM_NAMESPACE}")
        self.config.uninstall(RELEASE, wait="watcher", timeout=DELETE_S)


def helm_for(cluster: Cluster) -> HelmBinary | HelmSdk:
    return HelmBinary(cluster) if shutil.which("helm") else HelmSdk(cluster)


# --- the cluster, the images ------------------------------------------------------------------------------------

def build_images() -> None:
    if os.environ.get("TANDEM_E2E_SKIP_BUILD") == "1":
        say(f"TANDEM_E2E_SKIP_BUILD=1: using {OPERATOR_IMAGE} and {WORKER_IMAGE} as they are")
        return
    build_args = shlex.split(os.environ.get("TANDEM_E2E_DOCKER_BUILD_ARGS", CPU_TORCH))
    run(["docker", "build", "--target", "operator", "-t", OPERATOR_IMAGE, "."], timeout=BUILD_S, capture=False)
    run(["docker", "build", *build_args, "--target", "worker", "-t", WORKER_IMAGE, "."], timeout=BUILD_S,
        capture=False)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[Cluster]:
    missing = missing_requirements()
    if missing:
        pytest.skip("kind end-to-end test needs Docker, kind, kubectl and helm: " + "; ".join(missing))
    if os.environ.get("TANDEM_E2E") != "1":
        pytest.skip("kind end-to-end test: Docker, kind, kubectl and helm are here, but it builds both images and a "
                    "cluster (10-30 minutes): run it with `make e2e` (TANDEM_E2E=1)")
    build_images()  # before the cluster: a failed build costs none
    cluster = Cluster(f"tandem-e2e-{uuid.uuid4().hex[:8]}", tmp_path_factory.mktemp("kind") / "kubeconfig")
    try:
        cluster.create()
        cluster.load(OPERATOR_IMAGE, WORKER_IMAGE)
        yield cluster
    finally:
        cluster.delete()


# --- the tests --------------------------------------------------------------------------------------------------

@pytest.mark.skipif(shutil.which("kubectl") is None, reason="needs kubectl (`kubectl patch --local`, no cluster)")
def test_the_manifests_it_applies_are_the_examples_patched_and_valid(tmp_path):
    """What the cluster test applies, made here without a cluster: the examples through `kubectl patch --local` (as
    the README shows it), valid Tandem manifests with the patches in them."""
    from tandem.manifest import parse

    offline = Cluster("offline", tmp_path / "no-kubeconfig")
    job = parse(yaml.safe_load(patched("digits-train.yaml", JOB_PATCH, offline)))
    pool = parse(yaml.safe_load(patched("digits-pool.yaml", POOL_PATCH, offline)))
    assert job.metadata.name == JOB and job.spec.checkpoint.persistent_volume_claim == CLAIM
    assert job.spec.trainer.model == "tandem.examples.digits:mlp" and job.spec.workers == 2
    assert pool.metadata.name == POOL and pool.spec.model.from_training_job.name == JOB
    assert (pool.spec.replicas, pool.spec.autoscaling) == (1, None)


@pytest.mark.e2e
def test_helm_install_train_serve_and_uninstall_on_kind(cluster: Cluster):
    helm = helm_for(cluster)
    try:
        install(cluster, helm)
        job = train(cluster)
        serve(cluster, job)
        delete_resources(cluster)
        uninstall(cluster, helm)
    except BaseException:
        say("FAILED: diagnostics follow")
        cluster.diagnose()
        raise


def install(cluster: Cluster, helm: HelmBinary | HelmSdk) -> None:
    operator_repository, operator_tag = OPERATOR_IMAGE.split(":")
    worker_repository, worker_tag = WORKER_IMAGE.split(":")
    helm.install({"image.repository": operator_repository, "image.tag": operator_tag,
                  "workerImage.repository": worker_repository, "workerImage.tag": worker_tag})
    cluster.kubectl("-n", SYSTEM_NAMESPACE, "rollout", "status", f"deployment/{RELEASE}", f"--timeout={INSTALL_S}s",
                    timeout=INSTALL_S + 60)
    cluster.kubectl("get", "crd", "paralleltrainingjobs.tandem.dev", "inferencepools.tandem.dev")
    cluster.kubectl("create", "namespace", NAMESPACE)


def patched(example: str, patch: dict[str, Any], cluster: Cluster) -> str:
    """An example manifest with a merge patch applied, as the README shows it (`kubectl patch --local`)."""
    return cluster.kubectl("patch", "-f", f"examples/{example}", "--local", "--type", "merge", "-p",
                           json.dumps(patch), "-o", "yaml").stdout


def train(cluster: Cluster) -> dict[str, Any]:
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": CLAIM},
             "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}}}
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=yaml.safe_dump(claim))
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=patched("digits-train.yaml", JOB_PATCH, cluster))

    body = wait_for_phase(cluster, "paralleltrainingjobs", JOB, "Succeeded", timeout=TRAIN_S,
                          summary=lambda status: f"step {(status.get('progress') or {}).get('summary')} "
                                                 f"restarts {status.get('restarts')}")
    status = body["status"]
    progress, latest = status["progress"], status["checkpoint"]["latest"]
    assert progress["step"] == progress["totalSteps"] > 0, progress
    directory = body["spec"]["checkpoint"]["directory"]
    assert latest == f"/var/lib/tandem/checkpoints/{directory}/step-{progress['step']:08d}.pt", latest
    assert status["metrics"]["accuracy"] >= 0.9, status["metrics"]  # `make run` reaches about 0.97
    durable = next(c for c in status["conditions"] if c["type"] == "CheckpointsDurable")
    assert durable["status"] == "True", durable

    row = printed_row(cluster, "trainingjobs", "paralleltrainingjobs")
    assert row["NAME"] == JOB and row["PHASE"] == "Succeeded", row
    assert row["READY"] == f"0/{body['spec']['workers']}", row  # every rank has exited
    assert row["STEP"] == f"{progress['step']}/{progress['totalSteps']}", row
    assert row["LOSS"] == four_figures(progress["loss"]), row  # four significant figures; the status keeps all
    assert (row["SAMPLES/S"], row["ETA"]) == (progress["samplesPerSecondText"], ""), row  # no ETA once finished
    assert int(row["RESTARTS"]) == status["restarts"], row
    assert row["CHECKPOINT"] == Path(latest).name, row
    return body


def wait_for_phase(cluster: Cluster, plural: str, name: str, phase: str, *, timeout: float,
                   summary: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """Poll the object until its status.phase is `phase` (returned); Failed ends the wait at once. Each change of
    what it shows is printed."""
    shown: list[str] = []

    def reached() -> dict[str, Any] | None:
        body = cluster.get(plural, name)
        status = body.get("status") or {}
        line = f"{plural}/{name}: {status.get('phase')}, {summary(status)}: {status.get('message')}"
        if line not in shown[-1:]:
            shown.append(line)
            say(line)
        if status.get("phase") == "Failed":
            raise AssertionError(f"{plural}/{name} failed: {status.get('message')} "
                                 f"(conditions: {status.get('conditions')})")
        return body if status.get("phase") == phase else None

    return wait_for(f"{plural}/{name} to be {phase}", reached, timeout=timeout)


def printed_row(cluster: Cluster, resource: str, plural: str, wide: bool = False) -> dict[str, str]:
    """`kubectl get RESOURCE`'s one row, by column (`-o wide` with `wide`); the header must be the CRD's printer
    columns in order, those of priority 1 only in the wide one."""
    crd = yaml.safe_load((ROOT / "crds" / f"tandem.dev_{plural}.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    expected = ["NAME", *(column["name"].upper() for column in version["additionalPrinterColumns"]
                          if wide or not column.get("priority"))]
    printed = cluster.kubectl("get", resource, "-n", NAMESPACE, *(["-o", "wide"] if wide else [])).stdout
    print(printed)
    (row,) = table(printed)  # a null cell (QUEUE without Kueue) is printed as nothing
    assert list(row) == expected, printed
    return row


def serve(cluster: Cluster, job: dict[str, Any]) -> None:
    cluster.kubectl("apply", "-n", NAMESPACE, "-f", "-", input=patched("digits-pool.yaml", POOL_PATCH, cluster))

    status = wait_for_phase(cluster, "inferencepools", POOL, "Ready", timeout=SERVE_S,
                            summary=lambda status: f"ready {status.get('readySummary')}")["status"]
    served = Path(job["status"]["checkpoint"]["latest"]).name
    assert status["model"]["source"] == f"fromTrainingJob/{JOB}", status
    assert status["model"]["checkpoint"] == f"/var/lib/tandem/models/{job['spec']['checkpoint']['directory']}/{served}"
    assert status["endpoint"] == f"http://{POOL}.{NAMESPACE}.svc.cluster.local:8000/v2", status

    row = printed_row(cluster, "tip", "inferencepools")
    assert (row["PHASE"], row["READY"], row["MODE"]) == ("Ready", "1/1", "batched"), row
    assert (row["MODEL"], row["CHECKPOINT"]) == (status["model"]["source"], served), row
    wide = printed_row(cluster, "tip", "inferencepools", wide=True)
    assert (wide["ENDPOINT"], wide["CHECKPOINT PATH"]) == (status["endpoint"], status["model"]["checkpoint"]), wide

    with port_forward(cluster, f"svc/{POOL}", 8000) as port:
        classify_held_out_digits(port)


@contextmanager
def port_forward(cluster: Cluster, target: str, remote: int) -> Iterator[int]:
    """`kubectl port-forward` from a free local port (yielded) to `target`'s `remote` port, stopped on leaving."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = ["kubectl", "port-forward", "-n", NAMESPACE, target, f"{port}:{remote}"]
    say("$ " + shlex.join(command))
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(command, env=cluster.env, stdout=log, stderr=subprocess.STDOUT, text=True)

        def answers() -> bool:
            if process.poll() is not None:
                log.seek(0)
                raise AssertionError(f"kubectl port-forward exited with {process.returncode}: {log.read()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/v2/health/ready", timeout=5) as response:
                    return response.status == 200
            except OSError:
                return False

        try:
            wait_for("the port-forward to answer", answers, timeout=120, every=1)
            yield port
        finally:
            process.terminate()
            try:
                process.wait(10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def classify_held_out_digits(port: int) -> None:
    """32 held-out digits in one request, as the README's tritonclient example sends one: the answers are the
    trained model's (a random one gets about 1 in 10 right)."""
    import numpy as np
    import tritonclient.http as triton

    from tandem.examples.digits import eval_data

    x, y = (tensor[:32].numpy() for tensor in eval_data().tensors)
    client = triton.InferenceServerClient(f"localhost:{port}")
    assert client.is_model_ready(POOL)
    request = triton.InferInput("input", list(x.shape), "FP32")
    request.set_data_from_numpy(x.astype(np.float32))
    scores = client.infer(POOL, [request]).as_numpy("output")
    assert scores.shape == (32, 10), scores.shape
    accuracy = float((scores.argmax(axis=1) == y).mean())
    say(f"served model: {accuracy:.2f} of 32 held-out digits right")
    assert accuracy >= 0.8, accuracy


def delete_resources(cluster: Cluster) -> None:
    """Delete the pool and the job: everything they owned goes with them (garbage collection by owner)."""
    owners = {cluster.get(kind, name)["metadata"]["uid"]: f"{kind}/{name}"
              for kind, name in (("inferencepools", POOL), ("paralleltrainingjobs", JOB))}
    cluster.kubectl("delete", "-n", NAMESPACE, f"inferencepools/{POOL}", f"paralleltrainingjobs/{JOB}", "--wait",
                    f"--timeout={DELETE_S}s", timeout=DELETE_S + 60)

    def leftovers() -> list[str]:
        listed = cluster.kubectl("get", OWNED_KINDS, "-n", NAMESPACE, "-o", "json", echo=False).stdout
        return [f"{item['kind']}/{item['metadata']['name']}" for item in json.loads(listed)["items"]
                if item["kind"] == "Pod" or any(ref.get("uid") in owners
                                                for ref in item["metadata"].get("ownerReferences") or [])]

    wait_until_gone(f"the pods and whatever {' and '.join(owners.values())} owned", leftovers, timeout=DELETE_S)


def uninstall(cluster: Cluster, helm: HelmBinary | HelmSdk) -> None:
    """`helm uninstall`: every object of the release is gone; the CRDs stay (Helm never deletes a chart's crds/)."""
    released = [document for document in yaml.safe_load_all(helm.manifest()) if document]
    assert any(document["kind"] == "Deployment" for document in released), released
    helm.uninstall()

    def present() -> list[str]:
        found = []
        for document in released:
            group = document["apiVersion"].rpartition("/")[0]
            resource = f"{document['kind'].lower()}.{group}" if group else document["kind"].lower()
            namespace = ["-n", document["metadata"].get("namespace") or SYSTEM_NAMESPACE]
            result = cluster.kubectl("get", resource, document["metadata"]["name"], *namespace, "--ignore-not-found",
                                     "-o", "name", echo=False)
            found += result.stdout.split()
        found += cluster.kubectl("get", "pods", "-n", SYSTEM_NAMESPACE, "-o", "name", echo=False).stdout.split()
        return found

    wait_until_gone("the release's objects and the operator's pods", present, timeout=DELETE_S)
    cluster.kubectl("get", "crd", "paralleltrainingjobs.tandem.dev", "inferencepools.tandem.dev")
