"""`tandem devcluster` as a newcomer meets it: started as a process, it prints the `export KUBECONFIG=...` line; the
README's cluster quick start then runs with the real kubectl against it (the claim and the job, `kubectl get
trainingjobs`, the pool, and the request to a server's pod IP that stands in for `kubectl port-forward` there); SIGINT
stops the operator, every pod's process and the API server, and leaves no process behind. The chart's NOTES give the
quick start's commands.

tests/integration/test_kubectl.py runs the same quick start against the harness, with every sample compared: here the
job trains one epoch instead of ten (seconds instead of half a minute), and only what the devcluster adds is checked.
"""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml
from jobs import ROOT
from test_kubectl import MISSING, QUICK_START

pytestmark = pytest.mark.skipif(bool(MISSING), reason=MISSING or "")

TANDEM = Path(sys.executable).parent / "tandem"  # the console script a newcomer runs
NOTES = (ROOT / "charts" / "tandem" / "templates" / "NOTES.txt").read_text()
SH_BLOCKS = [block.split("```", 1)[0] for block in QUICK_START.split("```sh\n")[1:]]


def sh_block(containing: str) -> str:
    [block] = [block for block in SH_BLOCKS if containing in block]
    return block


def process_identities(root: int) -> set[tuple[int, str]]:
    """(pid, start time) of every descendant of `root`, read from /proc (a pid alone could be reused)."""
    children: dict[int, list[tuple[int, str]]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command's name: state, ppid, ...
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append((int(stat.parent.name), fields[19]))
    found, parents = set(), [root]
    while parents:
        for child in children.get(parents.pop(), []):
            found.add(child)
            parents.append(child[0])
    return found


def running(identity: tuple[int, str]) -> bool:
    try:
        fields = Path(f"/proc/{identity[0]}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    return fields[19] == identity[1] and fields[0] != "Z"


class Devcluster:
    """`tandem devcluster --dir DIR` in a session of its own, its output read line by line."""

    def __init__(self, directory: Path) -> None:
        self.process = subprocess.Popen([str(TANDEM), "devcluster", "--dir", str(directory)], cwd=directory.parent,
                                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        start_new_session=True)
        self.lines: queue.Queue[str] = queue.Queue()
        self.output: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.output.append(line)
            self.lines.put(line)

    def wait_for_line(self, prefix: str, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no line {prefix!r} in {timeout}s: {''.join(self.output)}") from None
            if line.startswith(prefix):
                return line.strip()

    def kill(self) -> None:
        if self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def shell(script: str, env: dict[str, str]) -> str:
    result = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], env=env, cwd=ROOT, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, (script, result.stdout, result.stderr)
    return result.stdout


def wait_for_output(script: str, env: dict[str, str], expected: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while (printed := shell(script, env)) != expected:
        assert time.monotonic() < deadline, f"{script}: {printed!r} after {timeout}s, not {expected!r}"
        time.sleep(0.5)


def test_devcluster_runs_the_quick_start_and_stops_everything_on_ctrl_c(tmp_path):
    devcluster = Devcluster(tmp_path / "cluster")
    try:
        export = devcluster.wait_for_line("export KUBECONFIG=", 60)
        kubeconfig = Path(export.removeprefix("export KUBECONFIG="))
        assert kubeconfig == tmp_path / "cluster" / "kubeconfig"
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "HOME": str(tmp_path)}
        api_port = int(json.loads(kubeconfig.read_text())["clusters"][0]["cluster"]["server"].rsplit(":", 1)[1])

        train = sh_block("persistentVolumeClaim")
        one_epoch = train.replace('-p \'{"spec": {', '-p \'{"spec": {"trainer": {"epochs": 1}, ', 1)
        assert one_epoch != train
        printed = shell(one_epoch, env)
        assert "persistentvolumeclaim/digits-checkpoints created" in printed and "digits-train" in printed.split(
            "NAME", 1)[1], printed  # the CRDs are there and `kubectl get trainingjobs` lists the job
        wait_for_output("kubectl get ptj digits-train -o jsonpath='{.status.phase}'", env, "Succeeded", 120)

        pool = sh_block("kubectl apply -f examples/digits-pool.yaml")
        assert "inferencepool.tandem.dev/digits created" in shell(pool, env)
        wait_for_output("kubectl get tip digits -o jsonpath='{.status.readyReplicas}'", env, "2", 90)
        instead_of_port_forward = sh_block("status.podIP")
        assert shell(instead_of_port_forward, env) == '{"ready":true}'
        assert devcluster.wait_for_line("  curl", 1) == instead_of_port_forward.strip()  # the banner says the same

        started = process_identities(devcluster.process.pid)
        assert len(started) >= 3, started  # the operator and the pool's two servers at least
        devcluster.process.send_signal(signal.SIGINT)
        assert devcluster.process.wait(60) == 0, "".join(devcluster.output)
    finally:
        devcluster.kill()
    assert "".join(devcluster.output).rstrip().endswith("tandem devcluster: stopped")
    assert [identity for identity in started if running(identity)] == []
    with pytest.raises(ProcessLookupError):
        os.killpg(devcluster.process.pid, 0)  # nothing left in its process group
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", api_port), timeout=5):
        pass


def test_the_charts_notes_give_the_quick_starts_commands():
    """The claim NOTES.txt creates is the README's, its job is patched to use it as in the README, and the pool's
    endpoint is promised with `-o wide`, where kubectl shows it."""
    claim = re.search(r"echo '(\{.*?\})' \| kubectl apply -f -\n", NOTES, re.DOTALL)[1]
    assert json.loads(claim) == yaml.safe_load(sh_block("persistentVolumeClaim").split("<<'EOF'\n", 1)[1].split(
        "\nEOF\n", 1)[0])
    train, notes = sh_block("persistentVolumeClaim"), re.sub(r"\s+", " ", NOTES)
    patch = re.search(r"kubectl patch -f examples/digits-train\.yaml .*? \| kubectl apply -f -", train, re.DOTALL)[0]
    assert re.sub(r"\s+", " ", patch) in notes
    assert "kubectl apply -f examples/digits-pool.yaml" in NOTES
    for line in NOTES.splitlines():
        if "endpoint" in line and line.lstrip().startswith("kubectl get"):
            assert "-o wide" in line, line
