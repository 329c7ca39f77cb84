"""The CUDA backend's decode step: a Llama-family forward over rows in fixed slots, written so
that one call can be captured as a CUDA graph and replayed.

A decode step is B rows (the KV's slots 0 .. B-1) that each add T tokens (1: a plain step; K+1:
an anchor and its drafts). Everything the step reads is a tensor at a fixed address
(:class:`StepInputs`: ids, positions and each slot's cached length), and the KV is one tensor
per layer and key / value, ``[S, Hkv, C, D]`` (:mod:`d3d.backends.cuda.kv`), so a replay reads
the current values of both. The step, per layer::

    x = norm_in(h)
    q, k, v = x Wq, x Wk, x Wv              (Qwen3: per-head RMSNorm of q and k)
    rotate q, k at their positions          the model's own rotary table and rule
    K[slot, :, pos] = k; V[...] = v         the new keys land after each row's length
    h += attend(q, K[:B, :, :n], V[...]) Wo  a row's query t sees its keys 0 .. length + t
    h += mlp(norm_post(h))

and the final norm; the LM head runs outside (:meth:`StaticForward.head`) on the positions that
need logits only, so a graph's output is the hidden states [B*T, H], not [B*T, V].

Attention reads the first n positions of the B slots in place (n covers the longest row, in a
few graph shapes per doubling, :func:`attended`), the G = Hq / Hkv query heads that share a key
head stacked as one matrix of G*T queries against it (each key is read once, no repeated KV),
masked by what each query sees (its keys before a limit; a drafter's block also a band of its
own slots, :meth:`StaticForward.seen`): one ``scaled_dot_product_attention`` call per layer for
the whole step. The split attention kernel reads those bounds instead and n plays no part
(:attr:`StaticForward.reads_lengths`): then one graph per (B, T) serves every context.

The model's own weights and modules compute everything else, in the model's forms or, where a
sample at load proves them equal, fused forms with fewer kernels (:mod:`d3d.backends.cuda.fused`:
torch's one-kernel ``rms_norm``, q and k rotated together, one product for q, k, v and one for
gate, up where the backend's ``prepare`` laid their weights out in one storage); ``fused=False``
keeps the model's forms throughout. Where Triton can run (a GPU), four kernels take the chains
between the products and the attention (:mod:`d3d.backends.cuda.kernels`: the residual add with
the next norm; q and k's norms, rotation and KV writes with q's layout; the MLP's activation;
attention split over the keys, read by row lengths instead of a mask), each where a sample on
the model's device and dtype agrees with the torch forms it replaces (:class:`Kernels` says
which; ``kernels=False`` keeps the torch forms): 24 operations a Qwen3 layer become 11
launches.
The numbers are the model's own up to rounding; only the attention and the KV writes are this
module's. :func:`unfit` says why a model cannot run it.

Letters: B rows (slots), T new tokens a row, N = B*T, S slots, C a slot's capacity, n keys
attended, H hidden, Hq / Hkv heads, G = Hq / Hkv, D head dim, M kept positions, V vocab.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from d3d.backends.cuda.fused import laid_out, mlp_of, norm_of, own_rope, rope_of
from d3d.backends.cuda.taken import Kernels, take

STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # tables that do not depend on length
MIN_ATTENDED = 256  # the fewest keys a step attends, and the finest step of n


@dataclass(frozen=True)
class StepInputs:
    """A decode step's inputs at fixed addresses: ids and positions [B, T], lengths [B] (each
    slot's cached tokens: its new keys go to positions length .. length + T - 1)."""

    ids: torch.Tensor
    positions: torch.Tensor
    lengths: torch.Tensor

    @classmethod
    def empty(cls, rows: int, width: int, device: torch.device) -> StepInputs:
        z = lambda *s: torch.zeros(*s, dtype=torch.long, device=device)  # noqa: E731
        return cls(z(rows, width), z(rows, width), z(rows))

    def fill(self, ids: torch.Tensor, lengths: torch.Tensor) -> None:
        """Copy a step's ids [B, T] and lengths [B] in (positions follow from the lengths)."""
        t = torch.arange(self.ids.shape[1], device=self.ids.device)
        self.ids.copy_(ids, non_blocking=True)
        self.lengths.copy_(lengths, non_blocking=True)
        torch.add(self.lengths[:, None], t[None, :], out=self.positions)


