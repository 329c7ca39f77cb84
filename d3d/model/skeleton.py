"""Models built on the meta device and then filled, so no tensor is allocated only to be dropped.

At Qwen3-8B scale a vocabulary-sized matrix (151,936 x 4,096) is 1.2 GB in bf16; a random one
built by ``from_config`` and then replaced by the target's costs that much for nothing, and a
head copied on one device before being moved to another costs it twice. Every construction here
starts from a skeleton on the meta device (shapes, no storage) and gives each parameter exactly
one tensor:

- :func:`layers_lm` — an LM of some of a target's decoder layers: by reference (the target's own
  tensors, frozen: adapter drafters, and drafters that only run inference), or copied straight
  to the drafter's device (drafters trained in full). Embeddings and LM head are the target's
  modules; :meth:`d3d.model.drafter.D3DDrafter.place` copies them, once, where the drafter goes.
- :func:`load_partial` — a target whose embeddings, LM head, final norm and *chosen* decoder
  layers are read from its safetensors files, tensor by tensor, straight to the device in the
  wanted dtype; the other layers stay on the meta device. A drafter process needs nothing else.
- :func:`pretrained_lm` — a whole pretrained causal LM (a drafter initialised from another model
  than its target), read by transformers straight to the drafter's device (its device map builds
  the model on the meta device and fills it from the files).
- :func:`finish` — the non-persistent buffers (rotary frequencies) a skeleton lacks, and the check
  that nothing needed is left on the meta device.

On a CPU a float tensor read from safetensors in its stored dtype is a view of the memory-mapped
file (no copy); another dtype or device costs one tensor of the final size.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def meta_lm(config, dtype: torch.dtype, attn: str | None = None) -> PreTrainedModel:
    """A causal LM of ``config`` on the meta device: every shape, no storage."""
    kwargs = {"dtype": dtype}
    if attn is not None:
        kwargs["attn_implementation"] = attn
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, **kwargs)


def pretrained_lm(
    spec: str, device: str | torch.device, dtype: torch.dtype, attn: str | None = None
) -> PreTrainedModel:
    """A pretrained causal LM (Hugging Face id or folder) on ``device`` in ``dtype``, never built
    on the CPU first."""
    kwargs: dict = {"dtype": dtype, "device_map": {"": str(device)}}
    if attn is not None:
        kwargs["attn_implementation"] = attn
    return AutoModelForCausalLM.from_pretrained(spec, **kwargs).eval()


def finish(
    lm: PreTrainedModel,
    device: str | torch.device,
    allow: Sequence[str] = (),
    rotary: nn.Module | None = None,
) -> None:
    """Give a filled skeleton its rotary frequencies on ``device`` (non-persistent buffers are in
    no checkpoint): a copy of ``rotary`` (a target's, so a drafter of its layers computes what
    it computes, float32 frequencies included), else built from the config; then fail if a
    tensor outside the ``allow`` name prefixes is still meta."""
    rot = getattr(lm.model, "rotary_emb", None)
    if rot is not None:
        new = copy.deepcopy(rotary) if rotary is not None else type(rot)(config=lm.config)
        lm.model.rotary_emb = new.to(device)
    left = [
        n
        for n, t in [*lm.named_parameters(), *lm.named_buffers()]
        if t.is_meta and not n.startswith(tuple(allow))
    ]
    if left and torch.device(device).type != "meta":
        raise ValueError(f"tensors left unfilled on the meta device: {left[:3]}")


def layers_lm(
    target: PreTrainedModel,
    idx: Sequence[int],
    config,
    copy_to: str | torch.device | None = None,
) -> PreTrainedModel:
    """A causal LM of the target's decoder layers ``idx`` and final norm (``config``: the target's
    with ``len(idx)`` layers), embeddings and LM head the target's own modules.

    ``copy_to`` None: the layers' tensors *are* the target's (``assign=True``: no second copy in
    one process), frozen. Else each tensor is copied once, straight to ``copy_to``, trainable.
    Either way its module objects are its own, so hooks, ``.to()`` and placement on another device
    never touch the target.
    """
    lm = meta_lm(config, target.dtype, target.config._attn_implementation)
    src = target.model.layers

    def state(module: nn.Module) -> dict[str, torch.Tensor]:
        sd = module.state_dict()
        return sd if copy_to is None else {k: v.to(copy_to, copy=True) for k, v in sd.items()}

    for j, i in enumerate(idx):
        lm.model.layers[j].load_state_dict(state(src[i]), assign=True)
    lm.model.norm.load_state_dict(state(target.model.norm), assign=True)
    if copy_to is None:
        lm.requires_grad_(False)  # before the target's modules join: theirs stay as they are
    lm.set_input_embeddings(target.get_input_embeddings())
    lm.set_output_embeddings(target.get_output_embeddings())
    finish(lm, target.device if copy_to is None else copy_to, rotary=target.model.rotary_emb)
    return lm


def weight_files(folder: Path) -> dict[str, Path] | None:
    """Tensor name -> safetensors file of a model folder (None: no safetensors weights)."""
    index = folder / INDEX_FILE
    if index.is_file():
        names = json.loads(index.read_text())["weight_map"]
        return {k: folder / v for k, v in names.items()}
    single = folder / SINGLE_FILE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    return None


def read_tensors(
    files: dict[str, Path], names: Iterable[str], device: str | torch.device, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The named tensors, each read once, straight to ``device``; floating ones in ``dtype``."""
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in names:
        by_file.setdefault(files[name], []).append(name)
    for path, group in by_file.items():
        with safe_open(str(path), framework="pt") as f:
            for name in group:
                t = f.get_tensor(name)  # CPU: a view of the mapped file
                out[name] = t.to(device, dtype if t.is_floating_point() else t.dtype)
    return out


def load_partial(
    folder: str | Path,
    layers: Iterable[int],
    device: str | torch.device,
    dtype: torch.dtype,
    attn: str = "sdpa",
) -> PreTrainedModel | None:
    """A target with only its embeddings, LM head, final norm and decoder ``layers`` filled from
    the folder's safetensors (the others stay on meta); None where the folder cannot serve that
    (no safetensors, or names that differ from the model's), so the caller loads it whole."""
    folder = Path(folder)
    files = weight_files(folder)
    if files is None:
        return None
    config = AutoConfig.from_pretrained(folder)
    model = meta_lm(config, dtype, attn)
    keep = {int(i) for i in layers}
    skip = tuple(f"model.layers.{i}." for i in range(len(model.model.layers)) if i not in keep)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})  # aliases, never read
    need = [k for k in model.state_dict() if not k.startswith(skip) and k not in tied]
    if any(k not in files for k in need):
        return None
    model.load_state_dict(read_tensors(files, need, device, dtype), strict=False, assign=True)
    if tied:
        model.tie_weights()
    finish(model, device, allow=skip)
    model.eval().requires_grad_(False)
    return model
