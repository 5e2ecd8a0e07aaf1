"""What two `tandem serve` processes per pod give (issue 20, part 5): one server of the benchmark's pool
(bench_inference.py's: the 3072-unit MLP, batchLimit 32) with 2 workers under one wrk, against two servers of the
same pool with one worker each (OMP_NUM_THREADS=1), each on its own port under its own wrk with half the connections,
both wrk at once and their req/s summed (the experiment that led to processesPerReplica), and against
`processesPerReplica: 2` of one worker each (`tandem serve --processes 2`: both on one port) under one wrk; at 8, 64
and 256 connections, `--rounds` times, then the raw forward's ceiling. Ratios printed: each over one process, each
round, and all over the ceiling.

    .venv/bin/python bench/bench_processes.py --rounds 2        # about 4 minutes on 2 cores; needs wrk
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_inference import EXAMPLE, HOST, ROOT, WRK_CONNECTIONS, bench_ceiling, tandem_server  # noqa: E402


def wrk_at_once(ports: list[int], body: Path, connections: int, seconds: int, warm_up: bool = False) -> float:
    """One wrk per port, all at once, the connections split evenly between them: their req/s summed. Any answer
    but 200 fails the measurement, except in a warm-up (a process of a group may still be loading its model)."""
    base = ["wrk", "-t1", f"-d{seconds}s", "-s", str(ROOT / "bench" / "wrk_infer.lua")]
    runs = [subprocess.Popen([*base, f"-c{connections // len(ports)}", f"http://{HOST}:{port}/v2/models/mlp/infer",
                              "--", str(body)], stdout=subprocess.PIPE, text=True) for port in ports]
    outputs = [run.communicate()[0] for run in runs]
    if not warm_up and any("Non-2xx" in output for output in outputs):
        raise RuntimeError("answers other than 200 under load:\n" + "\n".join(outputs))
    return sum(float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1)) for out in outputs)


def rounds(rates: list[float]) -> str:
    return ", ".join(f"{rate:.0f}" for rate in rates)


def ratios(base: list[float], other: list[float]) -> str:
    return ", ".join(f"{b / a:.2f}x" for a, b in zip(base, other, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if shutil.which("wrk") is None:
        print("skipped: wrk is not installed (Debian: apt-get install wrk)")
        return
    rates: dict[tuple[str, int], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        body = directory / "request.json"
        body.write_text(json.dumps({"inputs": [{"name": "input", "shape": [1, 64], "datatype": "FP32",
                                                "data": EXAMPLE.tolist()}]}))
        for round_ in range(args.rounds):
            with tandem_server("batched", 2, directory) as one:
                wrk_at_once([one.port], body, 64, 1, warm_up=True)
                for connections in WRK_CONNECTIONS:
                    rates.setdefault(("one", connections), []).append(
                        wrk_at_once([one.port], body, connections, args.seconds))
            single = {"OMP_NUM_THREADS": "1"}
            with tandem_server("batched", 1, directory, variables=single) as first, \
                    tandem_server("batched", 1, directory, variables=single) as second:
                ports = [first.port, second.port]
                wrk_at_once(ports, body, 64, 1, warm_up=True)
                for connections in WRK_CONNECTIONS:
                    rates.setdefault(("two", connections), []).append(
                        wrk_at_once(ports, body, connections, args.seconds))
            with tandem_server("batched", 2, directory, processes=2) as group:
                wrk_at_once([group.port], body, 64, 2, warm_up=True)
                for connections in WRK_CONNECTIONS:
                    rates.setdefault(("group", connections), []).append(
                        wrk_at_once([group.port], body, connections, args.seconds))
            print(f"round {round_ + 1}: " + ", ".join(
                f"c={c} one {rates['one', c][-1]:.0f} two {rates['two', c][-1]:.0f} "
                f"--processes 2 {rates['group', c][-1]:.0f} req/s" for c in WRK_CONNECTIONS), flush=True)
    ceiling = bench_ceiling(3.0, 2)
    print("\n| connections | one process, 2 workers: req/s | two servers, 1 worker each: req/s | two / one, per round "
          "| --processes 2, 1 worker each: req/s | --processes 2 / one, per round | of the ceiling: one / two / "
          "--processes 2 |")
    print("|---|---|---|---|---|---|---|")
    for c in WRK_CONNECTIONS:
        one, two, group = rates["one", c], rates["two", c], rates["group", c]
        print(f"| {c} | {rounds(one)} | {rounds(two)} | {ratios(one, two)} | {rounds(group)} | {ratios(one, group)} | "
              f"{max(one) / ceiling:.2f} / {max(two) / ceiling:.2f} / {max(group) / ceiling:.2f} |")
    print(f"ceiling (raw forward, batch 32, 2 replicas): {ceiling:.0f} examples/s")


if __name__ == "__main__":
    main()
