#!/usr/bin/env bash
# GPU readiness check for asynchronous drafting (see d3d/tools/gpu_check.py); under 8 minutes on one H200.
# Usage: scripts/gpu_check.sh [OUT.json]   (needs torch with CUDA and this project installed)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-gpu_check.json}
nvidia-smi --query-gpu=name,memory.total --format=csv || true
timeout 480 python -m d3d.tools.gpu_check --out "$out" --context 1024 --repeats 10 --drafter-layers 5,31
