#!/usr/bin/env bash
# GPU check (d3d/tools/gpu_check.py): the forwards that decide whether asynchronous drafting pays,
# then the engine serving 16 concurrent requests per mode (ar, sync, async) on a random-weight
# Qwen3-8B-shaped target in bf16 with a self:5 drafter, then vLLM serving the same target alone
# and with the D3D proposer (drafter on the second GPU; skipped without vLLM); one JSON, written
# as each stage ends. Under 9.5 minutes on one H200 (each stage has its own limit inside
# --budget-s; timeout is the last guard). How to read the JSON: docs/results.md, "GPU check".
#
# Usage: scripts/gpu_check.sh [--tiny] [OUT.json] [FLAG...]
#   needs torch with CUDA and this project installed; PYTHON=... picks the interpreter.
#   --tiny: the same code on a tiny Qwen3-shaped model and few tokens, on CPU in seconds (tests).
#   FLAGs go to python -m d3d.tools.gpu_check after these (e.g. --drafter-device cuda:1).
# Exit: 0 every stage ran; 1 a stage failed (its error is in the JSON); 2 bad flags or no GPU;
#       124 stopped at 9.5 minutes (the JSON holds the stages that finished).
set -euo pipefail
tiny=0
if [[ ${1:-} == --tiny ]]; then
    tiny=1
    shift
fi
out=${1:-gpu_check.json}
shift || true
[[ $out == /* ]] || out="$PWD/$out"  # relative to where the script was called from
cd "$(dirname "$0")/.."
py=${PYTHON:-$(command -v python || command -v python3 || echo python)}
if ! "$py" -c 'import importlib.util as u, sys; sys.exit(not (u.find_spec("torch") and u.find_spec("d3d")))' 2>/dev/null; then
    echo "gpu_check: $py cannot import torch and d3d: install torch (a CUDA build on a GPU host), then pip install -e ." >&2
    exit 2
fi
if ((tiny)); then
    args=(--tiny --context 32 --repeats 1 --drafter-layers 2 --drafter self:2
          --requests 16 --prompt-tokens 24 --new-tokens 8 --stage-seconds 60 --budget-s 240)
else
    args=(--context 1024 --repeats 10 --drafter-layers 5,31 --drafter self:5
          --requests 16 --prompt-tokens 512 --new-tokens 128 --stage-seconds 90 --budget-s 540)
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
    fi
fi
rc=0
timeout 570 "$py" -m d3d.tools.gpu_check --out "$out" "${args[@]}" "$@" || rc=$?
if [[ $rc == 124 ]]; then
    echo "gpu_check: stopped at 9.5 minutes; $out holds the stages that finished" >&2
fi
exit "$rc"
