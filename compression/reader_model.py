"""How a reader model is built: the drafter itself, a copy of the target's first layers, an int8
copy of either, and the identity that names a reader's weights across processes.

The drafter-attention scorer (:mod:`compression.drafter_scorers`) reads documents with one of
these. An int8 copy (dynamic quantisation of the decoder layers' linear maps, CPU only) reads
about twice as fast; it shares the embeddings and LM head with the model it copies, and its
layers keep sharing their config object with the rest of the copy (the query pass switches the
attention implementation through it). :func:`weights_id` hashes samples of the first and last
reading layers, so a document reading stored on disk is reused only by a reader with the same
weights.
"""

from __future__ import annotations

import copy
import hashlib
import warnings
from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from d3d.config import DEFAULT_BLOCK_SIZE
from d3d.model.drafter import D3DDrafter


def quantize_layers(model: D3DDrafter) -> None:
    """Swap the decoder layers' linear maps for dynamic int8 ones, in place (CPU only)."""
    if model.device.type != "cpu":
        return
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.quantization import quantize_dynamic

        # In place: the layers must keep sharing the model's config object, which is how the
        # attention implementation is switched for the query pass.
        quantize_dynamic(model.lm.model.layers, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)


def weights_id(
    layers: Sequence[torch.nn.Module], mask_embedding: torch.Tensor, depth: int | None
) -> str:
    """A reader's identity across processes (document-cache keys on disk): a hash of the first
    and the last reading layers' weights (every tensor's shape and up to 4,096 evenly spaced
    values of it, so a large model on a GPU costs no copy of its layers) and the mask embedding."""
    n = len(layers) if depth is None else min(depth, len(layers))
    h = hashlib.sha256(f"{n}".encode())
    tensors = [
        (name, t)
        for layer in {0: layers[0], n - 1: layers[n - 1]}.values()
        for name, t in sorted(layer.state_dict().items())
        if isinstance(t, torch.Tensor) and t.is_floating_point()
    ]
    for name, t in [*tensors, ("mask", mask_embedding)]:
        flat = t.detach().reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)].float().cpu()
        h.update(f"{name}{tuple(t.shape)}".encode())
        h.update(sample.numpy().tobytes())
    return h.hexdigest()[:16]


def scoring_model(
    source: PreTrainedModel,
    layers: int | None,
    quantize: bool = False,
    block_size: int = DEFAULT_BLOCK_SIZE,
    mask_embedding: torch.Tensor | None = None,
) -> D3DDrafter:
    """The first ``layers`` layers of ``source`` (a target) as a model of their own (own config,
    shared embeddings and LM head), with the drafter's mask embedding; ``quantize``: int8 linear
    maps in its layers (about 2x faster prefill on CPU)."""
    n = len(source.model.layers)
    k = n if layers is None else min(layers, n)
    sub = D3DDrafter.from_target(source, k, block_size=block_size, base="scoring")
    if mask_embedding is not None:
        with torch.no_grad():
            sub.mask_embedding.copy_(mask_embedding)
    if quantize:
        quantize_layers(sub)
    return sub


def quantized_copy(drafter: D3DDrafter) -> D3DDrafter:
    """A copy of the drafter with int8 layers, still sharing the target's embeddings / LM head."""
    shared = {id(drafter.lm.get_input_embeddings()), id(drafter.lm.get_output_embeddings())}
    memo = {i: m for m in drafter.modules() if (i := id(m)) in shared}
    out = copy.deepcopy(drafter, memo)
    quantize_layers(out)
    return out
