"""Gated low-rank adapters: LoRA on a frozen LM's linear maps, active only at chosen rows.

Design:

- A drafter made of the target's own first L layers stays frozen; what it learns lives in
  low-rank adapters W x + (alpha/r) B A x on the attention and MLP projections, plus the mask
  embedding. The adapters act only at the rows a *gate* names (the block's mask slots), so every
  other row — the committed prefix and the block's anchor — computes exactly what the target's
  layers compute, and at full depth the anchor's output is the target's own next-token
  distribution.
- Written here rather than with ``peft``: peft's LoRA layers switch on or off per forward, not per
  token, and replace the wrapped modules (changing the LM's state-dict keys and module classes).
  Here the adapters are *forward hooks* on the LM's own ``nn.Linear`` modules: the LM stays a
  plain Hugging Face model (anything that reads ``drafter.lm`` — layer copies, compression
  scorers — sees ordinary weights and the target's computation), and the adapter tensors live
  beside it under their own state-dict keys, which is all a checkpoint stores.
- The gate is set for one forward by :meth:`GatedAdapters.gated`: ``None`` (or no row) leaves
  every output untouched, all rows adds the low-rank term everywhere, some rows add it times a
  0/1 row mask. The low-rank term over all rows costs next to nothing at rank 16; what costs is
  the number of small operations per projection, which the mask keeps lowest (a gather and a
  scatter per projection measured slower).
- B starts at zero: an untrained adapter computes exactly the frozen model.
- :func:`hide_gated_keys` keeps ungated rows blind to gated ones in a forward's own keys (the
  anchor then sees only the prefix and itself, as in the target's causal forward).

Letters: Q rows of one forward, KV keys, H hidden, r rank.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class AdapterConfig:
    """Rank, scale and the projection names (last module-name part) that get an adapter."""

    rank: int = 16
    alpha: float = 32.0
    targets: tuple[str, ...] = DEFAULT_TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank: must be >= 1, got {self.rank}")
        if self.alpha <= 0:
            raise ValueError(f"alpha: must be > 0, got {self.alpha}")
        if not self.targets:
            raise ValueError("targets: name at least one projection")

    def to_dict(self) -> dict:
        return {"rank": self.rank, "alpha": self.alpha, "targets": list(self.targets)}

    @classmethod
    def from_dict(cls, d: dict) -> AdapterConfig:
        return cls(rank=int(d["rank"]), alpha=float(d["alpha"]), targets=tuple(d["targets"]))


class LoRA(nn.Module):
    """The low-rank term (alpha/r) B A x of one linear map (d_in -> d_out)."""

    def __init__(self, d_in: int, d_out: int, rank: int, alpha: float):
        super().__init__()
        self.scale = alpha / rank
        self.A = nn.Parameter(torch.empty(rank, d_in))
        self.B = nn.Parameter(torch.zeros(d_out, rank))
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(F.linear(x, self.A.to(x.dtype)), self.B.to(x.dtype)) * self.scale


class _Hook:
    """Forward hook of one projection; an object (not a closure) so deep copies follow it."""

    def __init__(self, owner: GatedAdapters, key: str):
        self.owner, self.key = owner, key

    def __call__(self, module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        rows = self.owner.gate.rows
        if rows is None:
            return None  # the frozen layer's own output
        delta = self.owner.lora[self.key](args[0])
        if isinstance(rows, bool):  # every row
            return out + delta
        return out + delta * rows.to(delta.dtype)  # rows: [Q, 1] 0/1 mask


class _Gate(threading.local):
    """Which rows the adapters act at, one value per thread (copies start ungated)."""

    rows: torch.Tensor | bool | None = None

    def __deepcopy__(self, memo: dict) -> _Gate:
        return _Gate()

    def __reduce__(self):
        return (_Gate, ())


class GatedAdapters(nn.Module):
    """LoRA adapters hooked into the linear maps of ``layers`` (see the module docstring)."""

    def __init__(self, layers: nn.ModuleList, cfg: AdapterConfig):
        super().__init__()
        self.cfg = cfg
        self.lora = nn.ModuleDict()
        # The rows the adapters act at, per thread: the engine may draft on its own thread
        # while a thread worker drafts with the same drafter on another.
        self.gate = _Gate()
        found = set()
        for name, mod in layers.named_modules():
            last = name.rsplit(".", 1)[-1]
            if last in cfg.targets and isinstance(mod, nn.Linear):
                key = name.replace(".", "__")
                self.lora[key] = LoRA(mod.in_features, mod.out_features, cfg.rank, cfg.alpha)
                mod.register_forward_hook(_Hook(self, key))
                found.add(last)
        missing = set(cfg.targets) - found
        if missing:
            raise ValueError(f"no linear maps named {sorted(missing)} in the drafter's layers")

    @contextlib.contextmanager
    def gated(self, slots: torch.Tensor | None) -> Iterator[None]:
        """Adapters act at rows where ``slots`` [Q] is True for the forwards inside."""
        if slots is None or not bool(slots.any()):
            rows: torch.Tensor | bool | None = None
        elif bool(slots.all()):
            rows = True
        else:
            rows = slots.float().unsqueeze(-1)
        self.gate.rows = rows
        try:
            yield
        finally:
            self.gate.rows = None


def hide_gated_keys(
    mask: torch.Tensor | None, slots: torch.Tensor, cached: int
) -> torch.Tensor | None:
    """Block ungated query rows from gated keys among the forward's own rows.

    ``mask`` [..., Q, cached + Q] is boolean (True = may attend) or additive float; ``slots`` [Q].
    ``None`` stands for the model's causal mask, which is built here when it must change.
    """
    q = int(slots.numel())
    hide = (~slots).unsqueeze(1) & slots.unsqueeze(0)  # [Q, Q]: real query, gated key
    if not bool(hide.any()):
        return mask
    if mask is None:
        k = torch.arange(cached + q, device=slots.device)
        mask = (k.unsqueeze(0) <= k[cached:].unsqueeze(1)).view(1, 1, q, cached + q)
    full = torch.zeros(q, mask.shape[-1], dtype=torch.bool, device=mask.device)
    full[:, mask.shape[-1] - q :] = hide.to(mask.device)
    if mask.dtype == torch.bool:
        return mask & ~full
    return mask.masked_fill(full, torch.finfo(mask.dtype).min)
