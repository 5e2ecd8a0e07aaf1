"""What `tandem run` prints when the job ends: a few lines for the person who ran it (how far it got, the final loss and
evaluation, the checkpoint, where its curves are, and the `tandem serve` command that serves it). The full status, the
object a cluster keeps in the job's `.status`, stays one flag away: `-o json` prints it instead, `--status-out FILE`
writes it too.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path

import yaml

from tandem import curves
from tandem.api import ParallelTrainingJob, ParallelTrainingJobStatus
from tandem.columns import four_figures, human_duration

METRIC_NAMES = {"evalLoss": "loss"}
SKIPPED_STEPS = "skippedSteps"
"""Not an evaluation's: the steps skipped for a NaN/Inf loss or gradient (shown on the first line)."""
POOL_PLACEHOLDER = "POOL.yaml"


def summary_lines(job: ParallelTrainingJob, status: ParallelTrainingJobStatus, manifest: Path) -> list[str]:
    """The end of `tandem run` for a person: the job's manifest at `manifest`, its final status `status`."""
    lines = [f"{job.metadata.name}: {status.phase}{took(status)}: {how_far(status)}"]
    metrics = sorted(((name, value) for name, value in status.metrics.items() if name != SKIPPED_STEPS),
                     key=lambda item: item[0] != "accuracy")  # accuracy first
    if metrics:
        lines.append("  eval: " + ", ".join(f"{METRIC_NAMES.get(name, name)} {four_figures(value)}"
                                            for name, value in metrics))
    if status.checkpoint.latest:
        lines.append(f"  checkpoint: {shown(Path(status.checkpoint.latest))}")
    directory = Path(job.spec.checkpoint.directory)
    if (directory / curves.DIRECTORY).is_dir():
        lines.append(f"  curves: tandem plot {shown(directory)}")
        lines.append(f"          tensorboard --logdir {shown(directory / curves.DIRECTORY)}")
    if status.phase == "Succeeded" and status.checkpoint.latest:
        pool = pool_manifest(job.metadata.name, manifest.parent)
        lines.append(f"  serve it: {serve_command(pool, Path(status.checkpoint.latest))}")
        if pool is None:
            lines.append(f"    ({POOL_PLACEHOLDER}: an InferencePool manifest for this model, as "
                         "examples/digits-pool.yaml)")
    elif status.phase == "Suspended" and status.checkpoint.latest and job.spec.checkpoint.resume:
        lines.append("  run the same command again to resume from it")
    return lines


def took(status: ParallelTrainingJobStatus) -> str:
    if status.start_time is None or status.completion_time is None:
        return ""
    return f" in {human_duration((status.completion_time - status.start_time).total_seconds())}"


def how_far(status: ParallelTrainingJobStatus) -> str:
    progress = status.progress
    if not progress.total_steps:  # no step reported: a custom command's job, or one that ended before training
        return status.message or "no step reported"
    text = f"step {progress.step}/{progress.total_steps} (epoch {progress.epoch})"
    if progress.loss is not None:
        text += f", loss {four_figures(progress.loss)}"
    if status.metrics.get(SKIPPED_STEPS):
        text += f", {status.metrics[SKIPPED_STEPS]:.0f} steps skipped (NaN/Inf)"
    if status.restarts:
        text += f", {status.restarts} restart{'s' if status.restarts != 1 else ''}"
    return text


def serve_command(pool: Path | None, checkpoint: Path) -> str:
    manifest = shown(pool) if pool is not None else POOL_PLACEHOLDER
    return f"tandem serve {manifest} --checkpoint {shown(checkpoint)}"


def shown(path: Path) -> str:
    """`path` as a shell would take it: relative to the working directory when it is below it."""
    path = path.absolute()
    try:
        text = str(path.relative_to(Path.cwd()))
    except ValueError:
        text = str(path)
    return shlex.quote(text)


def pool_manifest(job: str, directory: Path) -> Path | None:
    """An InferencePool manifest in `directory` whose model comes from the training job `job` (`fromTrainingJob`),
    if one is there: the pool that serves what the job trains."""
    for path in sorted([*directory.glob("*.yaml"), *directory.glob("*.yml")]):
        try:
            documents = list(yaml.safe_load_all(path.read_text()))
        except (OSError, yaml.YAMLError):
            continue
        for document in documents:
            if isinstance(document, dict) and document.get("kind") == "InferencePool" \
                    and source_job(document) == job:
                return path
    return None


def source_job(pool: dict) -> str | None:
    """The training job a pool's manifest serves (`spec.model.fromTrainingJob.name`), read leniently: the file is
    only looked at, not judged."""
    found = pool
    for key in ("spec", "model", "fromTrainingJob", "name"):
        found = found.get(key) if isinstance(found, dict) else None
    return found if isinstance(found, str) else None


@dataclass(frozen=True)
class Ending:
    """Where `tandem run` puts the final status: on stdout a person's summary, or the status as JSON (`output`
    "json"); and as JSON at `status_out` if given. `manifest`: the job's file."""

    manifest: Path
    output: str = "summary"
    status_out: str | None = None

    def show(self, job: ParallelTrainingJob, status: ParallelTrainingJobStatus, *, summary: bool = True) -> None:
        """`summary`: False when the summary would only repeat the line already on stderr (a job refused before
        it started)."""
        text = json.dumps(status.to_dict(), indent=2)
        if self.output == "json":
            print(text)
        elif summary:
            print("\n".join(summary_lines(job, status, self.manifest)))
        if self.status_out:
            Path(self.status_out).write_text(text + "\n")
