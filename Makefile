# The README's two commands: `make run` and `make test`. Both set up .venv first and are
# quick when it is already there.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test lint setup system-packages crds bench clean device-wheels images e2e sanitize fuzz devcluster

# tests/integration/test_kubectl.py needs kubectl >= 1.27 on PATH (it validates `apply` through the OpenAPI v3
# documents; Debian bookworm's kubernetes-client is 1.20); without one those tests skip, saying why.
setup: $(STAMP)
	@command -v kubectl >/dev/null 2>&1 || echo "make setup: no kubectl on PATH: tests/integration/test_kubectl.py will skip (install kubectl >= 1.27)"

# torch first, pinned: on the project's machines torch==2.13.0 is a CPU build on local disk;
# any other spec may pull a multi-GB CUDA build.
# setup.py builds the C extension (worker/serve/_front*.c) in the editable install: a change to it installs again.
# The test extra brings the operator and worker extras (pyproject.toml): everything the tests import.
$(STAMP): pyproject.toml setup.py constraints.txt $(wildcard worker/serve/_front*.c worker/serve/_front*.h)
	$(MAKE) --no-print-directory system-packages
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt torch==2.13.0
	TANDEM_REQUIRE_FRONT=$$($(FRONT_LIBRARIES) && echo 1) $(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

# The C front's libraries come from the system's packages (setup.py says which and how they are found): installed
# here when missing, where this is root with apt-get (as on the project's machines and in CI); elsewhere the line
# below says what to install, and until then `tandem serve` serves in Python. Where they are there, the front must
# build (TANDEM_REQUIRE_FRONT=1).
SYSTEM_PACKAGES := gcc libc6-dev pkg-config libnghttp2-dev node-llhttp
FRONT_LIBRARIES := pkg-config --exists libnghttp2 && test -f /usr/share/llhttp/llhttp.c
system-packages:
	@if $(FRONT_LIBRARIES) 2>/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "make setup: installing the C front's libraries: $(SYSTEM_PACKAGES)"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$(SYSTEM_PACKAGES) >/dev/null; \
	else \
		echo "make setup: the C front needs $(SYSTEM_PACKAGES) (Debian/Ubuntu; as root: apt-get install ...);" \
			"without them tandem serve serves every request in Python"; \
	fi

run: $(STAMP)
	$(BIN)/tandem validate examples/*.yaml
	$(BIN)/tandem run examples/digits-train.yaml

# The operator on an emulated cluster (devcluster/), until Ctrl-C: it prints the KUBECONFIG to export for kubectl.
devcluster: $(STAMP)
	$(BIN)/tandem devcluster

# -rs: every skip's reason is shown (here, the kind end-to-end test's: it runs only with `make e2e`);
# --durations: the slowest tests, to keep the suite's time in sight.
# -n 2 --dist loadfile (pytest-xdist): two workers, each running a whole file at a time (its module fixtures once).
# The tests wait on processes (ranks, servers, the emulated cluster) about 40% of the time on 2 cores: two at once
# take a quarter less time, and every test runs on a busy machine, as it must pass on one.
# PYTEST_WORKERS=0 runs them one at a time.
PYTEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -rs --durations=15 -n $(PYTEST_WORKERS) --dist loadfile

crds: $(STAMP)
	$(BIN)/tandem crds --out crds
	cp crds/*.yaml charts/tandem/crds/
	$(BIN)/python -m tandem.api_reference

# The operator and worker images (Dockerfile targets), tagged with the chart's appVersion (= the package's version).
# Build args (documented at the top of the Dockerfile), e.g. make images DOCKER_BUILD_ARGS="--build-arg TORCH_INDEX_URL=..."
TANDEM_VERSION := $(shell sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml)
OPERATOR_IMAGE ?= tandem-operator:$(TANDEM_VERSION)
WORKER_IMAGE ?= tandem-worker:$(TANDEM_VERSION)
DOCKER ?= docker
DOCKER_BUILD_ARGS ?=
images:
	@command -v $(DOCKER) >/dev/null 2>&1 || { echo "make images: '$(DOCKER)' not found: install Docker (or set DOCKER=podman) to build the images" >&2; exit 1; }
	@$(DOCKER) info >/dev/null 2>&1 || { echo "make images: '$(DOCKER) info' fails: is the Docker engine running, and may you use it?" >&2; exit 1; }
	$(DOCKER) build $(DOCKER_BUILD_ARGS) --target operator -t $(OPERATOR_IMAGE) .
	$(DOCKER) build $(DOCKER_BUILD_ARGS) --target worker -t $(WORKER_IMAGE) .

# The end-to-end test on kind (tests/e2e/test_kind.py): builds both images (tagged :e2e; the worker with CPU torch),
# creates a kind cluster of its own, helm-installs the chart, trains the digits job on a PVC, serves it, uninstalls,
# and deletes the cluster. Needs docker with a running engine, kind, kubectl, and helm (or helm-python-sdk, which
# the test extra installs); skipped with the reason otherwise. 10-30 minutes, most of it the first image build.
e2e: $(STAMP)
	TANDEM_E2E=1 $(BIN)/python -m pytest -v -s -rs tests/e2e

# The C HTTP front (worker/serve/_front.c) under AddressSanitizer: rebuilt with it, its tests (a longer fuzz) and the
# servers' tests under both fronts, then rebuilt as usual. Needs gcc's libasan.
sanitize: $(STAMP)
	CFLAGS="-fsanitize=address -fno-omit-frame-pointer -g -O1" $(BIN)/python setup.py -q build_ext --inplace --force
	LD_PRELOAD=$$(gcc -print-file-name=libasan.so) ASAN_OPTIONS=detect_leaks=0:abort_on_error=1 TANDEM_FUZZ_CASES=1500 \
		$(BIN)/python -m pytest -q tests/integration/test_native_front.py tests/integration/test_server.py \
		tests/integration/test_serve_processes.py tests/integration/test_http.py tests/integration/test_native_grpc.py \
		tests/integration/test_grpc.py tests/integration/test_grpc_server.py; \
		status=$$?; $(BIN)/python setup.py -q build_ext --inplace --force; exit $$status

# The front's own parsers and encoders in C (HTTP/1.1 recogniser on llhttp, JSON infer body and answer,
# ModelInferRequest decoder and ModelInferResponse encoder) under libFuzzer with ASan and UBSan, FUZZ_SECONDS each
# (fuzz/run.sh prints executions and coverage; bench/RESULTS.md keeps the latest). Needs clang, libFuzzer and
# llvm-cov: installed here when missing, as root with apt-get.
FUZZ_SECONDS ?= 60
FUZZ_PACKAGES := clang libfuzzer-14-dev libclang-rt-14-dev llvm
fuzz: system-packages
	@if command -v clang >/dev/null 2>&1 && command -v llvm-cov >/dev/null 2>&1 \
		&& test -f "$$(clang -print-file-name=libclang_rt.fuzzer-x86_64.a)"; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			$(FUZZ_PACKAGES) >/dev/null; \
	else echo "make fuzz: needs $(FUZZ_PACKAGES) (Debian/Ubuntu)" >&2; exit 1; fi
	bash fuzz/run.sh $(FUZZ_SECONDS)

# For bench/device_check.sh: what the device machine's image lacks of what `tandem run`, `tandem serve` and the
# benchmarks import (the image has torch, numpy, rich, pyyaml, attrs, prometheus-client, uvloop), for its Python 3.12.
DEVICE_WHEELS := pydantic pydantic_core annotated-types typing-inspection pydantic-settings python-dotenv orjson httptools \
	openapi-schema-validator jsonschema jsonschema-specifications referencing rpds-py rfc3339-validator jsonpointer \
	tensorboard absl-py protobuf
device-wheels: $(STAMP)
	rm -rf .device-wheels
	$(BIN)/python -m pip download -q --only-binary=:all: --no-deps --implementation cp --python-version 3.12 \
		--platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
		-c constraints.txt -d .device-wheels $(DEVICE_WHEELS)

clean:
	rm -rf $(VENV) build *.egg-info
