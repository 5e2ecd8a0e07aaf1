"""The model a server serves and the ParallelInference that runs it: the first load, hot swaps (by hand through
the repository load endpoint, or following a training job's new checkpoints), and stopping its workers.

Loading and warm-up run on executor threads (model_loading.py does the loading); the event loop keeps answering
requests, on the old model, until a new one is warmed up and switched to atomically. Every load is one line on
the `tandem.serve` logger: what was loaded (and what it replaced), the load time and the warm-up time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.api.inference import BatchingSettings, InferencePoolSpec
from tandem.contract import REFUSED_BATCHING_PARAMETER
from tandem.worker import checkpoint as checkpoints
from tandem.worker.serve import model_loading, promotion
from tandem.worker.serve.inference import ParallelInference
from tandem.worker.serve.model_loading import LoadedModel, ModelLoadError, ModelLocation
from tandem.worker.serve.promotion import Verdict
from tandem.worker.serve.tasks import cancel_and_wait

if TYPE_CHECKING:
    from tandem.worker.serve.group import Peers

log = logging.getLogger("tandem.serve")


PREPARED_SECONDS = 120.0
"""How long a process holds a model prepared for a group swap before dropping it (its leader is gone)."""


@dataclasses.dataclass(frozen=True)
class Prepared:
    """A model loaded and warmed up, not serving yet."""

    loaded: LoadedModel
    replicas: list
    load_seconds: float
    warmup_seconds: float
    weights: Path | None = None
    """In a group on CPU: the file the replicas' weights are mapped from (group.SharedWeights)."""


class BatchingRefused(Exception):
    """New batching settings the model cannot run with (its warm-up at the new batch sizes failed)."""


