"""D3D: decoupled diffusion drafting for lossless speculative decoding and prompt compression."""

__version__ = "0.1.0"
