"""Serving borrows training's GPUs (issue 39, spec.elastic.lendTo): one episode of quiet, a load spike against an
InferencePool and quiet again, run twice in one invocation on the same GPUs, side by side:

- trade: the job has `workers: GPUS-1`, `elastic: {minWorkers: GPUS-PEAK, lendTo: {poolSelector: the pool,
  stabilizationWindowSeconds: --window}}`, the pool 1 replica. At the spike the pool is scaled to PEAK (2): its new
  replica is Pending (`Insufficient nvidia.com/gpu`), the job lends a worker (a rank leaves at a step boundary) and
  the replica comes up on the freed GPU; after the spike the pool is scaled back to 1 and, once the window has
  passed, the job takes its worker back (a rank joins at a step boundary).
- static: the split a team would provision for the peak with no trade: the pool PEAK replicas for the whole episode,
  the job the GPUs left (`workers: GPUS-PEAK`, the same elastic spec without lendTo). Nobody scales anything.

    .venv/bin/python bench/bench_capacity.py                 # 4 GPUs, 20 s quiet, 40 s spike, 40 s quiet: ~4 min
    .venv/bin/python bench/bench_capacity.py --lead 10       # the trade's scale-up 10 s before the spike starts
    .venv/bin/python bench/bench_capacity.py --p99-bound-ms 120 --spike 60
    .venv/bin/python bench/bench_capacity.py --workdir /tmp/capacity   # keep the operator's and pods' logs

Needs wrk (Debian: `apt-get install wrk`); without it the benchmark exits saying so (no Python fallback: a Python
client on these 2 cores would take the servers' CPU).

Measured, per arm, over the episode (from the spike schedule's t0 to its end):
- training samples: the examples of every training forward the ranks ran in the episode (the model's forward log,
  bench/capacity_model.py); the steps are those over the global batch (elastic batch global: the same at every
  size), beside status.progress.step's advance over the episode (rank 0 reports it every few seconds: its edges
  lag).
- steps lost: for each regroup in the episode (every version of status.lastRecovery, from the emulator's history),
  stoppedAtStep - resumedAtStep (goal 0), and status.restarts over the episode.
- the pool under wrk: p99 latency (merged over every wrk run of the period) and failed requests (non-2xx, connect,
  read, write errors and timeouts) in each period: the quiet before, the spike (and its part served by 1 ready
  replica and by 2), the quiet after.
- trade: seconds from the scale-up request to the operator's loan (status.lent), the rank's pod deleted, rank 0's
  first forward in the smaller group (the forward log), the new server pod placed and Ready (the API polled every
  POLL s); from the scale-down to the loan's end and rank 0's first forward in the full group again.
Then the ratios trade / static and the p99 bound: by default 1.5x the static arm's p99 through the spike (the trade
may answer at most 50% slower at the 99th percentile than a pool provisioned for the peak); --p99-bound-ms fixes it.

Emulated (devcluster/), so read the figures as the trade's mechanics and costs, not a GPU cluster's:
- GPUs: one node advertising --gpus `nvidia.com/gpu`, counted by the emulated scheduler as kube-scheduler does; each
  rank pod and each server pod asks for one. No device exists: every process runs on this machine's 2 CPU cores.
- A GPU's speed: the models sleep for the time a GPU would spend (capacity_model.py): a training forward
  --example-ms per example (with elastic batch global, fewer ranks take more examples each, so the job's samples a
  second follow its ranks), a serving forward --forward-ms + --row-ms per row (one forward at a time a replica,
  batchLimit 8), so that what each side can do is set by the GPUs it holds and not by the shared cores. A step's
  CPU work (the exchange, the optimizer, the status) is not emulated away, so the measured samples fall short of
  the GPU time alone, which is printed beside them (rank-seconds x 1000 / --example-ms).
- The pool's autoscaler: played by the benchmark on the schedule (its /scale subresource, as an HPA writes it; no
  HPA controller runs in devcluster), up to PEAK --lead seconds before the spike starts, back to 1 at its end.
- The Service: it has no virtual IP here, so its balancing is played too: every --segment seconds wrk is started
  afresh against each ready endpoint (devcluster's Endpoints: ready pods, not terminating), the period's
  connections spread evenly over them (kube-proxy picks an endpoint per connection). A replica that becomes Ready
  gets connections from the next segment on; a pod being deleted keeps its segment's connections to the end of it.
- The load: wrk (C, keep-alive, one thread a run), a closed loop: each connection sends its next request when the
  previous one is answered (--quiet-connections, then --connections through the spike); a slower pool is sent fewer
  requests, so the served req/s are printed beside the latencies. wrk's Lua API gives percentiles, not its
  histogram, so each run reports its latency at every 0.1 percentile (bench/wrk_capacity.lua) and a period's p99 is
  read off the merged quantiles (each a thousandth of its run's requests).
- Pods are local processes: no image pull, warm page caches (a server's start is torch's import, the model's load
  and warm-up), one node, and the operator, API emulator, ranks, servers and wrk share 2 cores.
- stabilizationWindowSeconds is --window (10 s), not the default 300 s, to fit the episode.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BENCH = ROOT / "bench"
sys.path[:0] = [str(ROOT / "tests"), str(ROOT), str(BENCH)]

from bench_inference import wrk_body  # noqa: E402
from bench_regroup import forwards  # noqa: E402
from operator_runs import (  # noqa: E402
    GPU,
    GROUP,
    JOBS,
    NS,
    POOLS,
    READY,
    STARTUP,
    VERSION,
    job_pods,
    pool_manifest,
    scale,
    server_pods,
    start_operator,
    status,
)
from operator_runs import events as reasons  # noqa: E402

from devcluster import Cluster  # noqa: E402
from devcluster.deployments import is_ready  # noqa: E402

JOB, POOL, LABELS = "trainer", "online", {"tier": "online"}
BASE, PEAK = 1, 2  # the pool's replicas when quiet, and at the spike
BATCH_SIZE = 16  # batchSizePerWorker
BATCH_LIMIT = 8  # the pool's batchLimit
POLL = 0.25  # seconds between the benchmark's looks at the API
WARM = 5.0  # seconds the job trains at full size before the episode begins
ARMS = ("static", "trade")


# -- the objects ----------------------------------------------------------------------------------------------------
def job_manifest(workers: int, min_workers: int, lend: bool, log: Path, args: argparse.Namespace) -> dict:
    elastic = {"minWorkers": min_workers, "recovery": "regroup"}
    if lend:
        elastic["lendTo"] = {"poolSelector": {"matchLabels": LABELS}, "stabilizationWindowSeconds": args.window}
    return {"apiVersion": f"{GROUP}/{VERSION}", "kind": "ParallelTrainingJob", "metadata": {"name": JOB},
            "spec": {"workers": workers, "gpusPerWorker": 1, "elastic": elastic,
                     "trainer": {"model": "capacity_model:paced_logged_mlp",
                                 "modelArgs": {"log": str(log), "seconds_per_example": args.example_ms / 1000},
                                 "data": "tandem.examples.digits:train_data", "epochs": 5000,
                                 "batchSizePerWorker": BATCH_SIZE},
                     "checkpoint": {"directory": JOB}}}


def pool(replicas: int, args: argparse.Namespace) -> dict:
    document = pool_manifest(POOL, {"callable": "capacity_model:paced_mlp", "inputShape": [64], "name": "digits",
                                    "args": {"seconds": args.forward_ms / 1000,
                                             "seconds_per_row": args.row_ms / 1000}},
                             replicas=replicas, gpusPerReplica=1)
    document["spec"]["batchLimit"] = BATCH_LIMIT
    document["metadata"]["labels"] = LABELS
    return document


# -- the load: wrk against the ready endpoints, a segment at a time -------------------------------------------------
@dataclass
class Run:
    """One wrk run against one endpoint."""

    requests: int
    failed: int
    quantiles_us: list[float]


@dataclass
class Segment:
    period: str
    start: float
    end: float
    endpoints: int
    runs: list[Run]


@dataclass(frozen=True)
class Period:
    name: str
    seconds: int
    connections: int


def wrk_run(host: str, connections: int, seconds: int, body: Path) -> subprocess.Popen:
    return subprocess.Popen(["wrk", "-t1", f"-c{connections}", f"-d{seconds}s", "-s", str(BENCH / "wrk_capacity.lua"),
                             f"http://{host}/v2/models/digits/infer", "--", str(body)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def wrk_result(process: subprocess.Popen) -> Run:
    out, _ = process.communicate()
    line = next((line for line in out.splitlines() if line.startswith("TANDEM-WRK ")), None)
    if line is None:  # wrk could not run at all (its own error is in `out`)
        return Run(0, 1, [])
    fields = line.split()[1:]
    return Run(int(fields[0]), sum(int(n) for n in fields[1:6]), [float(q) for q in fields[6:]])


class Load(threading.Thread):
    """wrk through `periods` from t0, `segment` seconds at a time, each run against the endpoints ready at its
    start, the period's connections spread over them."""

    def __init__(self, endpoints: Callable[[], list[str]], periods: list[Period], t0: float, segment: int,
                 body: Path):
        super().__init__(daemon=True)
        self.endpoints, self.periods, self.t0, self.segment, self.body = endpoints, periods, t0, segment, body
        self.segments: list[Segment] = []
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            begins = self.t0
            for period in self.periods:
                ends = begins + period.seconds
                while (left := ends - time.time()) >= 0.5:
                    seconds = max(1, min(self.segment, round(left)))
                    hosts = self.endpoints()
                    start = time.time()
                    if not hosts:
                        time.sleep(0.1)
                        self.segments.append(Segment(period.name, start, time.time(), 0, [Run(0, 1, [])]))
                        continue
                    shares = [period.connections // len(hosts) + (i < period.connections % len(hosts))
                              for i in range(len(hosts))]
                    processes = [wrk_run(host, share, seconds, self.body)
                                 for host, share in zip(hosts, shares, strict=True) if share]
                    runs = [wrk_result(process) for process in processes]
                    self.segments.append(Segment(period.name, start, time.time(), len(hosts), runs))
                begins = ends
        except BaseException as error:  # reported by the arm, not lost in a thread
            self.error = error


