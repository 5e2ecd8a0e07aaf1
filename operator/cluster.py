"""Carrying out a Plan through the Kubernetes API (the `kubernetes` client, called from worker threads so the
operator's event loop never blocks): create the objects (an existing one is kept, a ConfigMap replaced), delete
pods, patch the operator's status fields, delete a finished job. Every API error is counted for /metrics."""

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
        self.core = client.CoreV1Api(api)
        self.rbac = client.RbacAuthorizationV1Api(api)
        self.custom = client.CustomObjectsApi(api)

    async def create(self, manifest: dict[str, Any]) -> None:
        kind, namespace = manifest["kind"], manifest["metadata"]["namespace"]
        create, replace = self._writers(kind)
        try:
            await self._call(f"create {kind}", create, namespace, manifest)
        except ApiException as error:
            if error.status != CONFLICT:
                raise
            if replace is not None:
                await self._call(f"replace {kind}", replace, manifest["metadata"]["name"], namespace, manifest)

    async def delete_pod(self, name: str, namespace: str, grace_seconds: int | None = None) -> None:
        """Delete a pod: SIGTERM, then the pod's own grace period (or `grace_seconds`) before SIGKILL."""
        try:
            await self._call("delete Pod", self.core.delete_namespaced_pod, name, namespace,
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

    def _writers(self, kind: str) -> tuple[Callable, Callable | None]:
        """(create, replace-or-None) for a kind: only a ConfigMap is replaced when it exists."""
        return {
            "Pod": (self.core.create_namespaced_pod, None),
            "Service": (self.core.create_namespaced_service, None),
            "ConfigMap": (self.core.create_namespaced_config_map, self.core.replace_namespaced_config_map),
            "ServiceAccount": (self.core.create_namespaced_service_account, None),
            "Role": (self.rbac.create_namespaced_role, None),
            "RoleBinding": (self.rbac.create_namespaced_role_binding, None),
        }[kind]

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
