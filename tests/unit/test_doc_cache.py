"""The document cache: content keys, the size-bounded memory tier, the disk tier shared by a
later process (pure, milliseconds)."""

from __future__ import annotations

import torch

from compression.doc_cache import DocumentCache, DocumentReading, WindowCache, content_key


def test_document_cache_is_a_size_bounded_lru():
    from transformers import DynamicCache

    def reading(key: str, tokens: int) -> DocumentReading:
        cache = DynamicCache()
        cache.update(torch.zeros(1, 1, tokens, 4), torch.zeros(1, 1, tokens, 4), 0)
        return DocumentReading(key, (1,), (2,), (WindowCache(0, 1, cache),))

    assert content_key("r", [1, 2], [3]) != content_key("r", [1], [2, 3])
    assert content_key("r", [1, 2]) != content_key("s", [1, 2])
    per = reading("a", 8).nbytes  # 2 tensors x 8 x 4 floats
    assert per == 2 * 8 * 4 * 4
    cache = DocumentCache(max_bytes=2 * per, max_entries=8)
    cache.put(reading("a", 8))
    cache.put(reading("b", 8))
    assert cache.get("a") is not None  # a is now the most recent
    cache.put(reading("c", 8))  # over the byte bound: b (least recent) goes
    assert "b" not in cache and "a" in cache and "c" in cache
    cache.put(reading("huge", 100))  # larger than the whole cache: not kept
    assert "huge" not in cache and len(cache) == 2
    assert cache.get("b") is None and cache.stats()["hits"] == 1 and cache.stats()["misses"] == 1
    small = DocumentCache(max_entries=1)
    small.put(reading("a", 1))
    small.put(reading("b", 1))
    assert list(small._items) == ["b"]


def test_document_cache_disk_tier_serves_a_later_process_and_stays_bounded(tmp_path):
    from transformers import DynamicCache

    def reading(key: str, tokens: int, seed: int = 0) -> DocumentReading:
        g = torch.Generator().manual_seed(seed)
        cache = DynamicCache()
        for layer in range(2):
            k, v = (
                torch.randn(1, 2, tokens, 4, generator=g),
                torch.randn(1, 2, tokens, 4, generator=g),
            )
            cache.update(k, v, layer)
        return DocumentReading(key, (1, 2), tuple(range(tokens)), (WindowCache(0, tokens, cache),))

    first = DocumentCache(directory=tmp_path)
    a = reading("a", 8)
    first.put(a)
    first.flush()
    assert (tmp_path / "a.pt").is_file() and not list(tmp_path.glob("*.tmp"))
    later = DocumentCache(directory=tmp_path)  # a new process: nothing in memory
    assert "a" in later and "b" not in later
    got = later.get("a")
    assert got is not None and later.stats()["disk_hits"] == 1
    assert got.prefix == a.prefix and got.context == a.context
    for x, y in zip(got.windows[0].cache.layers, a.windows[0].cache.layers, strict=True):
        assert torch.equal(x.keys, y.keys) and torch.equal(x.values, y.values)
    assert later.get("a") is got  # now from memory
    assert later.get("missing") is None
    (tmp_path / "bad.pt").write_bytes(b"not a torch file")
    assert later.get("bad") is None  # a damaged file is ignored, not fatal
    per = (tmp_path / "a.pt").stat().st_size
    small = DocumentCache(directory=tmp_path / "small", max_disk_bytes=int(2.5 * per))
    for i, key in enumerate("bcde"):
        small.put(reading(key, 8, seed=i))
        small.flush()
    assert sorted(p.stem for p in (tmp_path / "small").glob("*.pt")) == ["d", "e"]
    small.clear()
    small.clear_disk()
    assert small.get("e") is None and not list((tmp_path / "small").glob("*.pt"))


def test_a_disk_write_keeps_the_reading_as_put_while_queries_use_its_cache(tmp_path, monkeypatch):
    """Query passes append to a window's cache and crop it again while the file is still being
    written (a slow disk here): the file holds the document pass as it was put, every layer the
    same length."""
    import threading

    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in range(2):
        cache.update(torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4), layer)
    reading = DocumentReading("r", (1,), tuple(range(8)), (WindowCache(0, 8, cache),))
    expected = [layer.keys.clone() for layer in cache.layers]
    go, write = threading.Event(), DocumentCache._write
    monkeypatch.setattr(DocumentCache, "_write", lambda *a: (go.wait(5), write(*a)))
    store = DocumentCache(directory=tmp_path)
    store.put(reading)
    for layer in range(2):  # a query pass: one more position on each layer, the file unwritten
        cache.update(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), layer)
    go.set()
    store.flush()
    cache.crop(-3)
    got = DocumentCache(directory=tmp_path).get("r")
    assert got is not None
    for x, y in zip(got.windows[0].cache.layers, expected, strict=True):
        assert torch.equal(x.keys, y)
