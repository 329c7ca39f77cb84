#!/usr/bin/env bash
# What a CPU host can check of the GPU image (`make docker-gpu`): the compilers vLLM's Triton
# kernels and torch.compile call at start-up answer, Triton builds and loads a C module the way it
# builds its launchers (Python's headers included), the CUDA wheels import, and `d3d --help` and
# `d3d plan` run as the image's user. A GPU start is not checked here (no GPU).
# Usage: scripts/gpu_image_check.sh [IMAGE]   (default d3d:gpu); prints one line per check.
set -euo pipefail
image="${1:-d3d:gpu}"
docker run --rm --entrypoint sh "$image" -c '
set -e
echo "cc: $(gcc --version | head -n 1)"
echo "c++: $(g++ --version | head -n 1)"
python - <<PY
import tempfile, textwrap
from triton.runtime.build import compile_module_from_src
src = textwrap.dedent("""
    #include <Python.h>
    static PyObject *answer(PyObject *self, PyObject *args) { return PyLong_FromLong(42); }
    static PyMethodDef methods[] = {{"answer", answer, METH_NOARGS, ""}, {NULL, NULL, 0, NULL}};
    static struct PyModuleDef mod = {PyModuleDef_HEAD_INIT, "d3d_probe", NULL, -1, methods};
    PyMODINIT_FUNC PyInit_d3d_probe(void) { return PyModule_Create(&mod); }
""")
module = compile_module_from_src(src, "d3d_probe")
assert module.answer() == 42
print("triton: built and loaded a C module against Python.h")
import torch, vllm, triton
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}), vllm {vllm.__version__}, triton {triton.__version__}")
PY
d3d --help > /dev/null && echo "d3d --help: ok"
d3d plan --target qwen3-8b --device cuda:0 --drafter-device cuda:1 > /tmp/plan.txt && head -n 4 /tmp/plan.txt
'