class ServedModel:
    """One pool's model (`name` in the API): `loaded` (what is served now) and `inference` (the engine serving it),
    both None until `load()` is done. `on_swap` runs on the event loop after each successful swap.
    `repository_root`: the directory load requests may name checkpoints under (None: none may be named).
    `batching`: the batching settings it runs with (the spec's until `update_batching`). `peers`: the pod's other
    server processes (group.py), which every swap and skipped candidate reaches too; only the group's leader follows
    a training job."""

    def __init__(self, spec: InferencePoolSpec, location: ModelLocation, *, name: str, follow_interval: float = 2.0,
                 on_swap: Callable[[], None] | None = None):
        self.spec = spec
        self.location = location
        self.name = name
        self.repository_root = model_loading.repository_root(spec.model_repository, location)
        self.follow_interval = follow_interval
        self.on_swap = on_swap
        self.batching = spec.batching
        self.batch_limits = {spec.batch_limit}
        """Every batch limit run with so far (the batch-size histogram keeps a bucket for each)."""
        job = spec.model.from_training_job
        self.promotion = job.promote if job is not None and location.directory is not None else None
        """fromTrainingJob.promote: the gate each followed checkpoint must pass (promotion.py)."""
        self.loaded: LoadedModel | None = None
        self.inference: ParallelInference | None = None
        self.skipped: tuple[str, Verdict] | None = None
        """The latest followed checkpoint the gate did not promote, and the gate's verdict on it."""
        self.refused: tuple[BatchingSettings, str] | None = None
        """The pool's batching settings the model failed its warm-up at, and the error (pool_watch.py), until it runs
        other settings."""
        self.peers: Peers | None = None
        self.weights: Path | None = None
        """In a group on CPU: the file the served replicas' weights are mapped from (group.SharedWeights)."""
        self._swap_lock = asyncio.Lock()
        self._prepared: tuple[Prepared, asyncio.TimerHandle] | None = None
        self._follower: asyncio.Task | None = None

    async def load(self) -> LoadedModel:
        """The first load: wait for a followed directory's first checkpoint, load the model, start and warm up
        ParallelInference on it; then follow the directory for new checkpoints when the pool says so."""
        loop = asyncio.get_running_loop()
        location = self.location
        joining = self.peers is not None and not self.peers.group.leader
        if joining:  # the leader's first model, weights included
            first, weights = await self.peers.weights.leaders_first()
        elif location.directory is not None and location.follow \
                and model_loading.checkpoint_to_serve(location) is None:
            log.info("waiting for the first checkpoint in %s", location.directory)
            while model_loading.checkpoint_to_serve(location) is None:
                await asyncio.sleep(self.follow_interval)
        started = time.perf_counter()
        if not joining:
            first = await loop.run_in_executor(None, self._best_checkpoint) if self.promotion is not None else None
        loaded = await loop.run_in_executor(None, self._load, first)
        built = time.perf_counter()
        self.inference = await loop.run_in_executor(None, self._start_inference, loaded)
        if joining:
            await self.peers.weights.map(self.inference.replicas, weights)
            self.weights = weights
        elif self.peers is not None:
            self.weights = await self.peers.weights.publish_first(loaded.checkpoint, self.inference.replicas)
        self.loaded = loaded
        log.info("loaded %s from %s in %s, warm-up %s", self.name, loaded.loaded_from, _seconds(built - started),
                 _seconds(time.perf_counter() - built))
        if location.directory is not None and location.follow and (self.peers is None or self.peers.group.leader):
            self._follower = asyncio.create_task(self._follow())
        return loaded

    async def swap(self, checkpoint: Path | None = None, cause: str = "load request") -> LoadedModel:
        """Load `checkpoint` (a file or a directory's latest; None: the location's current model), warm it up, and
        switch to it atomically. Requests keep being served by the old model until the switch and none fails.
        Raises ModelLoadError (the old model keeps serving). `cause` is for the log line.

        In a group the leader makes the swap for all: every process loads and warms up, then all switch, or none
        does when one fails; a process other than the leader asks the leader to."""
        self._check_loaded()
        if self.peers is not None and not self.peers.group.leader:
            await self.peers.leader.group_swap(checkpoint, cause)
            return self.loaded
        if checkpoint is not None and checkpoint.is_dir():
            checkpoint = model_loading.latest_or_load_error(checkpoint)
        if self.peers is None:
            return await self.swap_here(checkpoint, cause)
        peers = self.peers.others
        async with self.peers.lock, self._swap_lock:
            prepared = await self._prepare(checkpoint)
            weights = await self.peers.weights.publish(prepared.replicas)
            outcomes = await asyncio.gather(*(peer.prepare_swap(checkpoint, weights) for peer in peers),
                                            return_exceptions=True)
            if any(outcome is not None for outcome in outcomes):
                await asyncio.gather(*(peer.abandon_swap() for peer, outcome in zip(peers, outcomes, strict=True)
                                       if outcome is None), return_exceptions=True)
                self.peers.weights.discard(weights)
                raise next(error for error in outcomes if isinstance(error, BaseException))
            switched = await asyncio.gather(*(peer.commit_swap(cause) for peer in peers), return_exceptions=True)
            loaded = self._switch(dataclasses.replace(prepared, weights=weights), cause)
        for error in switched:
            if error is not None:
                log.error("the group's swap to %s is incomplete: %s", loaded.loaded_from, error)
        return loaded

    async def swap_here(self, checkpoint: Path | None, cause: str) -> LoadedModel:
        """`swap` in this process only (a file, or None)."""
        self._check_loaded()
        async with self._swap_lock:
            return self._switch(await self._prepare(checkpoint), cause)

    async def prepare_swap(self, checkpoint: Path | None, weights: Path | None) -> None:
        """A group swap's first half in this process, asked by the leader: load and warm up `checkpoint` (its weights
        mapped from the leader's `weights` file, if any), then hold it (and hold off other changes) until
        `commit_swap` or `abandon_swap`; abandoned after PREPARED_SECONDS."""
        self._check_loaded()
        await self._swap_lock.acquire()
        try:
            prepared = await self._prepare(checkpoint)
            await self.peers.weights.map(prepared.replicas, weights)
            prepared = dataclasses.replace(prepared, weights=weights)
        except BaseException:
            self._swap_lock.release()
            raise
        self._prepared = (prepared, asyncio.get_running_loop().call_later(PREPARED_SECONDS, self.abandon_swap))

    def commit_swap(self, cause: str) -> LoadedModel:
        """Switch to the model `prepare_swap` holds. Raises ModelLoadError when none is held."""
        if self._prepared is None:
            raise ModelLoadError("no swap is prepared (it was abandoned, or never asked for)")
        prepared = self._prepared[0]
        self.abandon_swap()
        return self._switch(prepared, cause)

    def abandon_swap(self) -> None:
        """Drop the model `prepare_swap` holds, if any."""
        if self._prepared is not None:
            self._prepared[1].cancel()
            self._prepared = None
            self._swap_lock.release()

    def _check_loaded(self) -> None:
        if self.inference is None or self.loaded is None:
            raise ModelLoadError("the server's first model is still loading")

    async def _prepare(self, checkpoint: Path | None) -> Prepared:
        loop = asyncio.get_running_loop()
        started = time.perf_counter()
        loaded = await loop.run_in_executor(None, self._load, checkpoint)
        model_loading.check_compatible(self.loaded.signature, loaded.signature, loaded.loaded_from)
        built = time.perf_counter()
        try:
            replicas = await loop.run_in_executor(None, self.inference.prepare, loaded.module)
        except Exception as error:  # warm-up of the new replicas failed: the old ones still serve
            raise ModelLoadError(f"the new model fails its warm-up: {type(error).__name__}: {error}") from error
        return Prepared(loaded, replicas, built - started, time.perf_counter() - built)

    def _switch(self, prepared: Prepared, cause: str) -> LoadedModel:
        self.inference.switch_to(prepared.replicas)
        previous, self.loaded = self.loaded, prepared.loaded
        retired, self.weights = self.weights, prepared.weights
        if self.peers is not None:
            self.peers.weights.discard(retired)
        if self.on_swap is not None:
            self.on_swap()
        log.info("swapped %s from %s to %s (%s): loaded in %s, warm-up %s", self.name, previous.loaded_from,
                 self.loaded.loaded_from, cause, _seconds(prepared.load_seconds), _seconds(prepared.warmup_seconds))
        return self.loaded

    async def update_batching(self, settings: BatchingSettings) -> None:
        """Run with `settings` from now on, without failing a request (ParallelInference.update; new batch sizes
        are warmed up first, on an executor thread). A request may then carry up to the new batch limit. Raises
        ModelLoadError while the first model loads, BatchingRefused (nothing changed) when the warm-up fails."""
        self._check_loaded()
        async with self._swap_lock:  # a swap loads with the batch limit, so never both at once
            try:
                await asyncio.get_running_loop().run_in_executor(None, lambda: self.inference.update(
                    batch_limit=settings.batch_limit, queue_limit=settings.queue_limit,
                    max_delay_us=settings.max_queue_delay_microseconds))
                if self.peers is not None:  # new batch sizes bring new replicas: map them again
                    await self.peers.weights.map(self.inference.replicas, self.weights)
            except Exception as error:  # the warm-up at the new batch sizes failed: nothing changed
                raise BatchingRefused(f"the model fails its warm-up at the new batch sizes: {type(error).__name__}: "
                                      f"{error}") from error
            previous, self.batching = self.batching, settings
            self.refused = None
            self.batch_limits.add(settings.batch_limit)
            self.loaded = _with_batch_limit(self.loaded, settings.batch_limit)
        log.info("batching of %s changed from %s to %s", self.name, previous.summary(), settings.summary())

    async def stop_following(self) -> None:
        follower, self._follower = self._follower, None
        await cancel_and_wait(follower)

    def refuse_requests(self) -> None:
        """Stop ParallelInference taking requests and fail the queued ones (ShutDownError), without waiting."""
        if self.inference is not None:
            self.inference.shutdown(drain=False, timeout=0)

    async def wait_for_workers(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for forwards still running (a forward cannot be interrupted)."""
        if self.inference is not None and timeout > 0:
            await asyncio.to_thread(self.inference.shutdown, drain=False, timeout=timeout)

    async def _follow(self) -> None:
        """Hot-swap each new checkpoint the training job writes (fromTrainingJob with follow). Only a checkpoint
        not seen before is loaded: one that fails is not retried, and a checkpoint loaded by hand through
        the repository API stays until the job writes a newer one. With a promotion gate, a new checkpoint is
        loaded only when its recorded metric beats the served one's (promotion.py); a skipped one is not judged
        again."""
        seen = self.loaded.checkpoint
        while True:
            await asyncio.sleep(self.follow_interval)
            latest = model_loading.checkpoint_to_serve(self.location)
            if latest is None or str(latest) == seen:
                continue
            seen = str(latest)
            try:
                cause = f"followed {self.location.directory}"
                if self.promotion is not None:
                    verdict = await self._judge(latest)
                    if not verdict.promote:
                        continue
                    cause = f"promoted: {verdict.reason}"
                await self.swap(latest, cause=cause)
            except Exception as error:  # anything: a follower that dies would stop following without a word
                reason = error if isinstance(error, ModelLoadError) else f"{type(error).__name__}: {error}"
                log.warning("not swapping %s to followed checkpoint %s, still serving %s: %s", self.name, latest,
                            self.loaded.loaded_from, reason)

    async def _judge(self, candidate: Path) -> Verdict:
        """The gate's verdict on a followed checkpoint; a skipped one is logged and kept for the status."""
        metrics = await asyncio.get_running_loop().run_in_executor(None, model_loading.checkpoint_metrics, candidate)
        verdict = promotion.judge(self.promotion, metrics, self.loaded.metrics)
        if not verdict.promote:
            self.record_skip(str(candidate), verdict)
            log.info("not promoting %s to %s, still serving %s: %s", self.name, candidate, self.loaded.loaded_from,
                     verdict.reason)
            if self.peers is not None:
                for error in await asyncio.gather(*(peer.record_skip(str(candidate), verdict)
                                                    for peer in self.peers.others), return_exceptions=True):
                    if error is not None:
                        log.warning("%s", error)
        return verdict

    def record_skip(self, checkpoint: str, verdict: Verdict) -> None:
        """The latest candidate the gate did not promote (this process's leader's verdict, in a group)."""
        self.skipped = (checkpoint, verdict)

    def record_refusal(self, settings: BatchingSettings, reason: str) -> None:
        """The pool's batching settings this process's group refused (its leader's outcome, in a group)."""
        self.refused = (settings, reason)

    def refusal_parameters(self) -> dict[str, str | int]:
        """For the model metadata's `parameters`, after a refusal of the pool's batching settings: those settings
        (`refused_batch_limit`, ...) and `refused_reason` (contract.REFUSED_BATCHING_PARAMETER); empty otherwise."""
        if self.refused is None:
            return {}
        settings, reason = self.refused
        prefix = REFUSED_BATCHING_PARAMETER
        return {**{f"{prefix}{name}": value for name, value in settings.model_dump().items()},
                f"{prefix}reason": reason}

    def _best_checkpoint(self) -> Path | None:
        """A gated server's first checkpoint: the best recorded in the directory (None: none has the metric, so the
        latest), so that a restart never brings back a checkpoint the gate had refused."""
        found = checkpoints.list_checkpoints(self.location.directory)
        chosen = promotion.best(self.promotion, ((str(p), model_loading.checkpoint_metrics(p)) for p in found))
        return Path(chosen) if chosen is not None else None

    def promotion_parameters(self) -> dict[str, str | float]:
        """For the model metadata's `parameters`, with a promotion gate: the latest candidate it skipped
        (`skipped_checkpoint`, `skipped_reason`, and `skipped_metric` when it has one); empty before any skip."""
        parameters: dict[str, str | float] = {}
        if self.skipped is not None:
            checkpoint, verdict = self.skipped
            parameters |= {"skipped_checkpoint": checkpoint, "skipped_reason": verdict.reason}
            if verdict.metric is not None:
                parameters["skipped_metric"] = verdict.metric
        return parameters

    def _load(self, checkpoint: Path | None) -> LoadedModel:
        """The first model, or (once one serves) a swap's, which must be built by the same code."""
        served = self.loaded.reference if self.loaded is not None else None
        return model_loading.load(self.location, self.spec.model, self.batching.batch_limit, checkpoint, served)

    def _start_inference(self, loaded: LoadedModel) -> ParallelInference:
        spec, batching = self.spec, self.batching
        return ParallelInference(
            loaded.module, mode=spec.inference_mode, workers=spec.workers_per_replica,
            batch_limit=batching.batch_limit, queue_limit=batching.queue_limit,
            max_delay_us=batching.max_queue_delay_microseconds, example=loaded.example)


def _with_batch_limit(loaded: LoadedModel, batch_limit: int) -> LoadedModel:
    return dataclasses.replace(loaded, signature=dataclasses.replace(loaded.signature, max_batch_size=batch_limit))



def _seconds(elapsed: float) -> str:
    return f"{elapsed:.2f} s"