def attended(longest: int, capacity: int) -> int:
    """Keys a step attends: ``longest`` (a row's length plus its new tokens) rounded up to a
    quarter of its octave, in steps of at least :data:`MIN_ATTENDED` (at most ``capacity``):
    four graph shapes per doubling of the context, and at most a quarter (or 255) more keys read
    than the longest row holds (a power of two read up to twice as many: 2,048 keys for a row of
    1,025)."""
    octave = MIN_ATTENDED
    while octave < longest:
        octave *= 2
    step = max(MIN_ATTENDED, octave // 8)  # longest lies in (octave / 2, octave]
    return min(max(-(-longest // step) * step, MIN_ATTENDED), capacity)


def unfit(model: nn.Module) -> str:
    """Why ``model`` cannot run :class:`StaticForward` ('' when it can)."""
    inner = getattr(model, "model", None)
    cfg = getattr(model, "config", None)
    layers = getattr(inner, "layers", None)
    if cfg is None or not layers or not hasattr(inner, "embed_tokens"):
        return "not a Llama-family model"
    rotary = getattr(inner, "rotary_emb", None)
    if rotary is None or getattr(inner, "norm", None) is None:
        return "no shared rotary embedding or final norm"
    rope = getattr(rotary, "rope_type", "default")
    if rope not in STATIC_ROPE:  # a table that depends on the length would sync in a graph
        return f"rotary embedding {rope!r}"
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        return "sliding-window attention"
    for layer in layers:
        a = getattr(layer, "self_attn", None)
        need = ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim", "scaling")
        if a is None or not all(hasattr(a, x) for x in need):
            return "an attention module of another form"
        if _rope_rule(a) is None:
            return "no apply_rotary_pos_emb in its modeling module"
        if not all(hasattr(layer, x) for x in ("input_layernorm", "post_attention_layernorm")):
            return "a decoder layer of another form"
        if getattr(layer, "attention_type", "full_attention") != "full_attention":
            return "a layer that is not full attention"
    return ""


def _rope_rule(attn: nn.Module) -> Callable | None:
    return getattr(sys.modules.get(type(attn).__module__), "apply_rotary_pos_emb", None)


class StaticForward:
    """A decode step of ``model`` over the slot KV ``keys`` / ``values`` (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        keys: list[torch.Tensor],
        values: list[torch.Tensor],
        fused: bool = True,
        kernels: bool = True,
    ):
        """``fused`` False: the model's own norms, rule, projections and MLP throughout (what the
        fused forms are measured against); ``kernels`` False: no Triton kernel (what they are
        measured against)."""
        inner = model.model
        self.inner = inner
        self.layers = list(inner.layers)
        self.head_module = model.get_output_embeddings()
        a = self.layers[0].self_attn
        cfg = model.config
        self.hq = cfg.num_attention_heads
        self.hkv = getattr(cfg, "num_key_value_heads", None) or self.hq
        self.d = a.head_dim
        self.scaling = a.scaling
        self.rope = _rope_rule(a)
        self.keys, self.values = keys, values  # per layer: [S, Hkv, C, D]
        # the model's norms and rotary rule, fused where a sample agrees (d3d.backends.cuda.fused)
        norm = norm_of if fused else (lambda m: m)
        self.norms = [
            (norm(x.input_layernorm), norm(x.post_attention_layernorm)) for x in self.layers
        ]
        self.qk_norms = [
            (norm(x.self_attn.q_norm), norm(x.self_attn.k_norm))
            if getattr(x.self_attn, "q_norm", None) is not None
            else None
            for x in self.layers
        ]
        self.final_norm = norm(inner.norm)
        # one product for q, k, v and one for gate, up where fuse_projections laid them out
        self.qkv = [laid_out(x, x.self_attn.q_proj) if fused else None for x in self.layers]
        self.mlps = [mlp_of(x) if fused else x.mlp for x in self.layers]
        first = next(model.parameters())
        self.dtype = dtype = first.dtype
        self.rotate = (
            rope_of(self.rope, inner.rotary_emb, dtype, self.hq, self.hkv, self.d)
            if fused
            else own_rope(self.rope)
        )
        device = first.device
        cuda = device.type == "cuda"
        self.sms = torch.cuda.get_device_properties(device).multi_processor_count if cuda else 4
        self.kernels = take(self, device) if fused and kernels else Kernels.none(len(self.layers))

    @torch.inference_mode()
    def __call__(self, x: StepInputs, n: int) -> torch.Tensor:
        """The step's hidden states after the final norm, [B*T, H]; writes the new keys."""
        t = x.ids.shape[1]
        ids, pos = x.ids.reshape(-1), x.positions.reshape(1, -1)  # [N], [1, N]
        # query t of a row sees the keys before length + t + 1: [B, T]
        limit = x.lengths[:, None] + torch.arange(1, t + 1, device=ids.device)
        h = self.inner.embed_tokens(ids)  # [N, H]
        return self.layers_over(h, pos, pos[0], limit, n)

    def layers_over(
        self,
        h: torch.Tensor,
        pos: torch.Tensor,
        at: torch.Tensor,
        limit: torch.Tensor,
        n: int,
        slots: torch.Tensor | None = None,
        band: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """The decoder layers and final norm over new tokens h [N, H] (N = B*T, row by row):
        rotary positions ``pos`` [1, N], each new key written at position ``at`` [N] of its
        row's slot, each query seeing its row's keys before ``limit`` [B, T] and, where
        ``band`` (lo, hi) [B, T] is given, its keys lo .. hi - 1 too (:meth:`seen`). The split
        attention kernel reads these bounds; SDPA attends the first n keys through a mask made
        from them. ``slots`` [B]: the rows' slots (None: slots 0 .. B-1, read in place; else
        gathered, an eager step's rows, SDPA). Returns [N, H]."""
        b, t = limit.shape
        hq, hkv, d = self.hq, self.hkv, self.d
        g = hq // hkv
        cos, sin = self.inner.rotary_emb(h[None], pos)  # [1, N, D] each
        rows = torch.arange(b, device=h.device) if slots is None else slots
        write = rows.repeat_interleave(t)  # [N]: each new key's slot
        k = self.kernels
        split = k.attend and slots is None  # the split attention kernel
        if not split:
            mask = self.mask(self.seen(limit, band, n), h.dtype)
        x = (self.norms[0][0] if self.layers else self.final_norm)(h)
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            shape = (b, t, hq, hkv, d)
            if k.qk_in[i]:  # norms, rotation, KV writes and q's layout in one kernel
                qkv = F.linear(x, self.qkv[i])
                qb = k.module.qk_in(qkv, self.qk_norm_args(i), cos[0], sin[0], self.keys[i],
                                    self.values[i], write, at, shape)  # fmt: skip
            else:
                if self.qkv[i] is not None:
                    q, kk, v = F.linear(x, self.qkv[i]).split([hq * d, hkv * d, hkv * d], -1)
                else:
                    q, kk, v = a.q_proj(x), a.k_proj(x), a.v_proj(x)
                qb = self.qk_torch(i, (q, kk, v), cos, sin, (self.keys[i], self.values[i]),
                                   write, at, shape)  # fmt: skip
            if slots is None:  # [B, Hkv, n, D], in place
                kb = self.keys[i].narrow(0, 0, b).narrow(2, 0, n)
                vb = self.values[i].narrow(0, 0, b).narrow(2, 0, n)
            else:
                kb = self.keys[i].narrow(2, 0, n).index_select(0, slots)
                vb = self.values[i].narrow(2, 0, n).index_select(0, slots)
            if split:
                o = k.module.attend(qb, self.keys[i], self.values[i], limit, self.scaling,
                                    self.splits(b, g * t), band)  # fmt: skip
            else:
                o = F.scaled_dot_product_attention(qb, kb, vb, mask, scale=self.scaling)
            o = o.view(b, hkv, g, t, d).permute(0, 3, 1, 2, 4).reshape(b * t, hq * d)
            h, x = self.residual(h, a.o_proj(o), self.norms[i][1])
            last = i + 1 == len(self.layers)
            nxt = self.final_norm if last else self.norms[i + 1][0]
            h, x = self.residual(h, self.mlp_out(i, x), nxt)
        return x

    def qk_torch(self, i: int, qkv: tuple[torch.Tensor, ...], cos: torch.Tensor,
                 sin: torch.Tensor, cache: tuple[torch.Tensor, torch.Tensor],
                 write: torch.Tensor, at: torch.Tensor,
                 shape: tuple[int, int, int, int, int]) -> torch.Tensor:  # fmt: skip
        """Layer i's q, k, v [N, *] normed (Qwen3) and rotated, the keys and values written into
        ``cache`` (keys, values [S, Hkv, C, D]) at ``at`` [N] of slots ``write`` [N]: q as
        attention reads it, [B, Hkv, G*T, D] (what :func:`d3d.backends.cuda.kernels.qk_in` does
        in one kernel)."""
        b, t, hq, hkv, d = shape
        g = hq // hkv
        q, k, v = qkv
        q, k, v = q.view(b * t, hq, d), k.view(b * t, hkv, d), v.view(b * t, hkv, d)
        if self.qk_norms[i] is not None:
            q, k = self.qk_norms[i][0](q), self.qk_norms[i][1](k)
        q, k = self.rotate(q, k, cos, sin)  # [N, Hq, D], [N, Hkv, D]
        cache[0][write, :, at] = k
        cache[1][write, :, at] = v
        # [N, Hq, D] -> [B, Hkv, G*T, D]: the query heads of a key head, row by row
        return q.reshape(b, t, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)

    def mlp_out(self, i: int, x: torch.Tensor) -> torch.Tensor:
        """Layer i's MLP of its normed input x [N, H] (the activation one kernel where taken)."""
        mlp = self.mlps[i]
        if self.kernels.silu_mul[i]:
            return mlp.down(self.kernels.module.silu_mul(F.linear(x, mlp.gate_up)))
        return mlp(x)

    def residual(self, h: torch.Tensor, delta: torch.Tensor,
                 norm: Callable) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """``h + delta`` and the next norm of it (one kernel where taken: h in place)."""
        if self.kernels.add_norm:
            return h, self.kernels.module.add_norm(h, delta, norm.weight, norm.eps)
        h = h + delta
        return h, norm(h)

    @staticmethod
    def seen(
        limit: torch.Tensor, band: tuple[torch.Tensor, torch.Tensor] | None, n: int
    ) -> torch.Tensor:
        """Which of the first n keys each query sees, [B, T, n] (True: may attend): the keys
        before ``limit`` [B, T], and the keys lo .. hi - 1 of ``band`` (lo, hi) [B, T] each."""
        j = torch.arange(n, device=limit.device)[None, None, :]
        sees = j < limit[:, :, None]
        if band is not None:
            sees = sees | ((j >= band[0][:, :, None]) & (j < band[1][:, :, None]))
        return sees

    def mask(self, sees: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """SDPA's additive mask [B, 1, G*T, n] for query (g, t) of a row from ``sees``
        [B, T, n] (made once a step, not by SDPA in every layer)."""
        b, t, n = sees.shape
        g = self.hq // self.hkv
        sees = sees[:, None, None].expand(b, 1, g, t, n).reshape(b, 1, g * t, n)
        return torch.zeros(sees.shape, dtype=dtype, device=sees.device).masked_fill_(
            ~sees, float("-inf")
        )

    def qk_norm_args(self, i: int) -> tuple[torch.Tensor, torch.Tensor, float] | None:
        """Layer i's per-head norms as :func:`d3d.backends.cuda.kernels.qk_in` takes them: q's
        weight, k's weight, eps (None: the model has none)."""
        qn = self.qk_norms[i]
        return (qn[0].weight, qn[1].weight, qn[0].eps) if qn is not None else None

    def splits(self, rows: int, queries: int) -> int:
        """Chunks the split attention cuts each row's keys into at ``rows`` rows of ``queries``
        queries a key head (G*T, in the kernel's tiles of at most 64): enough programs to keep
        every SM reading (two per SM), no more than a slot's 64-key tiles."""
        programs = rows * self.hkv * -(-queries // 64)
        return max(1, min(-(-self.keys[0].shape[2] // 64), -(-2 * self.sms // programs)))

    @property
    def reads_lengths(self) -> bool:
        """Whether the step's attention reads each query's bounds (the split kernel), so that
        the keys a step attends are no part of its shape: one graph per (rows, width) serves
        every context (the drafter's: per rows, chain width and blocks); else SDPA attends the
        first n keys, and n is part of the shape."""
        return self.kernels.attend

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits [M, V] of final hidden states [M, H]."""
        return self.head_module(hidden)
