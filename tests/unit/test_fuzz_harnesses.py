"""The fuzz harnesses (fuzz/, `make fuzz`) build against the front's parsers and encoders as they are and run, each of
fuzz/*.c: a change to a parser's signature or contract that leaves a harness behind fails here, not only when someone
next fuzzes. 20,000 inputs each and no coverage report (`make fuzz` runs a minute each and reports coverage); the
harnesses' own checks and the sanitizers apply as in a long run."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RUNS = 20_000


@pytest.mark.skipif(shutil.which("make") is None, reason="make runs the harnesses")
def test_every_harness_builds_and_runs_clean(tmp_path):
    # --no-print-directory: under `make -C DIR test` the outer make's flags would add "Entering directory" lines
    done = subprocess.run(["make", "-s", "--no-print-directory", "fuzz", "FUZZ_SECONDS=1"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "FUZZ_COVERAGE": "0", "FUZZ_RUNS": str(RUNS)})
    if done.returncode and "make fuzz: needs" in done.stderr:
        pytest.skip(done.stderr.strip())  # not root here: clang, libFuzzer and llvm-cov cannot be installed
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines()[1:] if line.strip()}
    assert set(rows) == {path.stem for path in (ROOT / "fuzz").glob("*.c")}, done.stdout  # none left out of run.sh
    for name, row in rows.items():
        assert int(row[1]) >= RUNS, f"{name} ran {row[1]} inputs"
