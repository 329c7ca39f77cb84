"""The slab store: rows of one capacity side by side, moved whole, under one allocation bound;
and the grouped attention over a slab equal to each row's own attention."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from d3d.backends.cpu.groups import SPLIT_WIDTH, attend_group
from d3d.backends.kv import GROW, KvHooks, RowKV
from d3d.backends.ragged import ragged_attention
from d3d.backends.slabs import FIRST, Slab, next_capacity


def make_kv(
    max_tokens: int = 64 * GROW, layers: int = 2, keys_t: bool = False, cpu: bool = False
) -> RowKV:
    """A small KV; ``cpu``: with the CPU backend's attention paths (else PyTorch's)."""
    hooks = KvHooks(attend=attend_group) if cpu else None
    return RowKV(layers, 2, 4, torch.float32, "cpu", max_tokens, keys_t=keys_t, hooks=hooks)


def fill(kv: RowKV, row, n: int, seed: int) -> torch.Tensor:
    """Write n positions of random keys (values = keys + 1) into ``row``; returns the keys."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, 2, n, 4, generator=g)
    with torch.inference_mode():
        kv.begin([row], [n])
        for layer in range(kv.num_layers):
            kv.update(keys + layer, keys + layer + 1, layer)
        kv.commit(row, n)
    return keys


def test_next_capacity_doubles_in_grow_steps_and_stops_at_the_reservation():
    assert next_capacity(0, 5, 1000) == FIRST  # a new row
    assert next_capacity(0, 5, 2 * GROW - 3) == 2 * GROW  # a short request: all it reserved
    assert next_capacity(0, 5, FIRST + 81) == FIRST + 2 * GROW  # a chat: all of it, never moves
    assert next_capacity(FIRST, FIRST + 1, 10_000) == 2 * FIRST
    assert next_capacity(FIRST, FIRST + 1, FIRST + GROW + 5) == FIRST + 2 * GROW  # reservation
    assert next_capacity(0, 5 * FIRST, 5 * FIRST) == 5 * FIRST


@pytest.mark.parametrize("keys_t", [False, True])  # keys stored [S, Hkv, C, D] or [S, Hkv, D, C]
def test_rows_keep_their_keys_when_others_leave_or_they_grow(keys_t):
    kv = make_kv(keys_t=keys_t)
    rows = [kv.open(4 * FIRST) for _ in range(5)]
    keys = [fill(kv, r, 3 + i, seed=i) for i, r in enumerate(rows)]
    assert len({id(r.slab) for r in rows}) == 1  # one capacity, one slab
    kv.close(rows[1])  # the last row moves into its slot
    assert sorted(r.slot for r in rows if r is not rows[1]) == [0, 1, 2, 3]
    big = rows[2]
    more = fill(kv, big, FIRST, seed=9)  # grows: moves to the next slab with its keys
    assert big.capacity == 2 * FIRST and big.slab is not rows[0].slab
    with torch.inference_mode():
        for i, r in enumerate(rows):
            if i == 1:
                continue
            for layer in range(kv.num_layers):
                k, v = r.keys(layer, r.length)
                want = keys[i] if r is not big else torch.cat([keys[i], more], dim=2)
                assert torch.equal(k, want + layer) and torch.equal(v, want + layer + 1)


def test_a_burst_of_new_rows_grows_their_slab_once(monkeypatch):
    kv = make_kv(max_tokens=64 * FIRST)
    sizes = []
    real = Slab.resize
    monkeypatch.setattr(Slab, "resize", lambda self, n: sizes.append(n) or real(self, n))
    rows = [kv.open(FIRST + 81) for _ in range(20)]  # twenty chats admitted at once
    keys = [fill(kv, r, 2 + i, seed=i) for i, r in enumerate(rows)]
    assert sizes == [20] and len({id(r.slab) for r in rows}) == 1
    with torch.inference_mode():
        for r, want in zip(rows, keys, strict=True):  # each row's keys, and zeros after them
            assert torch.equal(r.keys(0, r.length)[0], want)
            assert not r.slab.k[0][r.slot, :, r.length :].any()
    late = kv.open(FIRST + 81)  # a full slab grows by doubling again
    fill(kv, late, 3, seed=99)
    assert sizes == [20, 40]


