"""Tandem's InferencePool beside the Gateway API Inference Extension's (issue 36, item 7): both kinds are
`InferencePool`, plural `inferencepools`, in groups `tandem.dev` and `inference.networking.k8s.io`. With both CRDs
installed (the Gateway API's written here, with its names and a permissive schema), every kubectl command the README
gives for pools is run with the real kubectl against the emulated cluster, in the README's words: each names
Tandem's pool (`tip`, `inferencepools.tandem.dev`, the `tandem` category, a manifest), except the bare `kubectl get
inferencepools` the troubleshooting section warns about, which shows the Gateway API's pools, as it says. Which
group kubectl picks is decided by the order of discovery's groups, which devcluster/discovery.py serves as
kube-apiserver does (built-in groups, then CRDs' groups by the name of their APIService).

The chart's NOTES and the operator's and CLI's texts are searched for a bare `inferencepools` in a kubectl command.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess

import pytest
import yaml
from jobs import ROOT
from kubectl_tables import table

from devcluster import Cluster, discovery
from devcluster.catalog import Catalog, kinds_of_crd
from tandem.crd import RESOURCES

README = (ROOT / "README.md").read_text()
NOTES = (ROOT / "charts" / "tandem" / "templates" / "NOTES.txt").read_text()
GATEWAY_GROUP = "inference.networking.k8s.io"
GATEWAY_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": f"inferencepools.{GATEWAY_GROUP}"},
    "spec": {"group": GATEWAY_GROUP, "scope": "Namespaced",
             "names": {"kind": "InferencePool", "listKind": "InferencePoolList", "plural": "inferencepools",
                       "singular": "inferencepool", "shortNames": ["infpool"]},
             "versions": [{"name": "v1", "served": True, "storage": True, "subresources": {"status": {}},
                           "schema": {"openAPIV3Schema": {"type": "object", "properties": {
                               "spec": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                               "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}}}}}]},
}
GATEWAY_POOL = {"apiVersion": f"{GATEWAY_GROUP}/v1", "kind": "InferencePool", "metadata": {"name": "vllm-llama3"},
                "spec": {"selector": {"matchLabels": {"app": "vllm-llama3"}}, "targetPorts": [{"number": 8000}],
                         "endpointPickerRef": {"name": "vllm-llama3-epp", "port": {"number": 9002}}}}
OURS = ("tip", "tpool", "inferencepools.tandem.dev", "examples/digits-pool.yaml", "tandem")
"""The names under which a command means Tandem's pools: short names, the full name, the manifest, the category."""
BARE = ("inferencepool", "inferencepools")
"""What means whichever InferencePool kubectl finds first."""
POOL_COLUMNS = [c["name"].upper() for c in RESOURCES["InferencePool"].printer_columns]


def kubectl_missing() -> str | None:
    if shutil.which("kubectl") is None:
        return "needs `kubectl` on PATH (none found)"
    found = subprocess.run(["kubectl", "version", "--client", "-o", "json"], capture_output=True, text=True,
                           timeout=30)
    try:
        version = json.loads(found.stdout)["clientVersion"]
        if (int(version["major"]), int(version["minor"].rstrip("+"))) < (1, 27):  # as tests/integration/test_kubectl
            return f"needs `kubectl` >= 1.27 (found {version.get('gitVersion')})"
    except (ValueError, KeyError) as error:
        return f"`kubectl version --client` unreadable: {error!r}"
    return None


needs_kubectl = pytest.mark.skipif(bool(MISSING := kubectl_missing()), reason=MISSING or "")


def kubectl_commands(text: str) -> list[str]:
    """Every kubectl command of a text, in order, once each: its code spans and the lines of its sh blocks and
    indented samples (a comment, a continuation and a pipe's second half are left out)."""
    found = [" ".join(span.split()) for span in re.findall(r"`(kubectl [^`]*)`", text)]
    for line in re.sub(r"\\\n\s*", " ", text).splitlines():
        if line.lstrip().startswith("kubectl "):
            found.append(" ".join(line.split("#", 1)[0].split("|", 1)[0].split()))
    return list(dict.fromkeys(found))


