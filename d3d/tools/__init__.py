"""Tools around the engine: ``d3d bench`` (forward costs), ``d3d plan`` (memory from configs),
and the GPU readiness check (``scripts/gpu_check.sh``)."""
