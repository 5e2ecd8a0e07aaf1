"""Carrying out a plan through the Kubernetes API (the `kubernetes` client, called from worker threads so the
operator's event loop never blocks): create a job's objects (an existing one is kept, a ConfigMap replaced), put a
pool's objects as they should be (create, or replace the version seen), delete objects, patch the operator's status
fields, delete a finished job. Every API error is counted for /metrics."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable
from typing import Any

from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from tandem.api import GROUP, VERSION
from tandem.operator import metrics

log = logging.getLogger("tandem.operator")
CONFLICT, NOT_FOUND = 409, 404


def login() -> client.ApiClient:
    """In-cluster credentials, else KUBECONFIG (as kopf logs in)."""
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))  # read now, not at import
    return client.ApiClient()


class Cluster:
    def __init__(self, api: client.ApiClient):
        self.api = api
        self.core = client.CoreV1Api(api)
        self.rbac = client.RbacAuthorizationV1Api(api)
        self.custom = client.CustomObjectsApi(api)
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
        """Create an object; one that exists is kept, except a ConfigMap, which is replaced."""
        kind, namespace = manifest["kind"], manifest["metadata"]["namespace"]
        create, replace, _ = self._writers[kind]
        try:
            await self._call(f"create {kind}", create, namespace, manifest)
        except ApiException as error:
            if error.status != CONFLICT:
                raise
            if kind == "ConfigMap":
                await self._call(f"replace {kind}", replace, manifest["metadata"]["name"], namespace, manifest)

    async def put(self, manifest: dict[str, Any], existing: dict[str, Any] | None) -> dict[str, Any] | None:
        """Make an object as `manifest` says: create it, or replace `existing` (the version the decision saw), and
        return it as the API now holds it. A 409 means the decision saw an older state than the API holds (the watch
        has not caught up with a write, often the operator's own): nothing is written (None), and the next pass
        decides on the newer state."""
        kind, metadata = manifest["kind"], manifest["metadata"]
        create, replace, _ = self._writers[kind]
        try:
            if existing is None:
                written = await self._call(f"create {kind}", create, metadata["namespace"], manifest)
            else:
                versioned = {**manifest, "metadata": {**metadata,
                                                      "resourceVersion": existing["metadata"].get("resourceVersion")}}
                written = await self._call(f"replace {kind}", replace, metadata["name"], metadata["namespace"],
                                           versioned)
        except ApiException as error:
            if error.status != CONFLICT:
                raise
            log.debug("%s %s/%s changed since it was read: decided again next time", kind, metadata["namespace"],
                      metadata["name"])
            return None
        return self.api.sanitize_for_serialization(written)

    async def delete(self, kind: str, name: str, namespace: str, grace_seconds: int | None = None) -> None:
        """Delete an object (one already gone is fine). A pod gets SIGTERM, then its own grace period (or
        `grace_seconds`) before SIGKILL."""
        try:
            await self._call(f"delete {kind}", self._writers[kind][2], name, namespace,
                             grace_period_seconds=grace_seconds)
        except ApiException as error:
            if error.status != NOT_FOUND:
                raise

    async def patch_status(self, plural: str, name: str, namespace: str, status: dict[str, Any]) -> None:
        await self._call(f"patch {plural}/status", self.custom.patch_namespaced_custom_object_status, GROUP, VERSION,
                         namespace, plural, name, {"status": status}, _content_type="application/merge-patch+json")

    async def delete_custom(self, plural: str, name: str, namespace: str) -> None:
        try:
            await self._call(f"delete {plural}", self.custom.delete_namespaced_custom_object, GROUP, VERSION,
                             namespace, plural, name)
        except ApiException as error:
            if error.status != NOT_FOUND:
                raise

    @staticmethod
    async def _call(what: str, method: Callable, *args: Any, **kwargs: Any) -> Any:
        try:
            return await asyncio.to_thread(method, *args, _request_timeout=30, **kwargs)
        except ApiException as error:
            if error.status not in (CONFLICT, NOT_FOUND):
                metrics.API_ERRORS.labels(what).inc()
                log.warning("%s failed: %s %s", what, error.status, error.reason)
            raise
        except Exception:
            metrics.API_ERRORS.labels(what).inc()
            raise
