"""What a drafter checkpoint is, without the drafter: its metadata, file names, errors, and the
two facts about a language model every drafter module needs (its layer stack, its vocabulary).

:mod:`d3d.model.drafter` and :mod:`d3d.model.checkpoint` both build on this module, and neither
needs the other to describe a drafter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn
from transformers import PreTrainedModel

from d3d.config import DEFAULT_BLOCK_SIZE

META_FILE = "drafter.json"
WEIGHTS_FILE = "drafter.safetensors"
# State-dict keys of the tensors a drafter borrows from its target (embeddings, LM head).
SHARED_KEYS = ("lm.model.embed_tokens.", "lm.lm_head.")
DRAFT_IDS_KEY = "draft_ids"
IGNORE_LABEL = -100


class DrafterError(RuntimeError):
    """A drafter cannot be built or loaded; the message says why."""


@dataclass(frozen=True)
class DrafterMeta:
    """What a drafter checkpoint was built from."""

    base: str
    layers: tuple[int, ...]
    block_size: int = DEFAULT_BLOCK_SIZE
    shared_embeddings: bool = True
    vocab_size: int = 0
    draft_vocab: int = 0  # 0: the whole vocabulary
    notes: dict = field(default_factory=dict)
    adapter: dict | None = None  # AdapterConfig.to_dict() of a gated-adapter drafter
    target_layers: int = 0  # depth of the model the layers come from (0: unknown)
    init: str | None = None  # the pretrained model it was initialised from (None: the target)

    def __post_init__(self) -> None:
        if self.block_size < 2:
            raise DrafterError(f"block_size must be >= 2, got {self.block_size}")
        if not self.layers:
            raise DrafterError("a drafter needs at least one layer")


def layer_stack(lm: PreTrainedModel) -> nn.ModuleList:
    base = getattr(lm, "model", None)
    layers = getattr(base, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise DrafterError(
            f"{type(lm).__name__} has no model.layers: only decoder-only LMs in the Llama/Qwen "
            "layout can be turned into a drafter"
        )
    return layers


def vocab_rows(model: PreTrainedModel) -> int:
    return int(model.get_output_embeddings().weight.shape[0])
