"""A training run's curves: the TensorBoard scalars rank 0 writes (worker/train/scalars.py), their names and where
they go, read back, and `tandem plot`'s picture of them (loss and eval accuracy against the step).

Reading goes through TensorBoard's own EventAccumulator (a run resumed or restarted from an earlier step hides what
it wrote past that step, as TensorBoard shows it); drawing through matplotlib's Agg canvas (no display needed).
"""

from __future__ import annotations

from pathlib import Path

DIRECTORY = "tensorboard"
"""Where the runs' event files go in a checkpoint directory: one folder per run, `tensorboard/<run>`."""

LOSS = "train/loss"
LEARNING_RATE = "train/lr"
SAMPLES_PER_SECOND = "train/samples_per_second"
BYTES_RATIO = "communication/bytes_ratio"
EVAL_LOSS = "eval/loss"
ACCURACY = "eval/accuracy"
EVAL_TAGS = {"evalLoss": EVAL_LOSS, "accuracy": ACCURACY}
"""An evaluation metric's tag (evaluation.py's names); any other metric is `eval/<name>`."""

EVENT_FILE_PREFIX = "events.out.tfevents."

Series = list[tuple[int, float]]
"""(step, value), in step order."""


class NoCurves(ValueError):
    """The directory holds no event files, or none with a curve to draw."""


def run_folders(directory: Path) -> list[Path]:
    """The folders under `directory` (itself included) that hold event files: one per run, sorted."""
    if not directory.is_dir():
        raise NoCurves(f"{directory}: no such directory")
    folders = sorted({file.parent for file in directory.rglob(f"{EVENT_FILE_PREFIX}*") if file.is_file()})
    if not folders:
        raise NoCurves(
            f"{directory}: no TensorBoard event files ({EVENT_FILE_PREFIX}*) in it or below it. Rank 0 writes them "
            f"while it trains, under the checkpoint directory's {DIRECTORY}/ folder: give that, or the checkpoint "
            f"directory (spec.checkpoint.directory)")
    return folders


def read_scalars(folder: Path) -> dict[str, Series]:
    """Every scalar series of the run in `folder`, by tag."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    events = EventAccumulator(str(folder), size_guidance={SCALARS: 0})  # 0: keep every point
    events.Reload()
    return {tag: [(event.step, event.value) for event in events.Scalars(tag)] for tag in events.Tags()[SCALARS]}


def plot(directory: Path, out: Path) -> dict[str, dict[str, Series]]:
    """Draw the loss (training's, and the evaluation's at checkpoints) and the eval accuracy of each run under
    `directory` against the step, as a PNG at `out`. Returns what was drawn: the runs' series by run, by tag."""
    folders = run_folders(directory)
    drawn = {}
    for folder in folders:
        scalars = read_scalars(folder)
        series = {tag: scalars[tag] for tag in (LOSS, EVAL_LOSS, ACCURACY) if scalars.get(tag)}
        if series:
            drawn[run_name(folder, directory)] = series
    if not drawn:
        raise NoCurves(f"{directory}: its event files hold no loss or eval accuracy yet (the loss is written every "
                       f"few steps, the evaluation at each checkpoint)")
    draw(drawn, out, title=str(directory))
    return drawn


def run_name(folder: Path, directory: Path) -> str:
    return str(folder.relative_to(directory)) if folder != directory else folder.name


def draw(runs: dict[str, dict[str, Series]], out: Path, *, title: str) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global state, no display

    has_accuracy = any(ACCURACY in series for series in runs.values())
    figure = Figure(figsize=(10 if has_accuracy else 6, 4), layout="constrained")
    figure.suptitle(title)
    loss_axes, *rest = figure.subplots(1, 2 if has_accuracy else 1, squeeze=False)[0]
    labelled = len(runs) > 1
    for index, (run, series) in enumerate(runs.items()):
        color = f"C{index}"
        prefix = f"{run}: " if labelled else ""
        if LOSS in series:
            loss_axes.plot(*zip(*series[LOSS], strict=True), color=color, label=f"{prefix}training")
        if EVAL_LOSS in series:
            loss_axes.plot(*zip(*series[EVAL_LOSS], strict=True), color=color, linestyle="--", marker="o",
                           label=f"{prefix}eval")
        if ACCURACY in series:
            rest[0].plot(*zip(*series[ACCURACY], strict=True), color=color, marker="o", label=run)
    loss_axes.set(title="loss", xlabel="step")
    loss_axes.legend()
    loss_axes.grid(alpha=0.3)
    if rest:
        rest[0].set(title="eval accuracy", xlabel="step")
        rest[0].grid(alpha=0.3)
        if labelled:
            rest[0].legend()
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, format="png", dpi=100)