def test_the_slabs_never_allocate_past_the_bound():
    kv = make_kv(max_tokens=8 * GROW)
    rows = [kv.open(GROW) for _ in range(8)]
    for i, r in enumerate(rows):
        fill(kv, r, 1, seed=i)
        assert kv.allocated_bytes <= kv.bound_tokens() * kv.bytes_per_token
    for r in rows[:6]:
        kv.close(r)
    big = kv.open(6 * GROW)  # needs the room the closed rows' free slots held
    fill(kv, big, 5 * GROW, seed=1)
    assert big.capacity == 6 * GROW
    assert (
        kv.allocated_bytes
        <= kv.bound_tokens() * kv.bytes_per_token
        == 8 * GROW * kv.bytes_per_token
    )
    for r in [*rows[6:], big]:
        kv.close(r)
    assert kv.store.slabs  # free slots are kept for the next rows ...
    kv.trim()
    assert kv.allocated_bytes == 0 and not kv.store.slabs  # ... until the engine is idle


WIDE = SPLIT_WIDTH + 5  # a prompt's chunk: attended split at the row's cached length


@pytest.mark.parametrize("cpu", [False, True])  # the reference's attention, the CPU backend's
@pytest.mark.parametrize("gqa", [False, True])
@pytest.mark.parametrize(
    "widths",
    [
        [1, 3, 1, 1, 3],  # one-token rows, and blocks of three (one of them not in a run)
        [1, WIDE, 1, WIDE, 3],  # two prompt chunks of one width among decoding rows
    ],
)
def test_rows_of_one_width_attend_as_one_group_exactly_as_each_alone(gqa, widths, cpu):
    kv = make_kv(layers=1, cpu=cpu)
    rows = [kv.open(4 * GROW) for _ in range(4)]
    for i, r in enumerate(rows):
        fill(kv, r, 5 + 7 * i, seed=i)
    hq = 4 if gqa else 2

    class Layer(torch.nn.Module):
        layer_idx = 0

    rows.append(kv.open(4 * GROW))
    fill(kv, rows[-1], 9, seed=7)
    rows.append(kv.open(4 * GROW))  # a prompt's first chunk: no cached keys
    widths = [*widths, WIDE]
    with torch.inference_mode():
        pos, batch = kv.begin(rows, widths)
        n = pos.shape[1]
        new_k = torch.randn(1, 2, n, 4)
        kv.update(new_k, new_k + 1, 0)
        assert sorted(g.width for g in batch.groups) == sorted(set(widths))  # one per width
        q = torch.randn(1, hq, n, 4)
        out = ragged_attention(Layer(), q, new_k, new_k + 1, batch)  # [1, N, Hq, D]
        assert_each_row_alone(out, q, rows, widths, atol=1e-6)


def assert_each_row_alone(out, q, rows, widths, atol: float) -> None:
    """``out`` [1, N, Hq, D] holds each row's attention (q [1, Hq, N, D]) as if it were alone."""
    starts = [sum(widths[:i]) for i in range(len(widths))]
    for r, s, w in zip(rows, starts, widths, strict=True):
        k, v = r.keys(0, r.length + w)
        mask = torch.arange(r.length + w)[None, :] <= (r.length + torch.arange(w))[:, None]
        alone = F.scaled_dot_product_attention(
            q[:, :, s : s + w], k, v, mask, enable_gqa=q.shape[1] != k.shape[1]
        ).transpose(1, 2)
        torch.testing.assert_close(out[:, s : s + w], alone, rtol=1e-5, atol=atol)


def test_a_new_slot_reads_as_finite():
    """A slab's new slots are zeros, so the masked tail that a group's attention reads past a
    short row's length (0 x NaN is NaN) is finite."""
    kv = make_kv(layers=1)
    a = kv.open(GROW)
    fill(kv, a, 3, seed=0)
    a.slab.resize(4)
    b = kv.open(GROW)
    fill(kv, b, 1, seed=1)

    class Layer(torch.nn.Module):
        layer_idx = 0

    with torch.inference_mode():
        _pos, batch = kv.begin([a, b], [1, 1])
        new_k = torch.randn(1, 2, 2, 4)
        kv.update(new_k, new_k, 0)
        out = ragged_attention(Layer(), torch.randn(1, 2, 2, 4), new_k, new_k, batch)
    assert batch.groups[0].n > b.length + 1  # b's slot is read past its length
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("keys_t", [False, True])
def test_a_snapshot_loads_back_into_another_row(keys_t):
    kv = make_kv(keys_t=keys_t)
    row = kv.open(2 * FIRST)
    keys = fill(kv, row, 11, seed=3)
    twin = kv.open(2 * FIRST)
    with torch.inference_mode():
        kv.load(twin, kv.snapshot(row))
        for layer in range(kv.num_layers):
            k, v = twin.keys(layer, twin.length)
            assert torch.equal(k, keys + layer) and torch.equal(v, keys + layer + 1)
