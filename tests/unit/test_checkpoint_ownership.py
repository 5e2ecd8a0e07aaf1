"""A checkpoint directory belongs to one run (worker/checkpoint_owner.py): how a run begins in one, who may write it,
and that `keepLast` and "latest" count only the run's own checkpoints; and what a resumed run says
(worker/train/trainer.py)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
import torch

from tandem.api.training import TrainerSpec
from tandem.examples.digits import mlp
from tandem.worker import checkpoint
from tandem.worker import checkpoint_owner as owner
from tandem.worker.train.state import Position
from tandem.worker.train.trainer import nothing_left, resuming_line

NOW = datetime(2026, 12, 3, 12, 0, tzinfo=UTC)
OLD = [f"step-{step:08d}.pt" for step in (2700, 2780, 2860)]
DIRECTORY = Path("/ck")


def run_record(run: str, checkpoints: list[str] = (), job: str = "digits", uid: str | None = None) -> owner.RunRecord:
    return owner.RunRecord(run=run, job=job, uid=uid, started=NOW, checkpoints=list(checkpoints))


FRESH = run_record("new")


@pytest.mark.parametrize(("name", "recorded", "present", "resume", "overwrite", "expected"), [
    ("empty directory, afresh", None, [], False, False, ("new", [], (), None)),
    ("empty directory, resume", None, [], True, False, ("new", [], (), None)),
    ("resume the recorded run: its id kept", run_record("old", OLD), OLD, True, False, ("old", OLD, (), None)),
    ("resume beside a stray file: not adopted", run_record("old", OLD[:1]), OLD, True, False,
     ("old", OLD[:1], (), None)),
    ("resume checkpoints written before runs were recorded: adopted", None, OLD, True, False,
     ("new", OLD, (), None)),
    ("the same job's run (a restarted rank 0): carried on", run_record("new", OLD), OLD, False, False,
     ("new", OLD, (), None)),
    ("afresh over a run that left no checkpoint", run_record("old"), [], False, False, ("new", [], (), None)),
    ("afresh, overwrite: set aside under the old run's id", run_record("old", OLD), OLD, False, True,
     ("new", [], tuple(OLD), "run-old")),
    ("afresh, overwrite, no record", None, OLD, False, True, ("new", [], tuple(OLD), "run-unrecorded")),
])
def test_how_a_run_begins_in_a_directory(name, recorded, present, resume, overwrite, expected):
    plan = owner.plan_directory(DIRECTORY, recorded, present, fresh=FRESH, resume=resume, overwrite=overwrite)
    assert (plan.run.run, plan.run.checkpoints, plan.set_aside, plan.aside_into) == expected, name


@pytest.mark.parametrize(("name", "recorded", "expected"), [
    ("recorded", run_record("old", OLD, job="long"), "run old of job long"),
    ("unrecorded", None, "a run that left no record"),
])
def test_afresh_among_another_runs_checkpoints_is_refused_naming_them_and_the_fix(name, recorded, expected):
    with pytest.raises(owner.OwnershipError) as refused:
        owner.plan_directory(DIRECTORY, recorded, OLD, fresh=FRESH, resume=False, overwrite=False)
    message = str(refused.value)
    assert f"spec.checkpoint.directory /ck holds another run's checkpoints ({expected}: " in message, name
    assert "step-00002700.pt, step-00002780.pt, step-00002860.pt (3 files)" in message
    for fix in ("another spec.checkpoint.directory", "delete them", "spec.checkpoint.overwrite: true",
                "spec.checkpoint.resume: true"):
        assert fix in message


@pytest.mark.parametrize(("names", "expected"), [
    (["step-00000001.pt"], "step-00000001.pt (1 file)"),
    ([f"step-{n:08d}.pt" for n in range(1, 8)], "step-00000001.pt, step-00000002.pt, step-00000003.pt, ..., "
                                                "step-00000007.pt (7 files)"),
])
def test_names_text(names, expected):
    assert owner.names_text(names) == expected


@pytest.mark.parametrize(("existing", "expected"), [
    (set(), "run-old"), ({"run-old"}, "run-old-2"), ({"run-old", "run-old-2"}, "run-old-3"),
])
def test_the_aside_directory_never_takes_an_existing_name(existing, expected):
    assert owner.aside_directory("old", existing) == expected


def lease(*, pid: int = 100, host: str = "vm", uid: str | None = None, renewed_ago: float = 0.0,
          namespace: str = "pid:[1]") -> owner.Lease:
    return owner.Lease(host=host, pid=pid, pid_namespace=namespace, run="r", job="j", uid=uid,
                       since=NOW - timedelta(hours=1), renewed=NOW - timedelta(seconds=renewed_ago))


ME = lease(pid=200)


STALE = owner.LEASE_STALE_SECONDS


@pytest.mark.parametrize(("name", "held", "me", "alive", "blocks"), [
    ("no lease", None, ME, True, False),
    ("my own", lease(pid=200), ME, True, False),
    ("another live process on this host", lease(), ME, True, True),
    ("its process gone on this host (or its pid another process's since)", lease(), ME, False, False),
    ("a live holder on this host not renewed for the stale time (stopped): kept", lease(renewed_ago=STALE + 1), ME,
     True, True),
    ("another host, not renewed for the stale time", lease(host="node-2", renewed_ago=STALE + 1), ME, True, False),
    ("another host, renewed just within the stale time", lease(host="node-2", renewed_ago=STALE), ME, False, True),
    ("another host: its pid means nothing here", lease(host="node-2"), ME, False, True),
    ("another pid namespace (a pod of the same name)", lease(namespace="pid:[2]"), ME, False, True),
    ("another pid namespace, not renewed for the stale time", lease(namespace="pid:[2]", renewed_ago=STALE + 1), ME,
     True, False),
    ("rank 0 of the same job, restarted (a new pod of the same name)", lease(host="p-0", uid="u1"),
     lease(host="p-0", uid="u1", namespace="pid:[2]"), True, False),
    ("rank 0 of another job of the same name", lease(host="p-0", uid="u1"),
     lease(host="p-0", uid="u2", namespace="pid:[2]"), True, True),
])
def test_who_may_take_the_lease(name, held, me, alive, blocks):
    assert owner.lease_blocks(held, me, NOW, alive=lambda holder: alive) is blocks, name


def this_process_lease(**changes) -> owner.Lease:
    return owner.this_process("r", "j", None).model_copy(update=changes)


@pytest.mark.parametrize(("name", "held", "alive"), [
    ("this process", this_process_lease(), True),
    ("this pid, started at another time: a later process given the holder's pid", "started later", False),
    ("a lease without a start time (written before they were recorded)", this_process_lease(pid_started=None), True),
    ("a pid no process has", this_process_lease(pid=2 ** 22 + 1), False),
])
def test_whether_the_holder_on_this_host_is_alive(name, held, alive):
    if held == "started later":
        held = this_process_lease(pid_started=owner.process_started(os.getpid()) + 1)
    assert owner.holder_alive(held) is alive, name


def test_a_process_start_time_is_read_past_a_command_name_with_spaces_and_parentheses(tmp_path):
    odd = tmp_path / "a) b (c"
    odd.symlink_to(sys.executable)
    child = subprocess.Popen([str(odd), "-c", "import time; time.sleep(30)"])
    try:
        started = owner.process_started(child.pid)
        assert isinstance(started, int) and started >= owner.process_started(os.getpid())
    finally:
        child.kill()
        child.wait()
    assert owner.process_started(child.pid) is None


def holding_process(directory: Path) -> subprocess.Popen:
    """Another process of this host holding `directory`'s lease (run first, job long) until killed."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; from tandem.worker import checkpoint_owner "
         "as o; o.take_lease(Path(sys.argv[1]), o.this_process('first', 'long', None)); print('held', flush=True); "
         "time.sleep(120)", str(directory)], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline() == "held\n"
    return holder


