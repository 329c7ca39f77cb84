"""Continuous batching: many requests share every target forward.

:class:`BatchEngine` runs on one thread (the engine worker). Each :meth:`step`:

1. drops cancelled rows;
2. admits waiting requests between rounds (continuous batching): their prompts are prefilled
   together in padded chunks into fresh cache slots, and each gets its first token; a prompt
   prefix that requests share (document QA: the instruction and the document's head) comes from
   the prefix cache when it holds it;
3. runs one round for every running row in ONE target forward: the speculation policy
   (:mod:`d3d.batching.policy`) decides from measured costs which rows draft; speculating rows
   send ``[anchor, d_1..d_K]``; an ``auto`` row that does not draft may send a copy of its own
   text instead where the policy finds it pays (:func:`d3d.batching.policy.choose_copies`, a
   one-hot draft: still exact); the others send ``[anchor]`` (padded); each row accepts with
   :mod:`d3d.verify`'s rules (or picks one token), commits what it accepted to its own cache row
   (rollback = not committing), and emits;
4. finishes rows that hit EOS or their budget, and packs the live rows to the front slots.

Rows keep the invariants of :mod:`d3d.decode` (the cache holds committed tokens except the last;
the last token of every round comes from the target), so each row's greedy output is what plain
greedy decoding of the target gives, whatever else shares the batch.

Letters: n running rows, T new tokens per row, K draft length, V vocab.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Sequence

import torch

from d3d.batching.policy import AUTO, CostModel, Plan, RunningMean, choose_copies, decide, row_kind
from d3d.batching.request import GenRequest, Row
from d3d.batching.target import BatchTarget
from d3d.decode import DecodeStats, Drafter, Round, _clip
from d3d.kv_store import PrefixCache
from d3d.lookup import BUCKETS, CopyCosts, CopyDraft, find_copy, one_hot_q
from d3d.sampling import make_generator, pick, probabilities
from d3d.verify import greedy_accept, stochastic_accept

log = logging.getLogger(__name__)


class BatchEngine:
    """A target (and optional drafter) serving many requests at once (see the module docstring)."""

    def __init__(
        self,
        model,
        eos_ids: set[int],
        drafter: Drafter | None = None,
        block_size: int = 16,
        max_batch: int = 32,
        prefill_chunk: int = 512,
        prefill_budget: int = 4096,
        window: int | None = None,
        prefix_cache: PrefixCache | None = None,
        copy: bool = True,
    ):
        """``prefix_cache``: the target's KV of prompt prefixes requests share
        (:attr:`GenRequest.shared_prefix`); None encodes every prompt whole. ``copy``: ``auto``
        rows may verify copies of their own text (:mod:`d3d.lookup`)."""
        self.target = BatchTarget(model)
        self.prefix_cache = prefix_cache
        self.eos_ids = set(eos_ids)
        self.drafter = drafter
        self.block_size = int(getattr(drafter, "block_size", block_size)) if drafter else block_size
        self.max_batch = max_batch
        self.prefill_chunk = prefill_chunk
        self.prefill_budget = prefill_budget
        self.window = window or getattr(model.config, "max_position_embeddings", None)
        self.costs = CostModel()
        self.copy = copy
        self.copy_costs = CopyCosts()
        self.acceptance = RunningMean(decay=0.95)
        self.waiting: deque[GenRequest] = deque()
        self.rows: list[Row] = []  # rows[i].slot == i
        self.last_plan = Plan([])

    # -- intake --------------------------------------------------------------------------------
    def check(self, req: GenRequest) -> None:
        """Raise ValueError naming the problem if ``req`` can never run."""
        if not req.prompt_ids:
            raise ValueError("the prompt is empty")
        if req.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        need = len(req.prompt_ids) + req.max_new_tokens + self.block_size
        if self.window and need > self.window:
            raise ValueError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) "
                f"exceeds the model's {self.window}-token window"
            )

    def add(self, req: GenRequest) -> None:
        """Queue a request; it joins the batch at the next step (raises ValueError if invalid)."""
        self.check(req)
        self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not self.rows and not self.waiting

    # -- one scheduling iteration --------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        """One iteration: drop cancelled rows, admit waiting requests, run one round."""
        try:
            self._drop_cancelled()
            self._admit()
            if self.rows:
                self._round()
        except Exception as exc:  # a failed forward fails its batch, never the worker
            log.exception("batched step failed; failing %d request(s)", len(self.rows))
            rows, self.rows = self.rows, []
            for row in rows:
                row.stats.stop_reason = "error"
                row.req.on_finish(row.stats, exc)
        if not self.rows and self.target.cache.rows:
            self.target.cache.release()

    def _drop_cancelled(self) -> None:
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            stats = DecodeStats(mode=req.mode, prompt_tokens=len(req.prompt_ids))
            stats.stop_reason = "cancelled"
            req.on_finish(stats, None)
        for row in [r for r in self.rows if r.req.cancelled]:
            self._finish(row, "cancelled")

    def _admit(self) -> None:
        group: list[GenRequest] = []
        while self.waiting and len(self.rows) + len(group) < self.max_batch:
            nxt = self.waiting[0]
            width = max([len(r.prompt_ids) for r in group] + [len(nxt.prompt_ids)])
            if group and width * (len(group) + 1) > self.prefill_budget:
                break
            group.append(self.waiting.popleft())
        if group:
            self._prefill(group)

    def _prefill(self, group: list[GenRequest]) -> None:
        """Prefill a group into fresh slots. A request naming a shared prefix encodes it on its
        own first (or copies its KV from the prefix cache), then the rest, so it computes the
        same whether or not the prefix was cached (as :meth:`d3d.decode.TargetSession.prefill`)."""
        start = len(self.rows)
        for b, req in enumerate(group):
            stats = DecodeStats(mode=req.mode, prompt_tokens=len(req.prompt_ids))
            gen = make_generator(req.sampling, self.target.device)
            self.rows.append(Row(req, start + b, list(req.prompt_ids), stats, gen))
        t0 = time.perf_counter()
        rows = self.rows[start:]
        first: list[list[int]] = []  # what each row encodes in the first pass
        second: list[list[int]] = []  # and after its prefix was stored
        for row in rows:
            ids, shared = row.req.prompt_ids, row.req.shared_prefix
            if self.prefix_cache is None or not 0 < shared < len(ids):
                first.append(list(ids))
                second.append([])
            elif self._reuse_prefix(row, ids[:shared]):
                first.append(list(ids[shared:]))
                second.append([])
            else:
                first.append(list(ids[:shared]))
                second.append(list(ids[shared:]))
        last = self._encode(start, first, [not s for s in second])
        for row, rest in zip(rows, second, strict=True):
            if rest:
                self._store_prefix(row)
        if any(second):
            more = self._encode(start, second, [bool(s) for s in second])
            last = [m if s else x for x, m, s in zip(last, more, second, strict=True)]
        seconds = time.perf_counter() - t0
        for b, row in enumerate(rows):
            row.stats.prefill_seconds = seconds
            first_token = pick(last[b], row.req.sampling, row.generator)  # type: ignore[arg-type]
            row.first_token_at = time.perf_counter()
            self._emit(row, [first_token])
        self._sweep()

    def _encode(
        self, start: int, runs: Sequence[Sequence[int]], want: Sequence[bool]
    ) -> list[torch.Tensor | None]:
        """Append ``runs[b]`` to slot ``start + b`` in padded chunks (an empty run sits out);
        the logits [V] after each run's last token where ``want[b]``."""
        last: list[torch.Tensor | None] = [None] * len(runs)
        longest = max(len(r) for r in runs)
        for c in range(0, longest, self.prefill_chunk):
            pieces = [list(r[c : c + self.prefill_chunk]) or [0] for r in runs]
            ends = {len(r) - 1 - c for r, w in zip(runs, want, strict=True) if w}
            keep = sorted(e for e in ends if 0 <= e < self.prefill_chunk)
            logits = self.target.forward(start, pieces, keep or [0])  # [n, len(keep), V]
            width = max(len(p) for p in pieces)
            self.costs.observe_forward(len(runs), width, self.target.last_seconds)
            for b, run in enumerate(runs):
                self.target.cache.commit(start + b, max(0, min(self.prefill_chunk, len(run) - c)))
                end = len(run) - 1 - c
                if want[b] and 0 <= end < self.prefill_chunk:
                    last[b] = logits[b, keep.index(end)]
        return last

    def _reuse_prefix(self, row: Row, prefix: Sequence[int]) -> bool:
        """Copy a cached prefix's KV into the row's slot; False when it is not cached."""
        assert self.prefix_cache is not None
        cached = self.prefix_cache.lookup(prefix)
        if cached is None:
            return False
        self.target.cache.load(row.slot, cached)
        row.stats.cached_prompt_tokens = len(prefix)
        return True

    def _store_prefix(self, row: Row) -> None:
        assert self.prefix_cache is not None
        prefix = row.req.prompt_ids[: row.req.shared_prefix]
        self.prefix_cache.store(prefix, self.target.cache.snapshot(row.slot))

    def _round(self) -> None:
        rows = self.rows
        kinds = [row_kind(r.req.mode) for r in rows]
        prior = self.acceptance.value or 1.0
        acc = [r.acceptance if r.acceptance is not None else prior for r in rows]
        plan = decide(kinds, acc, self.block_size, self.costs, self.drafter is not None)
        self.last_plan = plan
        drafts, draft_s = self._draft(rows, plan.speculate)
        if self.copy:
            self._copies(rows, kinds, drafts)
        ids = [
            [r.tokens[-1], *(drafts[i].tokens.tolist() if drafts[i] else [])]
            for i, r in enumerate(rows)
        ]
        logits = self.target.forward(0, ids)  # [n, T, V]
        forward_s = self.target.last_seconds
        self.costs.observe_forward(len(rows), max(len(x) for x in ids), forward_s)
        for i, row in enumerate(list(rows)):
            d = drafts[i]
            if d is None:
                token = pick(logits[i, 0], row.req.sampling, row.generator)
                rnd = Round([token], verify_s=forward_s)
            else:
                rnd = self._accept(
                    row, d, logits[i, : d.tokens.shape[0] + 1], draft_s[i], forward_s
                )
            self.target.cache.commit(row.slot, len(rnd.tokens))
            row.stats.record(rnd)
            self._emit(row, rnd.tokens)
        self._sweep()

    def _draft(self, rows: Sequence[Row], speculate: Sequence[bool]):
        drafts, seconds = [None] * len(rows), [0.0] * len(rows)
        for i, (row, spec) in enumerate(zip(rows, speculate, strict=True)):
            if not spec or self.drafter is None:
                continue
            if row.drafts is None:
                row.drafts = self.drafter.session(row.req.sampling, row.generator)
            t0 = time.perf_counter()
            drafts[i] = row.drafts.draft(row.tokens)
            seconds[i] = time.perf_counter() - t0
            self.costs.observe_draft(seconds[i])
        return drafts, seconds

    def _copies(self, rows: Sequence[Row], kinds: Sequence[str], drafts: list) -> None:
        """Put a copy of its own text (:class:`~d3d.lookup.CopyDraft`) in ``drafts`` for each
        ``auto`` row that does not draft and whose copy the policy takes."""
        found = [
            find_copy(r.tokens, self.block_size - 1) if k == AUTO and d is None else None
            for r, k, d in zip(rows, kinds, drafts, strict=True)
        ]
        buckets = [None if f is None else min(f.ngram, BUCKETS) - 1 for f in found]
        width = self.block_size if any(d is not None for d in drafts) else 1
        take = choose_copies(buckets, width, self.block_size, self.costs, self.copy_costs)
        for i, (f, b) in enumerate(zip(found, buckets, strict=True)):
            if take[i] and f is not None and b is not None:
                drafts[i] = CopyDraft(torch.tensor(f.tokens, dtype=torch.long), None, b)

    def _accept(self, row: Row, draft, logits: torch.Tensor, draft_s: float, verify_s: float):
        """Verify one row's draft (or copy) against its logits [K+1, V]; the cache commits the
        result."""
        d = draft.tokens.to(logits.device)  # [K]
        if row.req.sampling.greedy:
            res = greedy_accept(d, logits.argmax(dim=-1))
        else:
            p = probabilities(logits, row.req.sampling)
            q = one_hot_q(d, p.shape[-1]) if draft.q is None else draft.q.to(logits.device)
            res = stochastic_accept(d, q, p, row.generator)
        if isinstance(draft, CopyDraft):  # the drafter's acceptance figures are not its business
            self.copy_costs.record(draft.bucket, res.num_emitted)
            return Round(res.tokens, d.shape[0], res.num_accepted, 0.0, verify_s, copied=True)
        emitted = float(res.num_emitted)
        self.acceptance.add(emitted)
        row.acceptance = emitted if row.acceptance is None else 0.7 * row.acceptance + 0.3 * emitted
        return Round(res.tokens, d.shape[0], res.num_accepted, draft_s, verify_s)

    # -- output and bookkeeping ----------------------------------------------------------------
    def _emit(self, row: Row, tokens: list[int]) -> None:
        st = row.stats
        tokens, reason = _clip(tokens, self.eos_ids, row.req.max_new_tokens - st.num_tokens)
        row.tokens += tokens
        st.num_tokens += len(tokens)
        st.decode_seconds = time.perf_counter() - row.first_token_at
        row.req.on_tokens(tokens)
        if reason:
            st.stop_reason = reason

    def _sweep(self) -> None:
        for row in [r for r in self.rows if r.stats.stop_reason]:
            self._finish(row, row.stats.stop_reason)

    def _finish(self, row: Row, reason: str, error: BaseException | None = None) -> None:
        """Remove a row, moving the last row into its slot so live rows stay packed."""
        row.stats.stop_reason = reason
        last = self.rows[-1]
        if last is not row:
            self.target.cache.move(last.slot, row.slot)
            self.rows[row.slot] = last
            last.slot = row.slot
        self.rows.pop()
        self.target.cache.lengths[len(self.rows)] = 0
        row.req.on_finish(row.stats, error)
