"""A Kubernetes API emulator good enough to run a real kopf operator and the `kubernetes` client against it.

`Emulator` subclasses kmock 0.8's `KubernetesEmulator`. As shipped, that class does not run a kopf operator end to
end; the fixes, each named here and implemented in the module beside it:

- `__call__` and `_reparse` (fix: paths): `/api/v1/namespaces` (on which kmock's parser raises),
  `/api/v1/namespaces/NAME[/status]` and every namespaced and cluster-scoped path parse right, a trailing slash
  (the `kubernetes` client's `/apis/`) is no other path; PUT is routed (as an update), so is DELETE on a
  collection; API errors (404, 409, 422) are answers, not kept as failures;
- `__call__` (fix: state changes): kmock's pre-dispatch store mutation is skipped; each verb below does its own,
  through writes.py (uid, resourceVersion, creationTimestamp, generation, generateName, status isolation, 409 on a
  stale resourceVersion, schema of custom resources with their CEL rules: schema.py, cel.py) and lifecycle.py
  (finalizers, graceful pod deletion, ownerReference garbage collection, namespaces, CRDs);
- `_document` (fix: discovery, discovery.py): core/v1, apps/v1, batch/v1, policy/v1 (PodDisruptionBudgets),
  autoscaling/v2 (HorizontalPodAutoscalers), rbac, coordination (leases), events.k8s.io, scheduling, apiextensions
  (CRDs) and every applied CRD's resources with the subresources it declares, listed as a server lists them (kmock's
  own documents named the core group `/v1`, so kubectl found no `pods`); kopf's peering resources are absent, so
  kopf runs without peering; and the OpenAPI v3 documents kubectl reads before `apply` (openapi.py);
- `_table` (fix: server-side printing, tables.py): a GET, LIST or watch that accepts a meta.k8s.io Table gets one
  (the CRDs' printer columns, pods' built-in columns), so `kubectl get` prints what it prints on a cluster;
- `_refuse_unknown_fields` (fix: field validation, openapi.py): `fieldValidation=Strict` (kubectl apply's) refuses a
  custom resource's undeclared field with the server's 400 `strict decoding error`;
- `_serve_list` / `_serve_watch` (fix: selectors, resourceVersion): label and field selectors; a list reports the
  store's resourceVersion and a watch from it streams exactly the later events (selectors turn MODIFIED into
  ADDED/DELETED as an object enters or leaves them), `timeoutSeconds` ends the stream, a resourceVersion older than
  the kept events gets a 410 Gone ERROR event, `sendInitialEvents` ends its initial ADDED events with a BOOKMARK;
- `_serve_update` (fix: PUT and patches): merge-patch, strategic-merge-patch (as merge-patch), JSON-patch with
  `test` (422 when it fails), PUT with a resourceVersion conflict (409); `/status` and `/scale` subresources;
- `_serve_create` (fix: 201 Created, the only answer the `kubernetes` client reads a custom object's create from);
  binding and eviction of pods; `_serve_log`: a pod's log, as text (subresources.py);
- `_serve_directly` (fix: speed): kmock's DSL matching costs more with every request served (quadratic over a run);
  resource requests bypass it unless a test added its own kmock reactions (fault injection still works, slower).

Added for the tests (faults.py), on both paths (direct and kmock's DSL), switched per test:

- clients: each request's client is named by its bearer token (`client_of`): `client-NAME` is NAME, a pod's
  `pod-UID` is `pods`, the test kubelet's and the Deployment controller's `client-kubelet` is `kubelet`, anything
  else (the tests' own clients) `tests`;
- `inject(Faults(...))`: for the named clients' resource requests, latency before serving (a watch: before its
  stream), hung requests (held unanswered and never applied until the client gives up, then the connection dropped),
  writes answered with an error `Status` (500 InternalError, 503 ServiceUnavailable, 429 TooManyRequests, with
  `Retry-After` and details.retryAfterSeconds for 429/503) and nothing written, watch streams ended after a time
  (cleanly, or the TCP connection cut without the last chunk), and resumed watches answered with a 410 Gone ERROR
  event; `injected` counts each by (client, fault, method, plural); `inject(None)` serves as before;
- `hooks`: `Served` requests (status < 400, committed) are offered to hooks (`Cluster.after`), each called once,
  before the answer goes out. With no faults and no hooks, a request costs two attribute reads more.

Not emulated: authentication and authorization (every request is allowed, RBAC objects are only stored),
admission webhooks, server-side apply, `limit`/`continue` paging (a list returns everything), watch bookmarks
(`allowWatchBookmarks` is ignored), defaulting of built-in objects (a Deployment's absent `replicas` or `strategy`
stays absent; its controller reads them with their defaults), and the built-in controllers other than garbage
collection, namespaces and CRDs: no ReplicaSet, Job, HorizontalPodAutoscaler, disruption or Service endpoints
controllers (a PodDisruptionBudget or an HPA is only stored). A minimal Deployment controller is deployments.py, a
client of this API that the harness runs beside the kubelet. Events of core/v1 and events.k8s.io/v1 are two
separate stores, not one converted between the two APIs.

The API for assertions (any thread): `get(resource, namespace, name)`, `list(resource, namespace=None)`,
`history(resource, namespace, name)`; `resource` is any name `Catalog.lookup` knows ('pods', 'ptj', 'v1/pods').
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp.web
import attrs
import kmock
from kmock._internal import rendering

from . import discovery, lifecycle, openapi, patches, subresources, tables
from . import faults as faults_
from .catalog import Catalog, Kind
from .selectors import Selection, SelectorError
from .store import Event, Gone, Store
from .writes import Writer, api_error

logger = logging.getLogger(__name__)
_RawHandler: Any = kmock.RawHandler
_StreamingError: Any = rendering.StreamingError


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    catalog: Catalog = attrs.field(factory=Catalog, init=False)
    store: Store = attrs.field(init=False)
    writer: Writer = attrs.field(init=False)
    pod_logs: subresources.LogReader | None = attrs.field(default=None, init=False)  # set by the kubelet
    pod_paths: dict[str, list[tuple[str, str]]] = attrs.field(factory=dict, init=False)  # set by the kubelet
    bugs: list[BaseException] = attrs.field(factory=list, init=False)  # 500s: the emulator's own failures
    _builtin_reactions: int = attrs.field(default=0, init=False)
    injector: faults_.Injector = attrs.field(factory=faults_.Injector, init=False)
    hooks: faults_.Hooks = attrs.field(factory=faults_.Hooks, init=False)
    _watch_ends: dict[int, tuple[float, bool, tuple]] = attrs.field(factory=dict, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self.store = Store(self._objects)
        self.writer = Writer(self.catalog, self.store)
        lifecycle.GarbageCollector(self.writer, spawn=lambda fn: asyncio.get_running_loop().call_soon(fn))
        lifecycle.NamespaceController(self.writer)
        lifecycle.CrdController(self.writer, on_change=self._serve_catalog)
        self._serve_catalog()
        self._builtin_reactions = len(self._payloads)

    # -- the API for assertions -----------------------------------------------------------------------------------
    def get(self, resource: str | Kind, namespace: str | None, name: str) -> dict[str, Any] | None:
        return self.store.get(self.writer.key(self.catalog.lookup(resource), namespace, name))

    def list(self, resource: str | Kind, namespace: str | None = None) -> list[dict[str, Any]]:
        return self.store.items(self.catalog.lookup(resource).resource, namespace)

    def history(self, resource: str | Kind, namespace: str | None, name: str) -> list[dict[str, Any] | None]:
        return self.store.history(self.writer.key(self.catalog.lookup(resource), namespace, name))

    def watches(self, resource: str | Kind) -> int:
        """How many watches of `resource` are open now."""
        return self.store.watches(self.catalog.lookup(resource).resource)

    async def __aexit__(self, *exc_info: Any) -> None:
        self.store.close()
        await super().__aexit__(*exc_info)

    # -- fix: discovery -------------------------------------------------------------------------------------------
    def _serve_catalog(self) -> None:
        self.resources.clear()
        for kind in self.catalog:
            self.resources[kind.resource] = kind.info()

    def _get_resources(self) -> list[kmock.resource]:
        return [kind.resource for kind in self.catalog]

    def _document(self, path: str) -> dict[str, Any] | None:
        """Fix (discovery, OpenAPI): the documents kubectl reads (discovery.py, openapi.py); None: not one of them."""
        if path.startswith("/openapi/"):
            return openapi.document(self.catalog, path)
        return discovery.document(self.catalog, path)

    # -- fix: paths -----------------------------------------------------------------------------------------------
    def _reparse(self, request: kmock.Request) -> kmock.Request:
        if request.url.path != "/" and request.url.path.endswith("/"):  # the client's discovery asks for `/apis/`
            request = attrs.evolve(request, url=request.url.with_path(request.url.path.rstrip("/")))
        parts = [part for part in request.url.path.split("/") if part]
        if len(parts) >= 3 and parts[0] == "api":
            group, version, rest = "", parts[1], parts[2:]
        elif len(parts) >= 4 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            return request  # discovery and non-Kubernetes paths: kmock parses those right
        namespace = None
        if rest[0] == "namespaces" and len(rest) >= 3 and (len(rest) > 3 or self.catalog.find(group, version, rest[2])):
            namespace, rest = rest[1], rest[2:]
        plural, name, sub = rest[0], rest[1] if len(rest) > 1 else None, "/".join(rest[2:]) or None
        method = str(request.method.value).upper()
        if method == "GET" and request.params.get("watch") in ("true", "1"):
            action = kmock.action.WATCH
        else:
            action = {"GET": kmock.action.FETCH if name else kmock.action.LIST, "POST": kmock.action.CREATE,
                      "PATCH": kmock.action.UPDATE, "PUT": kmock.action.UPDATE,
                      "DELETE": kmock.action.DELETE}.get(method)
        return attrs.evolve(request, resource=kmock.resource(group, version, plural), namespace=namespace, name=name,
                            subresource=sub, action=action)

    # -- fix: parsing -------------------------------------------------------------------------------------------
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        """kmock's `RawHandler.__call__`, but for how a request is parsed: kmock's parser raises on a bare
        `/api/v1/namespaces` before any handler runs; here a request kmock cannot parse is built plainly and
        `_reparse` reads its path. Faults (faults.py) and hooks are applied here, on both paths (direct and DSL);
        with neither, a request costs one more attribute read."""
        try:
            await raw_request.read()
        except ConnectionError:  # the client died mid-request (an operator SIGKILLed): nobody to answer
            return aiohttp.web.Response(status=499)
        try:
            request = self._map_pod_paths(self._reparse(await self._parse(raw_request, len(self._requests))))
            self._requests.append(request)
        except Exception as error:
            return await self._failed(error, None)
        faults, hooks = self.injector.faults, self.hooks.pending
        if faults is None and not hooks:
            return await self._respond(request)
        client = self.client_of(request)
        if faults is not None and client in faults.clients and request.action is not None \
                and request.resource is not None and request.resource.plural \
                and (faults.resources is None or request.resource.plural in faults.resources):
            injected = await self._inject(request, client, faults)
            if injected is not None:
                return injected
        response = await self._respond(request)
        if self.hooks.pending and isinstance(response, aiohttp.web.Response) and response.status < 400 \
                and request.action is not None and request.action != kmock.action.WATCH:
            self._after(request, client, response)
        return response

    async def _respond(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        raw_response = None
        try:
            if str(request.method.value).upper() == "GET" and (served := self._document(request.url.path)) is not None:
                return aiohttp.web.json_response(served)
            if request.action == kmock.action.FETCH and request.subresource == "log":
                return self._serve_log(request)  # text/plain, which kmock's payloads cannot answer
            direct = request.action is not None and request.resource is not None and request.resource.plural
            if direct and len(self._payloads) == self._builtin_reactions:
                return await self._serve_directly(request)
            try:
                return await _RawHandler._handle(self, request)  # fix: no store mutation before dispatch
            except _StreamingError as error:
                raw_response = error.args[0]
                raise error.__cause__ from None
        except Exception as error:
            return await self._failed(error, raw_response)

    async def _failed(self, error: Exception, raw_response: Any) -> aiohttp.web.StreamResponse:
        if not self._errors:
            raise error
        if isinstance(error, kmock.KubernetesError):
            return await self._render_error(error)  # an API answer (404, 409, 422...), not a failure
        self._errors[-1].append(error)
        if raw_response is None or not raw_response.prepared:
            return await self._render_error(error)
        await self._stream_error(error, raw_response)
        await raw_response.write_eof()
        return raw_response

    # -- faults and hooks (faults.py) ------------------------------------------------------------------------------
    @property
    def injected(self) -> faults_.Counts:
        """What was injected, by (client, fault, method, plural); readable from any thread."""
        return self.injector.counts

    def inject(self, faults: faults_.Faults | None) -> None:
        """Switch faults on (or off with None); any thread."""
        self.injector.set(faults)

    def received(self, since: int = 0) -> list[tuple[str, str, str | None, str | None]]:
        """Every request received from the `since`th on, in order, answered or not (refused, failed, faulted):
        (client, method, plural, name). Any thread."""
        return [(self.client_of(request), str(request.method.value).upper(),
                 request.resource.plural if request.resource else None, request.name)
                for request in self._requests[since:]]

    def client_of(self, request: kmock.Request) -> str:
        """Who sent the request, by its bearer token: `client-NAME` is NAME, a pod's `pod-UID` is `pods`, anything
        else `tests`."""
        raw = request._raw_request
        header = (raw.headers if raw is not None else request.headers).get("Authorization") or ""
        token = header.removeprefix("Bearer ").strip()
        if token.startswith("client-"):
            return token.removeprefix("client-")
        if token.startswith("pod-") or token in self.pod_paths:
            return "pods"
        return "tests"

    async def _inject(self, request: kmock.Request, client: str, faults: faults_.Faults
                      ) -> aiohttp.web.StreamResponse | None:
        """The fault this request meets, as an answer; None: serve it (perhaps late, or a watch that will end)."""
        injector, method, plural = self.injector, str(request.method.value).upper(), request.resource.plural
        if faults.latency > 0:
            injector.count(client, "latency", method, plural)
            await asyncio.sleep(faults.latency)
        raw = request._raw_request
        if request.action == kmock.action.WATCH:
            since = request.params.get("resourceVersion")
            if since not in (None, "", "0") and injector.roll(faults.gone_on_resume):
                injector.count(client, "gone", method, plural)
                response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
                await response.prepare(raw)
                await response.write(_line("ERROR", {
                    "apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure", "code": 410,
                    "reason": "Expired", "message": f"too old resource version: {since} (injected fault)"}))
                await response.write_eof()
                return response
            if faults.watch_end_after is not None:
                self._watch_ends[id(raw)] = (faults.watch_end_after, faults.watch_end_abruptly,
                                             (client, "watch-end", method, plural))
            return None
        if injector.roll(faults.hang_fraction):
            injector.count(client, "hang", method, plural)
            transport = raw.transport if raw is not None else None
            end = time.monotonic() + faults_.HANG_LIMIT
            while transport is not None and not transport.is_closing() and time.monotonic() < end:
                await asyncio.sleep(0.05)
            if transport is not None:
                transport.abort()
            raise asyncio.CancelledError  # nothing to answer: aiohttp drops the request quietly
        if method in faults_.WRITES and faults.write_codes and injector.roll(faults.write_fraction):
            code = faults.write_codes[injector.rng.randrange(len(faults.write_codes))]
            injector.count(client, f"error-{code}", method, plural)
            body, headers = faults_.status(code, f"injected fault: {code} for {method} {plural} by {client}",
                                           faults.retry_after)
            return aiohttp.web.json_response(body, status=code, headers=headers)
        return None

    def _after(self, request: kmock.Request, client: str, response: aiohttp.web.Response) -> None:
        try:
            result = json.loads(response.body) if response.body else None
        except (TypeError, ValueError):
            result = None
        res = request.resource
        self.hooks.run(faults_.Served(client, str(request.method.value).upper(), res.plural if res else None,
                                      request.namespace, request.name, request.subresource, request.data, result))

    async def _serve_directly(self, request: kmock.Request) -> aiohttp.web.StreamResponse:
        """Fix (speed): kmock's DSL decides whether a reaction matches a request by scanning every request served
        so far, so each request costs more than the last (quadratic over a run). While no test has added its own
        reactions (`emulator[...] << ...`), resource requests go straight to the verbs; with one, through the DSL."""
        table = tables.table_version(self._header(request, "Accept"))
        if request.action == kmock.action.WATCH:
            return await self._stream(request, self._serve_watch(request, table=table))
        serve = {kmock.action.LIST: self._serve_list, kmock.action.FETCH: self._serve_fetch,
                 kmock.action.CREATE: self._serve_create, kmock.action.UPDATE: self._serve_update,
                 kmock.action.DELETE: self._serve_delete}[request.action]
        result, status = await serve(request), 200
        if isinstance(result, rendering.Response):
            result, status = result.payload, result.status
        if table and request.action in (kmock.action.LIST, kmock.action.FETCH) and request.subresource is None:
            result = self._table(request, result, table)
        return aiohttp.web.json_response(result, status=status)

    def _table(self, request: kmock.Request, result: dict[str, Any], version: str) -> dict[str, Any]:
        """Fix (server-side printing, tables.py): a LIST's or GET's answer as the Table kubectl asked for."""
        objects = result["items"] if request.action == kmock.action.LIST else [result]
        revision = (result.get("metadata") or {}).get("resourceVersion")
        return tables.table(self._kind(request), objects, version=version, resource_version=revision,
                            include=request.params.get("includeObject"))

    @staticmethod
    def _header(request: kmock.Request, name: str) -> str | None:
        raw = request._raw_request
        return (raw.headers if raw is not None else request.headers).get(name)

    def _refuse_unknown_fields(self, request: kmock.Request, kind: Kind, obj: Any) -> None:
        """Fix (field validation, openapi.py): `fieldValidation=Strict` (kubectl apply's) refuses what pruning would
        drop from a custom resource; without it, or with Warn or Ignore, it is pruned silently."""
        if request.params.get("fieldValidation") != "Strict" or not kind.schema or not isinstance(obj, dict):
            return
        unknown = openapi.unknown_fields(obj, kind.schema)
        if unknown:
            raise api_error(400, "BadRequest", f'{kind.kind} in version "{kind.version}" cannot be handled as a '
                            f'{kind.kind}: strict decoding error: ' + ", ".join(f'unknown field "{field}"'
                                                                               for field in unknown))

    @staticmethod
    async def _stream(request: kmock.Request, lines: AsyncIterator[bytes]) -> aiohttp.web.StreamResponse:
        first = await anext(lines)  # an error (404, 400) raises here, before any header is sent
        response = aiohttp.web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request._raw_request)
        try:
            await response.write(first)
            async for line in lines:
                await response.write(line)
            await response.write_eof()
        except ConnectionError:
            pass  # the client went away
        finally:
            await lines.aclose()
        return response

    def _map_pod_paths(self, request: kmock.Request) -> kmock.Request:
        """A pod's process sees its volumes at local directories (the test kubelet's emulation of mounts): in what it
        writes through the API, those directories are mapped back to their mount paths, as the process would have
        written them on a cluster. The pod is known by its kubeconfig's bearer token."""
        token = (request.headers.get("Authorization") or "").removeprefix("Bearer ").strip()
        pairs = self.pod_paths.get(token)
        if not pairs or request.data is None:
            return request
        pairs = sorted(pairs, key=lambda pair: -len(pair[0]))

        def unmap(value: Any) -> Any:
            if isinstance(value, str):
                for local, mount_path in pairs:
                    value = value.replace(local, mount_path)
                return value
            if isinstance(value, dict):
                return {key: unmap(item) for key, item in value.items()}
            return [unmap(item) for item in value] if isinstance(value, list) else value

        return attrs.evolve(request, data=unmap(request.data))

    @staticmethod
    async def _parse(raw_request: aiohttp.web.BaseRequest, id_: int) -> kmock.Request:
        try:
            return await kmock.Request._parse(raw_request, id=id_)
        except ValueError:
            text = await raw_request.text()
            try:
                data = json.loads(text) if text else None
            except ValueError:
                data = None
            return kmock.Request(id=id_, raw_request=raw_request, url=raw_request.url, method=raw_request.method,
                                 params=dict(raw_request.query), headers=dict(raw_request.headers),
                                 cookies=dict(raw_request.cookies), body=await raw_request.read(), text=text, data=data)

    async def _render_error(self, exc: Exception) -> aiohttp.web.StreamResponse:
        if not isinstance(exc, kmock.KubernetesError):
            self.bugs.append(exc)
            logger.error("emulator failure", exc_info=exc)
        return await super()._render_error(exc)

    def _kind(self, request: kmock.Request) -> Kind:
        res = request.resource
        kind = self.catalog.find(res.group, res.version, res.plural) if res else None
        if kind is None or (request.namespace is not None and not kind.namespaced):
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        return kind

    def _key(self, request: kmock.Request, kind: Kind):
        return self.writer.key(kind, request.namespace, request.name)

    def _selection(self, request: kmock.Request) -> Selection:
        try:
            return Selection.of(request.namespace, request.name, request.params)
        except SelectorError as error:
            raise api_error(400, "BadRequest", str(error)) from None

    # -- verbs ----------------------------------------------------------------------------------------------------
    async def _serve_list(self, request: kmock.Request) -> dict[str, Any]:
        kind = self._kind(request)
        selection = self._selection(request)
        with self.store.mutex:
            items = [obj for key in self.store.keys(kind.resource, request.namespace)
                     if selection.matches(obj := self.store.live(key))]
            revision = self.store.revision
        return {"apiVersion": kind.api_version, "kind": f"{kind.kind}List",
                "metadata": {"resourceVersion": str(revision)}, "items": items}

    async def _serve_fetch(self, request: kmock.Request) -> Any:
        kind = self._kind(request)
        key = self._key(request, kind)
        obj = self.store.live(key)
        if obj is None:
            raise lifecycle.not_found(kind, request.name)
        sub = request.subresource
        if sub is None or (sub == "status" and kind.has_status):
            return obj
        if sub == "scale" and kind.scale:
            return subresources.scale_of(kind, obj)
        raise api_error(404, "NotFound", "the server could not find the requested resource")

    def _serve_log(self, request: kmock.Request) -> aiohttp.web.Response:
        kind = self._kind(request)
        if kind.kind != "Pod" or self.store.live(self._key(request, kind)) is None:
            raise lifecycle.not_found(kind, request.name)
        data = subresources.read_log(self.pod_logs, request.namespace, request.name, request.params)
        return aiohttp.web.Response(body=data, content_type="text/plain", charset="utf-8")

    async def _serve_create(self, request: kmock.Request) -> rendering.Response:
        """201 Created, as the API server answers (the `kubernetes` client reads a custom object's create only
        from a 201)."""
        kind = self._kind(request)
        if request.name is None:
            self._refuse_unknown_fields(request, kind, request.data)
            return rendering.Response(status=201, payload=self.writer.create(kind, request.namespace, request.data))
        key = self._key(request, kind)
        if kind.kind == "Pod" and request.subresource == "binding":
            return rendering.Response(status=201, payload=subresources.bind(self.writer, kind, key, request.data))
        if kind.kind == "Pod" and request.subresource == "eviction":
            return rendering.Response(status=201, payload=subresources.evict(self.writer, kind, key, request.data))
        raise api_error(405, "MethodNotAllowed", "the server does not allow this method on the requested resource")

    async def _serve_update(self, request: kmock.Request) -> dict[str, Any]:
        kind = self._kind(request)
        key = self._key(request, kind)
        sub = request.subresource
        method = str(request.method.value).upper()
        content_type = request.headers.get("Content-Type")
        if sub == "scale" and kind.scale:
            return subresources.write_scale(self.writer, kind, key, method, request.data, content_type)
        if sub not in (None, "status") or (sub == "status" and not kind.has_status):
            raise api_error(404, "NotFound", "the server could not find the requested resource")
        current = self.store.live(key)
        if current is None:
            raise lifecycle.not_found(kind, request.name)
        if method == "PUT":
            desired = request.data
        else:
            try:
                desired = patches.apply(current, request.data, content_type)
            except patches.PatchError as error:
                raise api_error(error.status, error.reason, error.message) from None
        self._refuse_unknown_fields(request, kind, desired)
        expect = ((desired or {}).get("metadata") or {}).get("resourceVersion") if isinstance(desired, dict) else None
        return self.writer.update(kind, key, desired, subresource=sub, expect_version=expect)

    async def _serve_delete(self, request: kmock.Request) -> dict[str, Any]:
        kind = self._kind(request)
        options = dict(request.data) if isinstance(request.data, dict) else {}
        options.update({k: request.params[k] for k in ("gracePeriodSeconds", "propagationPolicy")
                        if k in request.params})
        if request.name is None:  # deletecollection
            selection = self._selection(request)
            for key in self.store.keys(kind.resource, request.namespace):
                if selection.matches(self.store.live(key)):
                    lifecycle.delete(self.writer, kind, key, options)
            return subresources.success("", kind.plural)
        obj, gone = lifecycle.delete(self.writer, kind, self._key(request, kind), options)
        if gone and kind.kind != "Pod":
            return subresources.success(request.name, kind.plural, obj["metadata"].get("uid"))
        return obj

    async def _serve_watch(self, request: kmock.Request, table: str | None = None) -> AsyncIterator[bytes]:
        """`table`: each event's object as a one-row Table of that version (kubectl get -w, tables.py)."""
        kind = self._kind(request)
        render = None if table is None else lambda obj: tables.table(
            kind, [obj], version=table, include=request.params.get("includeObject"),
            resource_version=obj["metadata"].get("resourceVersion"))
        selection = self._selection(request)
        params = request.params
        since = params.get("resourceVersion") or None
        if since is not None and not since.isdigit():
            raise api_error(400, "BadRequest", f"invalid resourceVersion: {since!r}")
        since = None if since in (None, "0") else int(since)
        deadline = time.monotonic() + float(params["timeoutSeconds"]) if params.get("timeoutSeconds") else None
        cut = self._watch_ends.pop(id(request._raw_request), None)  # an injected end of this stream
        yield b""  # the headers go out now, even if nothing happens
        ends = None if cut is None else time.monotonic() + cut[0]
        deadline = ends if deadline is None or (ends is not None and ends < deadline) else deadline
        try:
            current, backlog, queue = self.store.subscribe(kind.resource, since)
        except Gone as gone:
            yield _line("ERROR", {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Failure",
                                  "code": 410, "reason": "Expired", "message": str(gone)})
            return
        try:
            for obj in current:
                if selection.matches(obj):
                    yield _line("ADDED", obj, render)
            if params.get("sendInitialEvents") == "true":
                yield _line("BOOKMARK", {"apiVersion": kind.api_version, "kind": kind.kind, "metadata": {
                    "resourceVersion": str(self.store.revision),
                    "annotations": {"k8s.io/initial-events-end": "true"}}})
            for event in backlog:
                if line := _translate(event, selection, render):
                    yield line
            while deadline is None or time.monotonic() < deadline:
                wait = 1.0 if deadline is None else min(1.0, deadline - time.monotonic())
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=max(wait, 0))
                except TimeoutError:
                    transport = request._raw_request.transport if request._raw_request else None
                    if transport is None or transport.is_closing():
                        ends = None
                        break  # the client went away
                    continue
                if event is None:
                    ends = None
                    break  # the emulator is stopping
                if line := _translate(event, selection, render):
                    yield line
            if ends is not None and time.monotonic() >= ends:  # the injected end, not the client's timeout
                self.injector.count(*cut[2])
                transport = request._raw_request.transport if request._raw_request else None
                if cut[1] and transport is not None:
                    transport.abort()  # no last chunk: the client sees a broken stream
        finally:
            self.store.unsubscribe(kind.resource, queue)


def _line(type_: str, obj: dict[str, Any], render: Callable[[dict[str, Any]], Any] | None = None) -> bytes:
    return json.dumps({"type": type_, "object": obj if render is None else render(obj)}).encode() + b"\n"


def _translate(event: Event, selection: Selection, render: Callable[[dict[str, Any]], Any] | None = None
               ) -> bytes | None:
    """The event as a watcher with these selectors sees it: entering the selection is ADDED, leaving it DELETED."""
    now, before = selection.matches(event.obj), selection.matches(event.old)
    if event.type == "DELETED":
        return _line("DELETED", event.obj, render) if now or before else None
    if now:
        return _line("MODIFIED" if before and event.type == "MODIFIED" else "ADDED", event.obj, render)
    return _line("DELETED", event.obj, render) if before else None