def test_a_stopped_holder_on_this_host_keeps_its_lease_past_the_stale_time(tmp_path, monkeypatch):
    holder = holding_process(tmp_path)
    try:
        os.kill(holder.pid, signal.SIGSTOP)
        later = owner.now() + timedelta(seconds=10 * STALE)
        monkeypatch.setattr(owner, "now", lambda: later)
        second = owner.this_process("second", "long", None)
        with pytest.raises(owner.OwnershipError,
                           match=rf"held by pid {holder.pid} on host \S+ \(run first, job long\)"):
            owner.take_lease(tmp_path, second)
        held = owner.read_lease(tmp_path)
        assert held.pid_started == owner.process_started(holder.pid)
        # The same pid with another start time is a later process given the holder's pid: the holder is gone.
        reused = held.model_copy(update={"pid_started": held.pid_started - 1})
        (tmp_path / owner.LEASE_FILE).write_text(reused.to_json())
        owner.take_lease(tmp_path, second).release()
    finally:
        holder.kill()
        holder.wait()


def test_a_held_lease_refuses_a_second_writer_naming_the_holder_and_is_released(tmp_path):
    keeper = owner.take_lease(tmp_path, owner.this_process("first", "long", None))
    second = owner.this_process("second", "long", None).model_copy(update={"pid": keeper.lease.pid + 1})
    try:
        with pytest.raises(owner.OwnershipError, match=rf"in use by another run: held by pid {keeper.lease.pid} on "
                                                       r"host \S+ \(run first, job long\) since .* renewed \d+ s ago"):
            owner.take_lease(tmp_path, second)
    finally:
        keeper.release()
    assert not (tmp_path / owner.LEASE_FILE).exists()
    owner.take_lease(tmp_path, second).release()


