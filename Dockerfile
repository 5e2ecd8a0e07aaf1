# syntax=docker/dockerfile:1
#
# Tandem's two images, one target each (`make images` builds both):
#
#   docker build --target operator -t tandem-operator:0.1.0 .   # `tandem operator`: kopf, kubernetes, pydantic,
#                                                                # prometheus-client; no torch, no CUDA (~200 MB)
#   docker build --target worker   -t tandem-worker:0.1.0 .     # `tandem worker train` and `tandem serve`: torch
#                                                                # with CUDA, cuDNN and NCCL
#
# Build arguments (all optional):
#
#   PYTHON_BASE      base of both images and of the wheel build   default python:3.12-slim-bookworm
#   TORCH_VERSION    torch in the worker; keep it equal to constraints.txt's pin   default 2.13.0
#   TORCH_INDEX_URL  where that torch comes from, i.e. its CUDA variant. Default empty: pip's index (PyPI), whose
#                    Linux x86_64 torch 2.13.0 is the CUDA 13.0 build; its wheel dependencies bring the CUDA
#                    runtime, cuDNN 9 and NCCL 2.29 (nvidia-*-cu13), so no CUDA base image is needed: the GPU
#                    nodes' driver (>= 580 for CUDA 13) is mounted in by the NVIDIA container toolkit. For older
#                    drivers, the URL of PyTorch's own wheel index for a CUDA 12 variant (its `whl/cu126`); for a
#                    CPU-only worker, its `whl/cpu`.
#   UID / GID        the images' user (default 1000:1000, the runAsUser of the pods the operator creates and of
#                    the chart's operator Deployment)
#
# Every Python package is pinned by constraints.txt (`pip install -c constraints.txt`), torch included: torch's
# own CUDA libraries are pinned by torch's exact requirements.

ARG PYTHON_BASE=python:3.12-slim-bookworm

# --- the tandem wheel, built once for both images --------------------------------------------------------------
FROM ${PYTHON_BASE} AS wheel
# The C front (worker/serve/_front*.c, httpFront: native) and its libraries, as `make setup` installs them: a C
# compiler, libnghttp2's headers and llhttp's sources (setup.py); the images keep only the built wheel, and the
# front must build (TANDEM_REQUIRE_FRONT=1).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev pkg-config libnghttp2-dev node-llhttp \
    && rm -rf /var/lib/apt/lists/*
ENV TANDEM_REQUIRE_FRONT=1
WORKDIR /src
COPY constraints.txt pyproject.toml setup.py README.md ./
COPY tandem/ tandem/
COPY operator/ operator/
COPY worker/ worker/
RUN pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# --- what both images share: the non-root user, Python's settings ----------------------------------------------
FROM ${PYTHON_BASE} AS runtime
ARG UID=1000
ARG GID=1000
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --gid "${GID}" tandem \
    && useradd --uid "${UID}" --gid "${GID}" --create-home --home-dir /home/tandem --shell /usr/sbin/nologin tandem
COPY constraints.txt /opt/tandem/constraints.txt
LABEL org.opencontainers.image.licenses="Apache-2.0"

# --- operator: `tandem operator` ---------------------------------------------------------------------------------
# The tandem wheel with its `operator` extra: what pyproject.toml says the operator needs, and nothing else (no
# torch, no grpcio, no numpy). tests/unit/test_chart.py checks that this installs the extra and no list of its own,
# and imports the whole operator where only the extra's distributions can be imported.
FROM runtime AS operator
COPY --from=wheel /wheels/ /tmp/wheels/
RUN pip install -c /opt/tandem/constraints.txt "tandem[operator] @ file://$(echo /tmp/wheels/tandem-*.whl)" \
    && rm -rf /tmp/wheels
LABEL org.opencontainers.image.title="tandem-operator" \
      org.opencontainers.image.description="Tandem's Kubernetes operator (ParallelTrainingJob, InferencePool)"
USER ${UID}:${GID}
WORKDIR /home/tandem
# Ports the chart uses: 8080 metrics (--metrics-port), 8081 kopf's liveness endpoint (--health-port).
EXPOSE 8080 8081
CMD ["tandem", "operator", "--metrics-port", "8080", "--health-port", "8081"]

# --- worker: rank pods (`tandem worker train`) and inference servers (`tandem serve`) -----------------------------
FROM runtime AS worker
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=
# The container toolkit exposes the driver's compute libraries only when asked; which GPUs a container sees is the
# device plugin's business (NVIDIA_VISIBLE_DEVICES is deliberately not set here: "all" would hand every GPU of a
# node to pods that requested none).
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility
COPY --from=wheel /wheels/ /tmp/wheels/
# libnghttp2, which the C front links; torch first, from the chosen variant's index (as `make setup` does), then
# the tandem wheel with its `worker` extra from PyPI; the C front must import.
RUN apt-get update && apt-get install -y --no-install-recommends libnghttp2-14 && rm -rf /var/lib/apt/lists/*
RUN pip install ${TORCH_INDEX_URL:+--index-url "${TORCH_INDEX_URL}"} "torch==${TORCH_VERSION}" \
    && pip install -c /opt/tandem/constraints.txt "tandem[worker] @ file://$(echo /tmp/wheels/tandem-*.whl)" \
    && rm -rf /tmp/wheels \
    && python -c "import torch, torch.distributed; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'nccl', torch.distributed.is_nccl_available())" \
    && python -c "from tandem.worker.serve.native import UNAVAILABLE; assert UNAVAILABLE is None, UNAVAILABLE"
LABEL org.opencontainers.image.title="tandem-worker" \
      org.opencontainers.image.description="Tandem's trainer ranks and inference servers (PyTorch, CUDA, NCCL)"
USER ${UID}:${GID}
WORKDIR /home/tandem
EXPOSE 8000 29500
CMD ["tandem", "--help"]
