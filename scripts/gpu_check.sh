#!/usr/bin/env bash
# GPU check (d3d/tools/gpu_check.py): what the paper and the field measure, on one GPU, one JSON
# written as each stage ends: the copy bandwidth; the target's decode step at 1 / 16 / 64 rows
# and its 16-token verify against the bandwidth floor (random Qwen3-8B shape, bf16, the cuda
# backend: CUDA graphs); the D3D-1.7B-shaped and 31-layer drafters' block and packed round of 8
# branches; captured against eager token for token in fp32; the replay instrument at the
# paper's acceptance (replay:7.88) in sync and async against ar at 1 and 16 rows, and the
# two-GPU projection; peak memory against d3d plan; vLLM where installed. Under 8 minutes on one
# H100 or H200 (each stage has its own limit inside --budget-s; timeout is the last guard). How
# to read the JSON: docs/results.md, "GPU check".
#
# Usage: scripts/gpu_check.sh [--tiny] [OUT.json] [FLAG...]
#   needs torch with CUDA and this project installed; PYTHON=... picks the interpreter.
#   --tiny: the same code on a tiny Qwen3-shaped model and few tokens, on CPU (CI runs it).
#   FLAGs go to python -m d3d.tools.gpu_check after these (e.g. --no-vllm).
# Exit: 0 every stage ran; 1 a stage failed (its error is in the JSON); 2 bad flags or no GPU;
#       124 stopped at 8 minutes (the JSON holds the stages that finished).
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
    args=(--tiny --context 32 --repeats 1 --drafter-layers 2 --exact-layers 2
          --prompt-tokens 24 --new-tokens 24 --stage-seconds 60 --budget-s 300)
else
    args=(--context 1024 --repeats 10 --drafter-layers 31 --prompt-tokens 512 --new-tokens 128
          --stage-seconds 60 --budget-s 450)
    if command -v nvidia-smi >/dev/null; then
        nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv || true
    fi
fi
rc=0
timeout 480 "$py" -m d3d.tools.gpu_check --out "$out" "${args[@]}" "$@" || rc=$?
if [[ $rc == 124 ]]; then
    echo "gpu_check: stopped at 8 minutes; $out holds the stages that finished" >&2
fi
exit "$rc"