@dataclass
class Served:
    """What wrk saw over some segments."""

    requests: int
    failed: int
    seconds: float
    p99_ms: float | None

    @property
    def rate(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


def served(segments: list[Segment]) -> Served:
    weighted = sorted((q, run.requests / len(run.quantiles_us)) for s in segments for run in s.runs
                      for q in run.quantiles_us if run.requests)
    total = sum(weight for _, weight in weighted)
    p99, seen = None, 0.0
    for value, weight in weighted:
        seen += weight
        if seen >= 0.99 * total - 1e-9:
            p99 = value / 1000
            break
    return Served(sum(r.requests for s in segments for r in s.runs), sum(r.failed for s in segments for r in s.runs),
                  sum(s.end - s.start for s in segments), p99)


# -- one arm --------------------------------------------------------------------------------------------------------
@dataclass
class Arm:
    name: str
    workers: int
    replicas: int
    samples: int = 0
    steps: float = 0
    """Steps in the episode: its samples over the global batch (at 2 ranks of a 48-example batch a rank runs two
    micro-batches a step, 16 and 8: forwards are not steps)."""
    status_steps: int = 0
    """status.progress.step at the episode's end less at its start (rank 0 reports it every few seconds, so its
    edges lag)."""
    global_batch: int = 0
    seconds: float = 0.0
    t0: float = 0.0
    """The arm's wall time, the cluster's start to its end."""
    regroups: list[dict] = field(default_factory=list)
    restarts: int = 0
    load: dict[str, Served] = field(default_factory=dict)
    marks: dict[str, float] = field(default_factory=dict)
    """Seconds from t0 of what the benchmark saw happen (the trade's scale-up and what followed)."""
    timeline: list[str] = field(default_factory=list)
    events: list[str] = field(default_factory=list)
    rank_seconds: dict[int, float] = field(default_factory=dict)
    """Seconds of the episode the group trained at each size (from the forward log)."""

    @property
    def rank_seconds_total(self) -> float:
        return sum(ranks * seconds for ranks, seconds in self.rank_seconds.items())

    @property
    def steps_lost(self) -> int:
        return sum(r["stoppedAtStep"] - r["resumedAtStep"] for r in self.regroups)


def wait(cluster: Cluster, check, timeout: float, what: str):
    try:
        return cluster.wait_for(check, timeout, what, interval=POLL)
    except TimeoutError:
        print(cluster.process_log("operator")[-3000:])
        print("job:", status(cluster, JOBS, JOB))
        print("pool:", status(cluster, POOLS, POOL))
        raise


def look(cluster: Cluster) -> tuple:
    """What the timeline follows: the job's loan, rank pods and last recovery; the pool's replicas, ready replicas
    and server pods (placed or not, ready or not)."""
    job, pool_status = status(cluster, JOBS, JOB), status(cluster, POOLS, POOL)
    recovery = job.get("lastRecovery") or {}
    ranks = tuple(p["metadata"]["name"].removeprefix(f"{JOB}-") for p in job_pods(cluster, JOB)
                  if not p["metadata"].get("deletionTimestamp") and "coordinator" not in p["metadata"]["name"])
    servers = tuple(sorted((p["metadata"]["name"][-5:], "ready" if is_ready(p) else
                            "placed" if p["spec"].get("nodeName") else "pending")
                           for p in server_pods(cluster, POOL)))
    pool_spec = (cluster.get(f"{GROUP}/{VERSION}/{POOLS}", NS, POOL) or {}).get("spec") or {}
    return ((job.get("lent") or {}).get("workers", 0), ranks,
            (recovery.get("workers"), tuple(recovery.get("lost") or ()), tuple(recovery.get("added") or ())),
            pool_spec.get("replicas"), pool_status.get("readyReplicas"), (pool_status.get("borrowed") or {}).get(
                "workers", 0), servers)


def describe(seen: tuple) -> str:
    lent, ranks, (workers, lost, added), replicas, ready, borrowed, servers = seen
    return (f"job: lent {lent}, rank pods {list(ranks)}, last regroup {workers} ranks (lost {list(lost)}, added "
            f"{list(added)}) | pool: replicas {replicas}, ready {ready}, borrowed {borrowed}, servers "
            f"{', '.join(f'{n} {s}' for n, s in servers)}")


def run_arm(name: str, directory: Path, args: argparse.Namespace, body: Path) -> Arm:
    trade = name == "trade"
    workers = args.gpus - BASE if trade else args.gpus - PEAK
    arm = Arm(name, workers, BASE if trade else PEAK)
    log = directory / f"{name}.forwards"
    began = time.time()
    with Cluster(directory / name, capacity={GPU: str(args.gpus)}, extra_env={"PYTHONPATH": str(BENCH)}) as cluster:
        start_operator(cluster)
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, POOLS, pool(arm.replicas, args))
        wait(cluster, lambda: status(cluster, POOLS, POOL).get("readyReplicas") == arm.replicas, READY,
             "the pool's replicas Ready")
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, NS, JOBS,
                                                       job_manifest(workers, args.gpus - PEAK, trade, log, args))
        wait(cluster, lambda: any(f.ranks == workers for f in forwards(log)), STARTUP, "the job training")
        time.sleep(WARM)
        hosts = cluster.endpoints(NS, POOL)
        for process in [wrk_run(host, args.quiet_connections, 1, body) for host in hosts]:  # warm-up
            wrk_result(process)

        periods = [Period("quiet before", args.quiet, args.quiet_connections),
                   Period("spike", args.spike, args.connections),
                   Period("quiet after", args.after, args.quiet_connections)]
        t0 = time.time()
        end = t0 + sum(p.seconds for p in periods)
        up_at, down_at = t0 + args.quiet - args.lead, t0 + args.quiet + args.spike
        step_at_t0 = status(cluster, JOBS, JOB).get("progress", {}).get("step", 0)
        restarts_at_t0 = status(cluster, JOBS, JOB).get("restarts", 0)
        load = Load(lambda: cluster.endpoints(NS, POOL), periods, t0, args.segment, body)
        load.start()
        previous, scaled_up, scaled_down = None, False, False
        while (now := time.time()) < end:
            if trade and not scaled_up and now >= up_at:
                scale(cluster, POOLS, POOL, PEAK)
                scaled_up = True
                arm.marks["scale-up requested"] = now - t0
                arm.timeline.append(f"{now - t0:6.1f} s  the autoscaler (the benchmark): /scale to {PEAK}")
            if trade and not scaled_down and now >= down_at:
                scale(cluster, POOLS, POOL, BASE)
                scaled_down = True
                arm.marks["scale-down requested"] = now - t0
                arm.timeline.append(f"{now - t0:6.1f} s  the autoscaler (the benchmark): /scale to {BASE}")
            try:
                seen = look(cluster)
            except Exception:  # noqa: BLE001 - an object between two writes: look again
                time.sleep(POLL)
                continue
            if seen != previous:
                arm.timeline.append(f"{now - t0:6.1f} s  {describe(seen)}")
                lent, ranks, recovery, _, ready, _, servers = seen
                if scaled_up and not scaled_down:
                    if lent and "lent" not in arm.marks:
                        arm.marks["lent"] = now - t0
                    if len(ranks) < workers and "rank pod deleted" not in arm.marks:
                        arm.marks["rank pod deleted"] = now - t0
                    if (sum(s != "pending" for _, s in servers) >= PEAK and "new replica placed"
                            not in arm.marks):
                        arm.marks["new replica placed"] = now - t0
                    if (ready or 0) >= PEAK and "new replica Ready" not in arm.marks:
                        arm.marks["new replica Ready"] = now - t0
                if scaled_down and not lent and "loan ended" not in arm.marks:
                    arm.marks["loan ended"] = now - t0
                previous = seen
            time.sleep(POLL)
        load.join(timeout=args.segment + 30)
        if load.error is not None:
            raise load.error

        job = status(cluster, JOBS, JOB)
        arm.status_steps = job.get("progress", {}).get("step", 0) - step_at_t0
        arm.restarts = job.get("restarts", 0) - restarts_at_t0
        arm.global_batch = workers * BATCH_SIZE
        arm.t0 = t0
        logged = [f for f in forwards(log) if t0 <= f.time < end]
        arm.samples = sum(f.examples for f in logged)
        arm.steps = arm.samples / arm.global_batch  # a step is the global batch at every size (elastic batch global)
        by_rank0 = [f for f in logged if f.rank == 0]
        for before, after in itertools.pairwise(by_rank0):
            arm.rank_seconds[before.ranks] = arm.rank_seconds.get(before.ranks, 0.0) + after.time - before.time
            if after.ranks != before.ranks:
                arm.timeline.append(f"{after.time - t0:6.1f} s  forward log: rank 0 trains in a group of "
                                    f"{after.ranks} (was {before.ranks})")
                mark = "rank left" if after.ranks < before.ranks else "rank back"
                arm.marks.setdefault(mark, after.time - t0)
        arm.timeline.sort(key=lambda line: float(line.split()[0]))
        recoveries = []
        for version in cluster.history(f"{GROUP}/{VERSION}/{JOBS}", NS, JOB):
            recovery = ((version or {}).get("status") or {}).get("lastRecovery")
            if recovery and recovery.get("seconds") is not None and recovery not in recoveries:
                recoveries.append(recovery)
        arm.regroups = recoveries
        arm.events = [f"{e['reason']}: {e['message']}" for e in cluster.list("events", NS)
                      if e["involvedObject"]["name"] == JOB and e["reason"] in ("Lent", "TookBack")]
        if "Restarting" in reasons(cluster, JOB):
            arm.events.append("Restarting (a whole-group restart)")
        segments = load.segments
        arm.load = {p.name: served([s for s in segments if s.period == p.name]) for p in periods}
        spike = [s for s in segments if s.period == "spike"]
        for count in sorted({s.endpoints for s in spike}):
            arm.load[f"spike, {count} ready"] = served([s for s in spike if s.endpoints == count])
        arm.load["episode"] = served(segments)
    arm.seconds = time.time() - began
    return arm


