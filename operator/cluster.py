"""Carrying out a plan through the Kubernetes API (the `kubernetes` client, called from worker threads so the
operator's event loop never blocks): create a job's objects (an existing one is kept, a ConfigMap replaced), put a
pool's objects as they should be (create, or replace the version seen), delete objects, patch the operator's status
fields, delete a finished job. Every call goes through the operator's error policy (api_policy.py): transient
errors retried within the pass, the rest raised for the daemon to decide on."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tandem.api import GROUP, VERSION
from tandem.operator import leadership
from tandem.operator.api_policy import Refused, call

log = logging.getLogger("tandem.operator")
CONFLICT, NOT_FOUND = 409, 404


def login(*, guarded: bool = True) -> client.ApiClient:
    """In-cluster credentials, else KUBECONFIG (as kopf logs in). urllib3 retries nothing by itself: the policy
    (api_policy.py) owns every retry. Guarded (all but the leader election's own client): every write is checked
    against the replica's leadership as it is sent (leadership.guard)."""
    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"), client_configuration=configuration)
    configuration.retries = False
    api = client.ApiClient(configuration)
    return leadership.guard(api) if guarded else api


class Cluster:
    def __init__(self, api: client.ApiClient):
        self.api = api
        self.core = client.CoreV1Api(api)
        self.rbac = client.RbacAuthorizationV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.scheduling = client.SchedulingV1Api(api)
        apps, policy, autoscaling = client.AppsV1Api(api), client.PolicyV1Api(api), client.AutoscalingV2Api(api)
        core, rbac = self.core, self.rbac
        self._writers: dict[str, tuple[Callable, Callable, Callable]] = {  # kind: (create, replace, delete)
            "Pod": (core.create_namespaced_pod, core.replace_namespaced_pod, core.delete_namespaced_pod),
            "Service": (core.create_namespaced_service, core.replace_namespaced_service,
                        core.delete_namespaced_service),
            "ConfigMap": (core.create_namespaced_config_map, core.replace_namespaced_config_map,
                          core.delete_namespaced_config_map),
            "ServiceAccount": (core.create_namespaced_service_account, core.replace_namespaced_service_account,
                               core.delete_namespaced_service_account),
            "Role": (rbac.create_namespaced_role, rbac.replace_namespaced_role, rbac.delete_namespaced_role),
            "RoleBinding": (rbac.create_namespaced_role_binding, rbac.replace_namespaced_role_binding,
                            rbac.delete_namespaced_role_binding),
            "Deployment": (apps.create_namespaced_deployment, apps.replace_namespaced_deployment,
                           apps.delete_namespaced_deployment),
            "PodDisruptionBudget": (policy.create_namespaced_pod_disruption_budget,
                                    policy.replace_namespaced_pod_disruption_budget,
                                    policy.delete_namespaced_pod_disruption_budget),
            "HorizontalPodAutoscaler": (autoscaling.create_namespaced_horizontal_pod_autoscaler,
                                        autoscaling.replace_namespaced_horizontal_pod_autoscaler,
                                        autoscaling.delete_namespaced_horizontal_pod_autoscaler),
        }

    async def create(self, manifest: dict[str, Any]) -> None:
        """Create an object; one that exists is kept, except a ConfigMap, which is replaced, and a PodGroup, whose
        spec is patched (both follow the group). Kinds of other API groups (a Workload, a PodGroup) are custom
        objects, their resource the kind's plural."""
        kind, metadata = manifest["kind"], manifest["metadata"]
        target = f"{metadata['namespace']}/{metadata['name']}"
        if kind not in self._writers:
            await self._create_custom(manifest, target)
            return
        create, replace, _ = self._writers[kind]
        try:
            await call("create", kind, target, create, metadata["namespace"], manifest)
        except ApiException as error:  # 409: it exists
            if kind == "ConfigMap" and error.status == CONFLICT:
                await call("replace", kind, target, replace, metadata["name"], metadata["namespace"], manifest)

    async def _create_custom(self, manifest: dict[str, Any], target: str) -> None:
        group, version = manifest["apiVersion"].split("/")
        kind, namespace, plural = manifest["kind"], manifest["metadata"]["namespace"], custom_plural(manifest["kind"])
        try:
            await call("create", kind, target, self.custom.create_namespaced_custom_object, group, version, namespace,
                       plural, manifest)
        except ApiException as error:  # 409: it exists; 404: the API server does not serve the kind
            if error.status == NOT_FOUND:
                raise Refused("create", kind, target, NOT_FOUND, "NotFound",
                              f"the API server does not serve {group}/{version} {plural}") from error
            if kind == "PodGroup" and error.status == CONFLICT:
                await call("patch", kind, target, self.custom.patch_namespaced_custom_object, group, version,
                           namespace, plural, manifest["metadata"]["name"], {"spec": manifest["spec"]},
                           _content_type="application/merge-patch+json")

    async def put(self, manifest: dict[str, Any], existing: dict[str, Any] | None) -> dict[str, Any] | None:
        """Make an object as `manifest` says: create it, or replace `existing` (the version the decision saw), and
        return it as the API now holds it. A create that finds the object there (the index has not caught up with
        it) writes nothing (None): the next pass decides on what the index then shows. A replace of a version the
        API has moved past raises `Stale`."""
        kind, metadata = manifest["kind"], manifest["metadata"]
        create, replace, _ = self._writers[kind]
        target = f"{metadata['namespace']}/{metadata['name']}"
        try:
            if existing is None:
                written = await call("create", kind, target, create, metadata["namespace"], manifest)
            else:
                versioned = {**manifest, "metadata": {**metadata,
                                                      "resourceVersion": existing["metadata"].get("resourceVersion")}}
                written = await call("replace", kind, target, replace, metadata["name"], metadata["namespace"],
                                     versioned)
        except ApiException as error:
            if error.status != CONFLICT:
                raise  # 404 on a replace: deleted meanwhile; the pass is decided again
            log.debug("%s %s exists already: decided again next time", kind, target)
            return None
        return self.api.sanitize_for_serialization(written)

    async def delete(self, kind: str, name: str, namespace: str, grace_seconds: int | None = None) -> bool:
        """Delete an object (one already gone is fine); whether it was there (False: 404). A pod gets SIGTERM, then
        its own grace period (or `grace_seconds`) before SIGKILL."""
        try:
            await call("delete", kind, f"{namespace}/{name}", self._writers[kind][2], name, namespace,
                       grace_period_seconds=grace_seconds)
        except ApiException:  # 404, the only answer `call` hands back to a delete
            return False
        return True

    async def pod_uids(self, namespace: str, selector: str) -> set[str]:
        """The uids of the pods `selector` picks, as the API holds them now (a LIST)."""
        listed = await call("list", "Pod", f"{namespace}/{selector}", self.core.list_namespaced_pod, namespace,
                            label_selector=selector)
        return {pod.metadata.uid for pod in listed.items}

    async def patch_status(self, plural: str, name: str, namespace: str, status: dict[str, Any]) -> None:
        """A merge patch of the status subresource; a resource deleted meanwhile is left alone."""
        with contextlib.suppress(ApiException):  # 404: deleted meanwhile
            await call("patch", f"{plural}/status", f"{namespace}/{name}",
                       self.custom.patch_namespaced_custom_object_status, GROUP, VERSION, namespace, plural, name,
                       {"status": status}, _content_type="application/merge-patch+json")

    async def delete_custom(self, plural: str, name: str, namespace: str, group: str = GROUP,
                            version: str = VERSION) -> bool:
        """Delete a custom object (one already gone is fine); whether it was there (False: 404)."""
        try:
            await call("delete", plural, f"{namespace}/{name}", self.custom.delete_namespaced_custom_object, group,
                       version, namespace, plural, name)
        except ApiException:  # 404: done
            return False
        return True

    async def patch_custom_status(self, group: str, version: str, plural: str, namespace: str, name: str,
                                  patch: dict[str, Any]) -> dict[str, Any]:
        """A merge patch of a custom object's status subresource (with the resourceVersion it was decided on, if the
        patch names one: 409, `Stale`, when the object has moved on); the object as the API now holds it."""
        written = await call("patch", f"{plural}/status", f"{namespace}/{name}",
                             self.custom.patch_namespaced_custom_object_status, group, version, namespace, plural,
                             name, patch, _content_type="application/merge-patch+json")
        return self.api.sanitize_for_serialization(written)

    async def read_cluster_custom(self, group: str, version: str, plural: str, name: str) -> dict[str, Any] | None:
        """A cluster-scoped custom object (a Kueue ResourceFlavor or WorkloadPriorityClass); None if there is none."""
        try:
            return await call("get", plural, name, self.custom.get_cluster_custom_object, group, version, plural, name)
        except ApiException:  # 404
            return None

    async def priority_class_value(self, name: str) -> int | None:
        """A PriorityClass's value (scheduling.k8s.io); None if there is none."""
        try:
            found = await call("get", "priorityclasses", name, self.scheduling.read_priority_class, name)
        except ApiException:  # 404
            return None
        return found.value


def custom_plural(kind: str) -> str:
    """The resource of a custom kind the operator writes (all regular: Workload, PodGroup)."""
    return kind.lower() + "s"