def save(directory: Path, step: int, *, keep_last: int = 2, run: str | None = None,
         holder: owner.Lease | None = None) -> Path:
    manifest = checkpoint.build_manifest(model="tandem.examples.digits:mlp", model_args={"hidden": 8}, step=step,
                                         run=run)
    return checkpoint.save(directory, {"manifest": manifest, "model": mlp(hidden=8).state_dict()}, step=step,
                           keep_last=keep_last, run=run, holder=holder)


def test_keep_last_and_latest_count_only_the_runs_own_checkpoints(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    for name in OLD:  # another run's files, left beside this run's (resume over them keeps them)
        save(old, int(name[5:13]), keep_last=5)
        (tmp_path / name).write_bytes((old / name).read_bytes())
    owner.write_run(tmp_path, run_record("mine"))
    for step in (10, 20, 30):
        save(tmp_path, step, run="mine")
    assert owner.read_run(tmp_path).checkpoints == ["step-00000020.pt", "step-00000030.pt"]
    assert checkpoint.latest(tmp_path).name == "step-00000030.pt"
    assert all((tmp_path / name).read_bytes() == (old / name).read_bytes() for name in OLD)
    assert checkpoint.load(checkpoint.latest(tmp_path))["manifest"]["run"] == "mine"


def test_a_checkpoint_is_refused_once_the_directory_is_another_runs(tmp_path):
    owner.write_run(tmp_path, run_record("theirs"))
    with pytest.raises(checkpoint.CheckpointError, match=r"now belongs to run theirs .* not writing step-00000010"):
        save(tmp_path, 10, run="mine")
    with pytest.raises(checkpoint.CheckpointError, match="holds the checkpoints of run theirs"):
        save(tmp_path, 10)
    assert not list(tmp_path.glob("step-*"))


WRITER = lease(host="node-1", pid=300)


@pytest.mark.parametrize(("name", "held_now", "record_now", "refused"), [
    ("still its lease", WRITER, "mine", None),
    ("its lease renewed, naming its run", WRITER.model_copy(update={"renewed": NOW, "run": "mine"}), "mine", None),
    ("taken over from another host, resuming the same run", lease(host="node-2", pid=300), "mine",
     "lost the directory's lease (now held by pid 300 on host node-2 (run r, job j)"),
    ("taken over by the same process again later", WRITER.model_copy(update={"since": NOW}), "mine",
     "lost the directory's lease"),
    ("taken over, starting another run", lease(host="node-2"), "theirs", "lost the directory's lease"),
    ("its lease gone", None, "mine", "lost the directory's lease (gone)"),
])
def test_a_writer_that_lost_its_lease_finds_out_before_writing(tmp_path, name, held_now, record_now, refused):
    """A writer stopped (or cut off) for longer than the stale time, seen from another host, loses its lease; one
    that then carries on finds out at its next checkpoint, even where the new holder resumed the same run."""
    owner.write_run(tmp_path, run_record("mine"))
    (tmp_path / owner.LEASE_FILE).write_text(WRITER.to_json())
    save(tmp_path, 10, run="mine", holder=WRITER)
    if held_now is None:
        (tmp_path / owner.LEASE_FILE).unlink()
    else:
        (tmp_path / owner.LEASE_FILE).write_text(held_now.to_json())
    if record_now != "mine":
        owner.write_run(tmp_path, run_record(record_now))
    if refused is None:
        save(tmp_path, 20, run="mine", holder=WRITER)
        assert owner.read_run(tmp_path).checkpoints[-1] == "step-00000020.pt", name
        return
    with pytest.raises(checkpoint.CheckpointError, match=re.escape(refused) + ".*not writing step-00000020.pt"):
        save(tmp_path, 20, run="mine", holder=WRITER)
    assert not (tmp_path / "step-00000020.pt").exists(), name


def test_a_directory_without_a_record_is_one_run_as_before(tmp_path):
    for step in (10, 20, 30):
        save(tmp_path, step)
    assert [p.name for p in checkpoint.list_checkpoints(tmp_path)] == ["step-00000020.pt", "step-00000030.pt"]
    assert checkpoint.latest(tmp_path).name == "step-00000030.pt"


def test_moving_aside_keeps_every_byte_and_the_old_record(tmp_path):
    for step in (2700, 2860):
        save(tmp_path, step, keep_last=5)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    owner.write_run(tmp_path, run_record("old", [*before]))
    plan = owner.prepare(tmp_path, fresh=FRESH, resume=False, overwrite=True)
    owner.apply_plan(tmp_path, plan)
    aside = tmp_path / "run-old"
    assert {name: (aside / name).read_bytes() for name in before} == before
    assert owner.read_run(aside).run == "old" and owner.read_run(tmp_path) == FRESH
    assert checkpoint.latest(tmp_path) is None


TRAINER = TrainerSpec(model="tandem.examples.digits:mlp", data="tandem.examples.digits:train_data", epochs=10)
SOURCE = Path("/ck/step-00000230.pt")


@pytest.mark.parametrize(("name", "position", "trainer", "total", "expected"), [
    ("steps remain", Position(step=120, epoch=5, batches_done=5), TRAINER, 230, None),
    ("complete", Position(step=230, epoch=10), TRAINER, 230, "already complete: step-00000230.pt is at step 230 of "
                                                             "230, the job's last"),
    ("complete at maxSteps", Position(step=50, epoch=2, batches_done=4), TRAINER.model_copy(update={"max_steps": 50}),
     50, "already complete: step-00000230.pt is at step 50 of 50"),
    ("epochs lowered below it", Position(step=2860, epoch=124), TRAINER, 2860,
     "step-00000230.pt is at step 2860 (epoch 124), past this job's end (trainer.epochs: 10): nothing to train, "
     "its checkpoints left as they are. Raise trainer.epochs to train on from it"),
    ("epochs lowered into it", Position(step=2850, epoch=10, batches_done=3), TRAINER, 2850,
     "past this job's end (trainer.epochs: 10)"),
    ("epochs lowered into it, resumed there at another size", Position(step=2850, epoch=10, epoch_start=40),
     TRAINER, 2850, "is at step 2850 (epoch 11), past this job's end (trainer.epochs: 10)"),
    ("maxSteps lowered below it", Position(step=80, epoch=3, batches_done=11),
     TRAINER.model_copy(update={"max_steps": 50}), 50, "past this job's end (trainer.maxSteps: 50)"),
])
def test_what_a_resumed_run_with_nothing_to_train_says(name, position, trainer, total, expected):
    said = nothing_left(SOURCE, position, trainer, total)
    if expected is None:
        assert said is None, name
    else:
        assert expected in said, name
        assert "another checkpoint.directory" in said


def test_the_resume_line():
    assert resuming_line(SOURCE, Position(step=120), 230) == "resuming from step-00000230.pt (step 120 of 230)"


def test_the_manifest_records_the_run(tmp_path):
    owner.write_run(tmp_path, run_record("mine"))
    path = save(tmp_path, 1, run="mine")
    assert torch.load(path, weights_only=True)["manifest"]["run"] == "mine"


def test_the_holder_renews_its_lease_until_released(tmp_path, monkeypatch):
    me = owner.this_process("mine", "long", None)
    monkeypatch.setattr(owner, "LEASE_RENEW_SECONDS", 0.01)
    keeper = owner.take_lease(tmp_path, me)
    monkeypatch.setattr(owner, "now", lambda: me.renewed + timedelta(days=1))
    try:
        deadline = datetime.now(UTC) + timedelta(seconds=10)
        while owner.read_lease(tmp_path).renewed != me.renewed + timedelta(days=1):
            assert datetime.now(UTC) < deadline, "never renewed"
    finally:
        keeper.release()
    assert not (tmp_path / owner.LEASE_FILE).exists()


def test_a_run_refused_before_it_started_leaves_no_directory_behind(tmp_path):
    directory = tmp_path / "new" / "checkpoints"
    owner.take_lease(directory, owner.this_process("mine", "long", None)).release()
    assert not directory.exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    owner.take_lease(kept, owner.this_process("mine", "long", None)).release()
    assert kept.is_dir()


def second_writer(directory: Path) -> str:
    """What another process of this host is told when it asks for `directory`'s lease."""
    return subprocess.run(
        [sys.executable, "-c", "import sys; from pathlib import Path; from tandem.worker import checkpoint_owner as o\n"
         "try:\n    o.take_lease(Path(sys.argv[1]), o.this_process('second', 'long', None)).release()\n"
         "    print('taken')\nexcept o.OwnershipError as error:\n    print(error)", str(directory)],
        capture_output=True, text=True, check=True).stdout.strip()


def test_a_parallel_wrapper_holds_its_checkpoint_directory_while_its_ranks_train(tmp_path, monkeypatch):
    """ParallelWrapper.fit takes the lease and records its run before any rank starts, as `tandem run`'s launcher
    does: refused while another process holds the directory; holding it, another writer is refused; released after."""
    from tandem import ParallelWrapper
    from tandem.examples.digits import train_data
    from tandem.worker.train import wrapper as wrapper_module

    holder = holding_process(tmp_path)
    try:
        with ParallelWrapper(mlp(hidden=8), workers=1, checkpoint_dir=tmp_path, show_progress=False) as wrapper, \
                pytest.raises(owner.OwnershipError, match=rf"held by pid {holder.pid} .*\(run first, job long\)"):
            wrapper.fit(train_data())
    finally:
        holder.kill()
        holder.wait()

    seen = {}

    def ranks(function, args, nprocs, join, start_method):  # in place of the spawned ranks: what they would find
        seen.update(lease=owner.read_lease(tmp_path), record=owner.read_run(tmp_path), run=args[-2], holder=args[-1],
                    second=second_writer(tmp_path))
        raise RuntimeError("the ranks failed")

    monkeypatch.setattr(wrapper_module.mp, "start_processes", ranks)
    assert owner.read_lease(tmp_path).pid == holder.pid  # the killed holder's, taken over: its process is gone
    with ParallelWrapper(mlp(hidden=8), workers=1, checkpoint_dir=tmp_path, show_progress=False) as wrapper, \
            pytest.raises(RuntimeError, match="the ranks failed"):
        wrapper.fit(train_data())
    assert (seen["lease"].pid, seen["lease"].job, seen["lease"].run) == (os.getpid(), "ParallelWrapper", seen["run"])
    assert seen["holder"].holding == seen["lease"].holding  # what rank 0 writes under
    assert (seen["record"].run, seen["record"].job) == (wrapper.run.run, "ParallelWrapper") == (seen["run"],
                                                                                                "ParallelWrapper")
    assert seen["second"].startswith(f"spec.checkpoint.directory {tmp_path} is in use by another run: held by pid "
                                     f"{os.getpid()} ")
    assert not (tmp_path / owner.LEASE_FILE).exists()
    assert second_writer(tmp_path) == "taken"


class Execed(Exception):
    """In place of exec: the command a rank would have replaced itself with."""


@pytest.mark.parametrize(("name", "rank", "run_id", "held", "execs"), [
    ("rank 0 on a cluster, the directory free: checked, let go, the command runs", 0, None, False, True),
    ("rank 0 on a cluster, another run holding the directory: refused", 0, None, True, False),
    ("under tandem run: its launcher holds the directory", 0, "launchers-run", True, True),
    ("rank 1: rank 0 checks", 1, None, True, True),
])
def test_a_custom_commands_rank_0_refuses_a_directory_another_run_holds(tmp_path, monkeypatch, name, rank, run_id,
                                                                        held, execs):
    from tandem.api import ParallelTrainingJob
    from tandem.contract import WorkerContract
    from tandem.worker.train import entrypoint

    def exec_command(program, argv):
        raise Execed(argv)

    monkeypatch.setattr(entrypoint.os, "execvp", exec_command)
    monkeypatch.setattr(owner, "LEASE_STALE_SECONDS", 0.5)  # how long rank 0 waits for a holder: 1 s here
    monkeypatch.setattr(owner, "LEASE_RENEW_SECONDS", 0.5)
    directory = tmp_path / "custom"
    job = ParallelTrainingJob.model_validate({
        "apiVersion": "tandem.dev/v1alpha1", "kind": "ParallelTrainingJob", "metadata": {"name": "mine"},
        "spec": {"trainingMode": "custom", "custom": {"command": [sys.executable, "-c", "pass"]},
                 "trainer": {"model": "tandem.examples.digits:mlp", "data": "tandem.examples.digits:train_data"},
                 "checkpoint": {"directory": str(directory)}}})
    env = WorkerContract.local(rank, 2, job="mine", checkpoint_dir=directory, run_id=run_id, job_uid="uid-mine")
    holder = holding_process(directory) if held else None
    try:
        if execs:
            with pytest.raises(Execed):
                entrypoint.run_custom(env, job)
        else:
            with pytest.raises(owner.OwnershipError, match=rf"{directory} is in use by another run: held by pid "
                                                           rf"{holder.pid} .*\(run first, job long\)") as refused:
                entrypoint.run_custom(env, job)
            assert refused.value.reason == "CheckpointDirectoryTaken"
        lease = owner.read_lease(directory) if directory.exists() else None
        assert lease is None if holder is None else lease.pid == holder.pid, name
        assert directory.exists() is held, "a directory the check created is removed again"
    finally:
        if holder is not None:
            holder.kill()
            holder.wait()