def names_a_pool(command: str) -> bool:
    words = shlex.split(command)
    return any(word in OURS + BARE + ("infpool",) or word.split("/", 1)[0] in OURS + BARE for word in words[1:])


def is_bare(command: str) -> bool:
    return any(word in BARE or word.split("/", 1)[0] in BARE for word in shlex.split(command)[1:])


README_AND_DOCS = "\n".join([README, *(path.read_text() for path in sorted((ROOT / "docs").glob("*.md")))])  # the
# README's deep sections (InferencePools, gated promotion) are in docs/, as it links
README_POOL_COMMANDS = [c for c in kubectl_commands(README_AND_DOCS) if names_a_pool(c)]


def kubectl(cluster: Cluster, command: str, input: str | None = None) -> subprocess.CompletedProcess[str]:
    """`command` as a shell would split it, with the README's placeholders (`tip/NAME --replicas N`) filled in."""
    argv = [{"NAME": "digits", "N": "1"}.get(word, word.replace("/NAME", "/digits")) for word in shlex.split(command)]
    env = cluster.environ(KUBECACHEDIR=str(cluster.root / "kubectl-cache"), HOME=str(cluster.root))
    result = subprocess.run(argv, env=env, input=input, capture_output=True, text=True, timeout=60, cwd=ROOT)
    print(f"$ {command}\n{result.stdout}{result.stderr}")  # what kubectl did, in the test's output
    return result


def tables(stdout: str) -> list[list[dict[str, str]]]:
    """kubectl get's tables (one for each kind it lists, a blank line between)."""
    return [table(block) for block in stdout.split("\n\n") if block.strip()]


def test_the_readme_names_tandems_pools_unambiguously():
    """The README's pool commands name Tandem's pools but for the bare `kubectl get inferencepools` that the name
    clashes and troubleshooting paragraphs explain; it says what that prints and what to type instead."""
    assert "kubectl get tip" in README_POOL_COMMANDS and "kubectl get tandem" in README_POOL_COMMANDS
    assert {c for c in README_POOL_COMMANDS if is_bare(c)} == {"kubectl get inferencepools",
                                                                 "kubectl get inferencepools digits"}
    troubleshooting = README.split("\n## Troubleshooting\n", 1)[1]
    clash = " ".join(troubleshooting.split("**`kubectl get inferencepools`", 1)[1].split("\n\n", 1)[0].split())
    for said in ("`kubectl get tip`", "`inferencepools.tandem.dev`", "`kubectl get tandem`", "`kubectl get infpool`",
                 "`kubectl api-resources`",
                 "`No resources found`", f'`Error from server (NotFound): inferencepools.{GATEWAY_GROUP} "digits" '
                 "not found`"):
        assert said in clash, said


@pytest.mark.parametrize("name, text", [("NOTES.txt", NOTES), ("charts/tandem/README.md",
                                                                 (ROOT / "charts/tandem/README.md").read_text())])
def test_the_charts_commands_name_tandems_pools(name, text):
    commands = [c for c in kubectl_commands(text) if names_a_pool(c)]
    assert not [c for c in commands if is_bare(c)], name
    if name == "NOTES.txt":
        assert any(c.startswith("kubectl get tip") for c in commands), commands


def test_no_message_or_help_text_tells_a_user_to_run_kubectl_with_a_bare_inferencepools():
    """The operator's Events, conditions and status messages and the CLI's help are written in these files (and
    docs/, the chart's templates and its README)."""
    bare = re.compile(r"kubectl(?: [\w-]+)* inferencepools?(?![.\w])")
    found = [f"{path.relative_to(ROOT)}: {match[0]}" for folder in ("tandem", "operator", "charts", "docs")
             for path in sorted((ROOT / folder).rglob("*")) if path.suffix in {".py", ".txt", ".tpl", ".yaml", ".md"}
             for match in bare.finditer(path.read_text())]
    assert found == []


