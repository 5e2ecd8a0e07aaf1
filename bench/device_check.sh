#!/usr/bin/env bash
# The GPU checks of the trainer and the inference server, as one prepared script for a session lent a device.
#
#   here:   make device-wheels          # the packages the device image lacks, as cp312 wheels (about 10 MB)
#   device: run(command="bash bench/device_check.sh", carry=[".device-wheels"], timeout_s=560)
#
# The device image brings python3 with torch (and numpy, rich, pyyaml, scikit-learn, uvloop); the wheels add
# pydantic and the rest. It runs `tandem run` on one GPU, an exact-resume check there, then benchmark (a):
# Tandem's loop against the plain DDP loop, one rank over NCCL, on the bench's small MLP (where per-step overheads
# and host syncs show most) and on a wider one; then the inference server's batched vs sequential and ceiling figures on the GPU;
# with several GPUs, one pod of N ranks against N pods of one (bench/bench_ranks_per_pod.py).
# Figures land in $OUT. Locally, as a dry run:
#   PYTHON=.venv/bin/python DEVICE=cpu ROUNDS=1 STEPS=30 SHAPES="--hidden 64 --batch 16" SERVE_SECONDS=0.5 \
#       bash bench/device_check.sh
set -euo pipefail
PYTHON=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-$(mktemp -d)}
ROUNDS=${ROUNDS:-8}
STEPS=${STEPS:-300}
SHAPES=${SHAPES:-"--hidden 512 --batch 64;--hidden 4096 --batch 512"}
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD

if [ "$DEVICE" = cuda ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps .device-wheels/*.whl
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
fi
"$PYTHON" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"

WORK=$(mktemp -d)  # checkpoints stay out of $OUT, which brings back 8 files at most
"$PYTHON" - "$WORK" "$DEVICE" <<'PY'
import sys, yaml
document = yaml.safe_load(open("examples/digits-train.yaml"))
document["spec"]["checkpoint"]["directory"] = sys.argv[1] + "/checkpoints"
if sys.argv[2] == "cuda":  # one GPU per rank, and no quiet fallback to the CPU
    document["spec"]["gpusPerWorker"], document["spec"]["trainer"]["requireGPU"] = 1, True
yaml.safe_dump(document, open(sys.argv[1] + "/digits-train.yaml", "w"))
PY
timeout 120 "$PYTHON" -m tandem.cli run "$WORK/digits-train.yaml" --workers 1 \
    --status-out "$OUT/digits-train-status.json" > /dev/null 2> "$OUT/digits-train-stderr.txt"
"$PYTHON" -c "import json, sys; s = json.load(open(sys.argv[1])); print('tandem run:', s['phase'], s['metrics'])" \
    "$OUT/digits-train-status.json"

# Exact resume on the device: the CUDA generator's state and cuBLAS in deterministic mode.
timeout 150 "$PYTHON" bench/resume_check.py --device "$DEVICE" --workers 1 2>&1 | tee "$OUT/resume_check_$DEVICE.txt"

IFS=';' read -ra shapes <<< "$SHAPES"
for shape in "${shapes[@]}"; do
    # shellcheck disable=SC2086
    timeout 200 "$PYTHON" bench/bench_trainer.py --device "$DEVICE" --rounds "$ROUNDS" --steps "$STEPS" $shape 2>&1 \
        | grep -v "terminate called" | tee -a "$OUT/bench_trainer_$DEVICE.txt"
done

# The inference server benchmark on the GPU: one replica (gpusPerReplica 1), batched vs sequential and the
# in-process ceiling (the LitServe comparison stays a CPU figure: its GPU set-up is a study of its own).
timeout ${SERVE_TIMEOUT:-150} "$PYTHON" bench/bench_inference.py --device "$DEVICE" --workers 1 \
    --only modes --only ceiling --seconds "${SERVE_SECONDS:-3}" 2>&1 | tee -a "$OUT/bench_inference_$DEVICE.txt"

# Several ranks per pod (ranksPerPod): one pod of N ranks, every GPU visible (NVLink/P2P), against N pods of one rank,
# each seeing its own GPU, when the device has more than one GPU (issue 18; unmeasured until such a device is lent).
GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)")
if [ "$DEVICE" = cuda ] && [ "$GPUS" -gt 1 ]; then
    timeout 300 "$PYTHON" bench/bench_ranks_per_pod.py --device cuda --ranks "$GPUS" 2>&1 \
        | tee "$OUT/bench_ranks_per_pod.txt"
elif [ "$DEVICE" = cpu ]; then
    timeout 120 "$PYTHON" bench/bench_ranks_per_pod.py --device cpu --ranks 2 --hidden 256 --steps 30 2>&1 \
        | tee "$OUT/bench_ranks_per_pod.txt"
else
    echo "ranksPerPod: $GPUS GPU(s): one pod of several ranks needs at least 2 (not measured)"
fi
