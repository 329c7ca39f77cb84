"""The models: loading a target, the D3D drafter and its parts.

- :mod:`~d3d.model.load`       a target + tokenizer (embedded default, HF id, folder, GGUF), straight
                               to its device and dtype; chat templates (non-thinking by default)
- :mod:`~d3d.model.drafter`    the drafter: mask embedding, one-forward block drafting
- :mod:`~d3d.model.adapters`   gated LoRA adapters, active only at a block's mask slots
- :mod:`~d3d.model.checkpoint` save / load drafters
- :mod:`~d3d.model.session`    a drafter's cache of one request's committed tokens, with rewind
- :mod:`~d3d.model.specs`      drafter specs (default, self:N, a checkpoint) and the layers they read
- :mod:`~d3d.model.skeleton`   models built on the meta device, then filled
- :mod:`~d3d.model.masks`      pure builders of 4D masks and position ids
- :mod:`~d3d.model.memory`     bytes of weights and KV; free device memory
- :mod:`~d3d.backends.cpu.packing`    float32 CPU linear maps prepacked for oneDNN
- :mod:`~d3d.backends.cpu.fused`      vLLM's one-pass CPU kernels for RMSNorm and rotary, where installed
- :mod:`~d3d.backends.cpu.attention` vLLM's CPU attention kernel over the engine's slabs
- :mod:`~d3d.backends.hf`         shims over transformers versions
"""
