"""The Open Inference Protocol's gRPC service (`inference.GRPCInferenceService`, as Triton and KServe serve it) beside
HTTP, on the same event loop, with the messages tritonclient ships: its methods (`methods`) are served by
grpc_server.py, on grpc.aio or through the C front, and the message size is the server's Limits (limits.py).

It is another face of the same server: the same ParallelInference and served model (hot swaps included), the same
pending requests and deadlines, the same answers as routes.py gives over HTTP (metadata, configuration, statistics,
the repository's lockdown), the same token. What differs is only the wire (grpc_protocol.py): an HTTP status becomes
a gRPC status code (a full queue RESOURCE_EXHAUSTED, a deadline DEADLINE_EXCEEDED, a bad request INVALID_ARGUMENT
naming the field). A request's deadline is the shortest of the pool's requestTimeoutMs, the request's
`timeout` parameter and the client's gRPC deadline. The event loop only decodes and encodes; it never calls torch.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

import grpc
from tritonclient.grpc import model_config_pb2, service_pb2

from tandem.worker.serve import triton
from tandem.worker.serve.auth import BearerToken, refusal, rpc_needs_token
from tandem.worker.serve.errors import QueueFullError, ShutDownError
from tandem.worker.serve.grpc_protocol import (
    decode_infer_request,
    encode_infer_response,
    message,
    parameters_dict,
    status_code,
)
from tandem.worker.serve.grpc_server import CallContext, GrpcError, Methods
from tandem.worker.serve.protocol import ProtocolError
from tandem.worker.serve.routes import error_status

if TYPE_CHECKING:
    from tandem.worker.serve.app import InferenceServer

log = logging.getLogger("tandem.serve")

class GrpcCall:
    """An inference call between submit and answer, as PendingRequests holds it: `settle` resolves `answered`, the
    call's future (the ModelInferResponse, or the GrpcError it fails with); `on_abort` (set by PendingRequests)
    withdraws the request when the future is cancelled (the client went away, or the server stopped waiting)."""

    __slots__ = ("answered", "on_abort", "service")

    def __init__(self, answered: asyncio.Future, service: GrpcService):
        self.answered = answered
        self.on_abort: Callable[[], None] | None = None
        self.service = service
        answered.add_done_callback(self._withdraw_if_cancelled)

    def settle(self, context: Any, output: Any, error: BaseException | None) -> None:
        if self.answered.done():
            return
        try:
            answer = self.service.infer_response(context, output, error)
        except Exception as failure:
            self.answered.set_exception(grpc_error(failure, "ModelInfer"))
        else:
            self.answered.set_result(answer)

    def _withdraw_if_cancelled(self, answered: asyncio.Future) -> None:
        if answered.cancelled() and self.on_abort is not None:
            self.on_abort()


def grpc_error(error: Exception, method: str) -> GrpcError:
    """The GrpcError a call failing with `error` answers: a ProtocolError's status as its code; anything unexpected
    logged and INTERNAL (never a crash)."""
    if isinstance(error, GrpcError):
        return error
    if isinstance(error, ProtocolError):
        return GrpcError(status_code(error.status), str(error))
    log.error("unexpected error serving gRPC %s", method, exc_info=error)
    return GrpcError(grpc.StatusCode.INTERNAL, f"internal error: {type(error).__name__}: {error}")


def _rpc(method: Callable[..., Any]) -> Callable[..., Any]:
    """An RPC of the service, a coroutine function or a function returning a future (grpc_server.Handler): the token
    checked (unless the method is open), a failure answered as grpc_error says."""
    name = method.__name__
    needs_token = rpc_needs_token(name)
    coroutine = asyncio.iscoroutinefunction(method)  # known here: not asked again of every call's answer

    @functools.wraps(method)
    def rpc(self: GrpcService, request: Any, context: CallContext) -> Any:
        token = self.token
        if needs_token and token is not None:
            authorization = context.metadata("authorization")
            if not token.allows(authorization):
                raise GrpcError(grpc.StatusCode.UNAUTHENTICATED, refusal(authorization))
        try:
            answer = method(self, request, context)
        except Exception as error:
            raise grpc_error(error, name) from None
        return _answered(answer, name) if coroutine else answer

    rpc.is_rpc = True
    return rpc


async def _answered(answer: Coroutine[Any, Any, Any], method: str) -> Any:
    try:
        return await answer
    except Exception as error:
        raise grpc_error(error, method) from None


class GrpcService:
    """inference.GRPCInferenceService for one InferenceServer. ModelStreamInfer, the shared-memory, trace and
    logging extensions answer UNIMPLEMENTED (as methods the server does not know)."""

    def __init__(self, server: InferenceServer, token: BearerToken | None):
        self.server = server
        self.routes = server.routes
        self.token = token

    def methods(self) -> Methods:
        """Each RPC by its path, with its request's message type (the proto's `<Method>Request`)."""
        service = service_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"]
        return {f"/{service.full_name}/{name}": (getattr(service_pb2, service.methods_by_name[name].input_type.name),
                                                 getattr(self, name))
                for name in dir(type(self)) if getattr(getattr(type(self), name), "is_rpc", False)}

    # -- health and metadata --------------------------------------------------------------------------------

    @_rpc
    async def ServerLive(self, request, context):  # noqa: N802 (the proto's names)
        return service_pb2.ServerLiveResponse(live=True)

    @_rpc
    async def ServerReady(self, request, context):  # noqa: N802
        return service_pb2.ServerReadyResponse(ready=await self.server.group_ready())

    @_rpc
    async def ModelReady(self, request, context):  # noqa: N802
        self.routes.check_model(request.name, request.version or None)
        return service_pb2.ModelReadyResponse(ready=await self.server.group_ready())

    @_rpc
    async def ServerMetadata(self, request, context):  # noqa: N802
        return message(self.routes.server_metadata(), service_pb2.ServerMetadataResponse)

    @_rpc
    async def ModelMetadata(self, request, context):  # noqa: N802
        self.routes.check_model(request.name, request.version or None)
        return message(self.routes.model_metadata(), service_pb2.ModelMetadataResponse)

    @_rpc
    async def ModelConfig(self, request, context):  # noqa: N802
        self.routes.check_model(request.name, request.version or None)
        config = message(self.routes.config(), model_config_pb2.ModelConfig)
        return service_pb2.ModelConfigResponse(config=config)

    @_rpc
    async def ModelStatistics(self, request, context):  # noqa: N802
        """All models' statistics (no name), or the named model's (and version's)."""
        if request.name:
            self.routes.check_model(request.name, request.version or None)
        return message(await self.routes.stats(), service_pb2.ModelStatisticsResponse)

    # -- model repository -------------------------------------------------------------------------------

    @_rpc
    async def RepositoryIndex(self, request, context):  # noqa: N802
        return message({"models": self.routes.index()}, service_pb2.RepositoryIndexResponse)

    @_rpc
    async def RepositoryModelLoad(self, request, context):  # noqa: N802
        """A hot swap under the HTTP endpoint's lockdown (routes.load): PERMISSION_DENIED when loads are off."""
        self.routes.check_model(request.model_name, None)
        await self.routes.load(lambda: triton.load_parameters_checkpoint(parameters_dict(request.parameters)))
        return service_pb2.RepositoryModelLoadResponse()

    @_rpc
    async def RepositoryModelUnload(self, request, context):  # noqa: N802
        self.routes.check_model(request.model_name, None)
        raise ProtocolError(self.routes.unload_refusal())

    # -- inference --------------------------------------------------------------------------------------

    @_rpc
    def ModelInfer(self, request, context):  # noqa: N802
        """Submitted here; answered through the future returned, which GrpcCall settles (no task per call)."""
        routes, server = self.routes, self.server
        outcomes = routes.outcomes
        try:
            routes.check_model(request.model_name, request.model_version or None)
            signature = routes.signature()
            inference = server.model.inference
            if server.draining or inference is None:
                raise ProtocolError(f"the server is {'shutting down' if server.draining else 'loading its model'}",
                                    503)
            decoded = decode_infer_request(request, signature)
        except ProtocolError as error:
            outcomes["invalid" if error.status < 500 else "failed"] += 1
            raise
        pending_requests = server.pending
        timeout = pending_requests.default_timeout
        if decoded.timeout_us is not None:
            timeout = min(timeout, decoded.timeout_us / 1e6)
        remaining = context.time_remaining()
        if remaining is not None:
            timeout = min(timeout, max(remaining, 0.0))
        call = GrpcCall(context.loop.create_future(), self)
        pending = pending_requests.new(call, (decoded, signature), timeout)
        try:
            pending.ticket = inference.submit(decoded.x, pending.post, timeout=timeout)
        except QueueFullError as error:
            outcomes["rejected"] += 1
            raise ProtocolError(str(error), 429) from None
        except ShutDownError as error:
            outcomes["failed"] += 1
            raise ProtocolError(str(error), 503) from None
        pending_requests.track(pending)
        return call.answered

    def infer_response(self, context: Any, output: Any, error: BaseException | None) -> Any:
        """The ModelInferResponse of a call whose output came back (`context`: its decoded request and the model's
        signature); ProtocolError where it failed."""
        outcomes = self.routes.outcomes
        if error is not None:
            outcomes["failed"] += 1
            raise ProtocolError(str(error), error_status(error))
        outcomes["success"] += 1
        decoded, signature = context
        return encode_infer_response(output, decoded, self.routes.name, self.routes.version, signature)