def test_discovery_lists_groups_as_a_server_does():
    """Built-in groups first by kube-apiserver's priorities, then the CRDs' (priority 1000) by APIService name:
    `v1.inference.networking.k8s.io` before `v1alpha1.tandem.dev`."""
    catalog = Catalog()
    for crd in [*(yaml.safe_load(path.read_text()) for path in sorted((ROOT / "crds").glob("*.yaml"))), GATEWAY_CRD]:
        for kind in kinds_of_crd(crd):
            catalog.add(kind)
    groups = [group["name"] for group in discovery.document(catalog, "/apis")["groups"]]
    assert groups == ["apps", "events.k8s.io", "autoscaling", "batch", "policy", "rbac.authorization.k8s.io",
                      "apiextensions.k8s.io", "scheduling.k8s.io", "coordination.k8s.io", GATEWAY_GROUP, "tandem.dev"]


@needs_kubectl
def test_the_readme_pool_commands_with_both_inferencepools_installed(tmp_path):
    with Cluster(tmp_path) as cluster:
        assert kubectl(cluster, "kubectl apply -f -", input=json.dumps(GATEWAY_CRD)).returncode == 0
        assert kubectl(cluster, "kubectl apply -f examples/digits-pool.yaml").returncode == 0
        assert kubectl(cluster, "kubectl apply -f examples/digits-train.yaml").returncode == 0
        groups = [group["name"] for group in cluster.request("GET", "/apis")[1]["groups"]]
        assert groups.index(GATEWAY_GROUP) < groups.index("tandem.dev"), groups
        # kubectl keeps discovery in its cache (~/.kube/cache, here KUBECACHEDIR, for 6 hours) and, finding
        # `inferencepools` there, goes on meaning Tandem's, as it was before the Gateway API's CRD came; `kubectl
        # api-resources` reads discovery afresh, as the README says.
        (stale,) = table(kubectl(cluster, "kubectl get inferencepools").stdout)
        assert stale["NAME"] == "digits" and "MODE" in stale, stale
        assert kubectl(cluster, "kubectl api-resources").returncode == 0

        # GAIE #1372: with Tandem's pool and none of the Gateway API's, the bare plural finds nothing.
        empty = kubectl(cluster, "kubectl get inferencepools")
        assert (empty.returncode, empty.stdout, empty.stderr) == (0, "", "No resources found in default namespace.\n")
        assert kubectl(cluster, "kubectl apply -f -", input=json.dumps(GATEWAY_POOL)).stdout == \
            f"inferencepool.{GATEWAY_GROUP}/vllm-llama3 created\n"

        last = {"apply": 0, "delete": 2}
        for command in sorted(README_POOL_COMMANDS, key=lambda c: last.get(shlex.split(c)[1], 1)):
            result = kubectl(cluster, command)
            verb = shlex.split(command)[1]
            if is_bare(command) or "infpool" in command:  # the Gateway API's, silently
                if command.endswith(" digits"):
                    assert result.stderr == f'Error from server (NotFound): inferencepools.{GATEWAY_GROUP} "digits" ' \
                                            "not found\n", result
                else:
                    assert result.stderr == "" and [row["NAME"] for row in table(result.stdout)] == ["vllm-llama3"]
                continue
            assert result.returncode == 0, result
            assert "vllm-llama3" not in result.stdout + result.stderr and GATEWAY_GROUP not in result.stderr
            if command.startswith("kubectl get tandem"):
                assert sorted(row["NAME"] for rows in tables(result.stdout) for row in rows) == [
                    "inferencepool.tandem.dev/digits", "paralleltrainingjob.tandem.dev/digits-train"]
            elif verb == "get":
                (row,) = table(result.stdout)
                assert row["NAME"] == "digits" and all(column in POOL_COLUMNS for column in list(row)[1:]), row
            else:
                assert re.search(r'inferencepool\.tandem\.dev[/ ]"?digits"? (created|unchanged|patched|scaled|deleted)',
                                 result.stdout), result
        assert cluster.get("inferencepools.tandem.dev", "default", "digits") is None  # the README's delete ran
        assert cluster.get(f"inferencepools.{GATEWAY_GROUP}", "default", "vllm-llama3") is not None
