"""The errors ParallelInference raises for a request, all InferenceErrors (importable from
tandem.worker.serve.inference too)."""

from __future__ import annotations


class InferenceError(RuntimeError):
    """Base class of the errors ParallelInference raises for a request."""


class QueueFullError(InferenceError):
    """The queue already holds queue_limit requests: rejected at once, retry later (HTTP 429)."""


def queue_full_message(queue_limit: int) -> str:
    """What a request refused for a full queue is told, by ParallelInference and by the C front alike."""
    return f"queue full: {queue_limit} requests already waiting (queue_limit={queue_limit}); retry later"


class InferenceTimeout(InferenceError, TimeoutError):
    """The request's timeout passed before its output was ready."""


class ModelError(InferenceError):
    """The model's forward raised, or returned something other than one tensor with a row per example."""


class ShutDownError(InferenceError):
    """ParallelInference has been shut down (or is shutting down without draining)."""
