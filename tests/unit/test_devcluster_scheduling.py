"""devcluster's scheduler verdicts over several nodes (scheduling.py's `schedule`): which node a pod goes on, and the
message, shaped like kube-scheduler's, when it fits on none. The scheduler at work, binding and reporting through the
API, is in tests/integration/test_cluster.py and test_devcluster_faults.py."""

from __future__ import annotations

from devcluster.scheduling import GPU, Node, schedule


def pod(selector: dict[str, str] | None = None, **requests: str) -> dict:
    return {"spec": {"nodeSelector": selector or {},
                     "containers": [{"name": "main", "resources": {"requests": requests}}]}}


def test_one_node_says_why_as_the_single_node_scheduler_always_did():
    node = Node("tandem-node")
    assert schedule([node], pod(**{GPU: "1"}), []) == "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    assert schedule([node], pod(cpu="65", memory="1Ti"), []) == \
        "0/1 nodes are available: 1 Insufficient cpu, 1 Insufficient memory."
    assert schedule([node], pod(), ["data"]) == '0/1 nodes are available: persistentvolumeclaim "data" not found.'
    node.ready = False
    assert schedule([node], pod(), ["data"]) == "0/1 nodes are available: 1 node(s) were not ready."


def test_the_reasons_are_counted_over_the_nodes_and_sorted_as_kube_scheduler_sorts_them():
    nodes = [Node(f"node-{i}", {"cpu": "1", "memory": "1Gi"}, {"zone": "a"}) for i in range(4)]
    nodes[0].ready = False
    nodes[1].labels["zone"] = "b"
    assert schedule(nodes, pod({"zone": "a"}, cpu="2", memory="2Gi"), []) == (
        "0/4 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, 1 node(s) were not ready, "
        "2 Insufficient cpu, 2 Insufficient memory.")
    assert schedule(nodes, pod(), ["data"]) == '0/4 nodes are available: persistentvolumeclaim "data" not found.'
    for node in nodes:
        node.ready = False
    assert schedule(nodes, pod(), ["data"]) == "0/4 nodes are available: 4 node(s) were not ready."


def test_a_pod_goes_on_the_ready_node_with_the_fewest_pods_ties_to_the_first_and_gpus_are_numbered_per_node():
    first, second = Node("tandem-node", {"cpu": "2", GPU: "1"}), Node("tandem-node-2", {"cpu": "2", GPU: "1"})
    placed = []
    for uid in ("a", "b", "c"):
        node = schedule([first, second], pod(cpu="1"), [])
        node.assign(uid, pod(cpu="1"))
        placed.append(node.name)
    assert placed == ["tandem-node", "tandem-node-2", "tandem-node"]
    assert schedule([first, second], pod(cpu="1"), []) is second
    first.release("a")
    second.ready = False
    assert schedule([first, second], pod(cpu="2"), []) == \
        "0/2 nodes are available: 1 Insufficient cpu, 1 node(s) were not ready."
    assert schedule([first, second], pod(cpu="1"), []) is first

    gpus = Node("tandem-node", {GPU: "1"}), Node("tandem-node-2", {GPU: "1"})
    for uid in ("x", "y"):
        schedule(gpus, pod(**{GPU: "1"}), []).assign(uid, pod(**{GPU: "1"}))
    assert (gpus[0].gpus, gpus[1].gpus) == ({"x": [0]}, {"y": [0]})
    assert schedule(gpus, pod(**{GPU: "1"}), []) == "0/2 nodes are available: 2 Insufficient nvidia.com/gpu."