# -- the report -----------------------------------------------------------------------------------------------------
def ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f} ms"


def sizes(arm: Arm) -> str:
    return ", ".join(f"{ranks}: {seconds:.0f} s" for ranks, seconds in sorted(arm.rank_seconds.items(), reverse=True))


def noticed(regroup: dict, t0: float) -> str:
    when = regroup.get("time")
    if not when:
        return "-"
    return f"{datetime.fromisoformat(when.replace('Z', '+00:00')).timestamp() - t0:.1f} s"


def print_arm(arm: Arm) -> None:
    print(f"\n{arm.name}: job {arm.workers} workers, pool {arm.replicas} replica(s) at t0")
    for line in arm.timeline:
        print("  " + line)
    for event in arm.events:
        print("  event " + event)
    for regroup in arm.regroups:
        print(f"  regroup: lost {regroup.get('lost')} added {regroup.get('added')} -> {regroup['workers']} ranks, "
              f"stopped at step {regroup['stoppedAtStep']}, resumed at {regroup['resumedAtStep']}, "
              f"in {regroup['seconds']:.2f} s, noticed at {noticed(regroup, arm.t0)}: {regroup.get('message') or '-'}")
    print(f"  ({arm.seconds:.0f} s for the arm)")


def print_report(arms: dict[str, Arm], args: argparse.Namespace) -> None:
    static, trade = arms["static"], arms["trade"]
    bound = args.p99_bound_ms or (1.5 * static.load["spike"].p99_ms if static.load["spike"].p99_ms else None)
    how = "fixed (--p99-bound-ms)" if args.p99_bound_ms else "1.5 x the static split's p99 through the spike"
    print(f"\n{args.gpus} x {GPU} on one emulated node; episode {args.quiet} s quiet ({args.quiet_connections} "
          f"connections), {args.spike} s spike ({args.connections} connections), {args.after} s quiet; trade's "
          f"scale-up {args.lead} s before the spike, stabilizationWindowSeconds {args.window}")
    print("\n| measure | static split | trade (lendTo) | trade / static |")
    print("|---|---|---|---|")
    print(f"| GPUs: job + pool at t0 | {static.workers} + {static.replicas} | {trade.workers} + {trade.replicas} | |")
    print(f"| training samples over the episode (forward log) | {static.samples} | {trade.samples} | "
          f"**{trade.samples / static.samples:.2f}x** |" if static.samples else "| training samples | 0 | | |")
    print(f"| steps (samples / global batch) | {static.steps:.0f} x {static.global_batch} | {trade.steps:.0f} x "
          f"{trade.global_batch} | |")
    print(f"| steps by status.progress.step (edges lag) | {static.status_steps} | {trade.status_steps} | |")
    print(f"| seconds at each group size (rank 0's forwards) | {sizes(static)} | {sizes(trade)} | |")
    ideal = {arm.name: arm.rank_seconds_total * 1000 / args.example_ms for arm in (static, trade)}
    print(f"| samples at the emulated GPU speed alone (rank-seconds x 1000/{args.example_ms:g}) | "
          f"{ideal['static']:.0f} | {ideal['trade']:.0f} | {ideal['trade'] / ideal['static']:.2f}x |"
          if ideal["static"] else "")
    print(f"| regroups / steps lost / restarts | {len(static.regroups)} / {static.steps_lost} / {static.restarts} | "
          f"{len(trade.regroups)} / **{trade.steps_lost}** / {trade.restarts} | |")
    for period in [*(name for name in trade.load if name != "episode"), "episode"]:
        s, t = static.load.get(period), trade.load.get(period)
        cell = lambda x: "-" if x is None else (f"{ms(x.p99_ms)}, {x.failed} failed of {x.requests + x.failed} "  # noqa: E731
                                                f"({x.rate:.0f} req/s)")
        ratio = f"{t.p99_ms / s.p99_ms:.2f}x" if s and t and s.p99_ms and t.p99_ms else ""
        print(f"| pool p99, failed ({period}) | {cell(s)} | {cell(t)} | {ratio} |")
    marks = trade.marks
    if "scale-up requested" in marks:
        up = marks["scale-up requested"]
        steps = [f"{key} +{marks[key] - up:.1f} s" for key in ("lent", "rank pod deleted", "rank left",
                                                                "new replica placed", "new replica Ready")
                 if key in marks]
        print(f"| scale-up to new replica Ready | (pre-provisioned) | {', '.join(steps)} | |")
    if "scale-down requested" in marks:
        down = marks["scale-down requested"]
        steps = [f"{key} +{marks[key] - down:.1f} s" for key in ("loan ended", "rank back") if key in marks]
        print(f"| scale-down to the worker back | | {', '.join(steps) or 'not within the episode'} | |")
    print(f"\nThe pool's p99 bound: {ms(bound)} ({how}).")
    if bound:
        for period in ("spike", *(name for name in trade.load if name.startswith("spike, ")), "episode"):
            p99 = trade.load[period].p99_ms
            held = p99 is not None and p99 <= bound
            print(f"- trade, {period}: p99 {ms(p99)} {'within' if held else 'NOT within'} the bound")
        p99 = static.load["spike"].p99_ms
        print(f"- static, spike: p99 {ms(p99)} {'within' if p99 and p99 <= bound else 'NOT within'} the bound")
    more = trade.samples > static.samples
    print(f"\nIssue 39's goals: more samples than the static split: {'met' if more else 'NOT met'} "
          f"({trade.samples} against {static.samples}); steps lost 0: {'met' if trade.steps_lost == 0 else 'NOT met'}"
          f"; failed requests: {trade.load['episode'].failed} (trade), {static.load['episode'].failed} (static).")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=4, help="the node's nvidia.com/gpu (default 4)")
    parser.add_argument("--quiet", type=int, default=20, help="seconds of quiet before the spike")
    parser.add_argument("--spike", type=int, default=40, help="seconds of the spike")
    parser.add_argument("--after", type=int, default=40, help="seconds of quiet after the spike")
    parser.add_argument("--lead", type=int, default=0,
                        help="seconds before the spike's start that the trade's pool is scaled up (default 0: at it)")
    parser.add_argument("--connections", type=int, default=32, help="wrk's connections through the spike")
    parser.add_argument("--quiet-connections", type=int, default=4, help="wrk's connections when quiet")
    parser.add_argument("--segment", type=int, default=2, help="seconds of each wrk run (the endpoints looked up "
                                                                 "again between runs)")
    parser.add_argument("--window", type=int, default=10, help="the trade's stabilizationWindowSeconds")
    parser.add_argument("--example-ms", type=float, default=20.0, help="a training forward's ms per example")
    parser.add_argument("--forward-ms", type=float, default=10.0, help="a serving forward's fixed ms")
    parser.add_argument("--row-ms", type=float, default=2.0, help="a serving forward's ms per row")
    parser.add_argument("--workdir", type=Path, default=None,
                        help="keep each arm's cluster (the operator's and pods' logs) and forward log here")
    parser.add_argument("--p99-bound-ms", type=float, default=None,
                        help="the pool's p99 bound (default: 1.5 x the static split's p99 through the spike)")
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        sys.exit("wrk is not installed (Debian: apt-get install wrk): this benchmark's load generator")
    if args.gpus - PEAK < 1:
        sys.exit(f"--gpus must leave the static split's job a GPU beside the pool's {PEAK}")
    arms = {}
    print(f"load average at the start: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    with tempfile.TemporaryDirectory() as scratch:
        directory = args.workdir or scratch
        Path(directory).mkdir(parents=True, exist_ok=True)
        body = wrk_body(Path(directory))
        for name in ARMS:
            arms[name] = run_arm(name, Path(directory), args, body)
            print_arm(arms[name])
            sys.stdout.flush()
    print(f"load average at the end: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print_report(arms, args)


if __name__ == "__main__":
    main()
