"""The drafter worker's logic: per-request drafting sessions, branches, and the budget.

:class:`DraftServer` turns messages into replies (see :mod:`d3d.worker.protocol`) and knows
nothing of threads, processes or pipes: :mod:`d3d.worker.workers` runs it behind a queue or a
pipe, and tests run it directly. ``handle`` is a generator: it yields a reply (the block the
target waits for) *before* it goes on to prepare the next round's branches, so the caller sends
the reply at once and the branch work overlaps the target's verification.

Per session, the invariant of the whole engine holds between messages: the drafter's cache
holds committed tokens (its prefix is the drafter's own prompt, which may differ from the
target's), except that after preparing branches it also holds the handed-out draft chain; the
next commit cuts it back to what was accepted. Branches are keyed by (committed length, k, r),
so a branch can only serve the outcome it was drafted for: stale ones are dropped at the next
commit. Drafts for a committed length are sampled with a generator seeded by (seed, length), so
a hit and a miss draw from the same stream.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import DynamicCache

from d3d.backends.clock import Clock
from d3d.config import SamplingConfig
from d3d.model.drafter import D3DDrafter
from d3d.model.session import rewind
from d3d.sampling import probabilities
from d3d.worker.branches import choose_branches
from d3d.worker.budget import BranchBudget
from d3d.worker.drafting import can_batch, draft_blocks, draft_branches, encode_chain
from d3d.worker.protocol import Block, Close, Commit, Commits, Failed, Open

log = logging.getLogger(__name__)


@dataclass
class Prepared:
    """A drafted block: target ids [K], its draft-space scores [K, V_d], q when sampling."""

    tokens: list[int]
    scores: torch.Tensor
    q_ids: object = None
    q_probs: object = None


@dataclass
class _Session:
    sampling: SamplingConfig
    seed: int
    committed: list[int]
    cache: DynamicCache = field(default_factory=DynamicCache)
    cached_ids: list[int] = field(default_factory=list)
    branches: dict[tuple[int, int, int], Prepared] = field(default_factory=dict)
    commits: int = 0
    prepares: bool = True  # False: no branches (``sync``): each block is drafted on its commit
    row: Any = None  # its slot in a packed drafter's KV (d3d.worker.packed), instead of ``cache``


@dataclass(frozen=True)
class ServerConfig:
    max_branches: int = 16
    cover: bool = False  # cover each position before filling the budget (see branches.py)
    q_top: int = 1024  # slots' proposal distributions keep their M most likely tokens
    safety: float = 0.85  # branch work must fit in this share of the verify time
    fixed_branches: int | None = None  # a fixed number per round instead of the budget's


def _block(
    msg: Commit, sess: _Session, block: Prepared, offered: int, hit: bool, work_s: float
) -> Block:
    """The reply to ``msg``: the draft for the session's committed length."""
    return Block(
        sid=msg.sid,
        pos=len(sess.committed),
        tokens=block.tokens,
        hit=hit,
        branches=offered,
        work_s=work_s,
        q_ids=block.q_ids,
        q_probs=block.q_probs,
    )


class MessageServer:
    """What a drafter worker's server does with a message (:mod:`d3d.worker.protocol`): an
    ``Open`` starts a session, a ``Commit`` (or one step's ``Commits``) yields the replies, a
    ``Close`` ends the session; a failure ends that session with a ``Failed`` reply, never the
    worker. Subclasses say what each means: :class:`DraftServer`, or a drafter's own server
    (the replay instrument's, :mod:`d3d.replay`)."""

    drafter: Any  # the worker reads its device
    pending: Callable[[], bool]  # whether the next message is waiting (set by the worker loop)

    @property
    def shapes(self) -> int | None:
        """Step shapes its forwards have met (a graph captured for each on a GPU), where its
        forwards keep shapes (the cuda backend's packed drafting); None where they do not."""
        return None

    def handle(self, msg: object) -> Iterator[object]:
        sid = getattr(msg, "sid", None)
        try:
            if isinstance(msg, Open):
                self._open(msg)
            elif isinstance(msg, Commit):
                yield from self._commits([msg])
            elif isinstance(msg, Commits):
                yield from self._commits(msg.items)
            elif isinstance(msg, Close):
                self._close(msg.sid)
            else:
                raise TypeError(f"unknown message {type(msg).__name__}")
        except Exception as exc:  # a failure ends this session, never the worker
            yield self._failed(sid, exc)

    def _failed(self, sid: int | None, exc: Exception) -> Failed:
        log.exception("drafter worker: session %s failed", sid)
        if sid is not None:
            self._close(sid)
        return Failed(sid, f"{type(exc).__name__}: {exc}")

    def _open(self, msg: Open) -> None:
        raise NotImplementedError

    def _commits(self, msgs: list[Commit]) -> Iterator[object]:
        raise NotImplementedError

    def _close(self, sid: int) -> None:
        raise NotImplementedError


class DraftServer(MessageServer):
    """Serves every request's drafting session on one drafter (see the module docstring)."""

    def __init__(self, drafter: D3DDrafter, cfg: ServerConfig | None = None, clock=None):
        """``clock``: seconds as a callable (tests pass a fake); default the drafter device's
        synchronised clock, so the branch budget measures work done, not kernels launched."""
        self.drafter = drafter
        self.cfg = cfg or ServerConfig()
        self.clock = clock or Clock([getattr(drafter, "device", "cpu")]).now
        self.budget = BranchBudget(self.cfg.max_branches, self.cfg.safety)
        self.sessions: dict[int, _Session] = {}
        # Whether the next message is already waiting (set by the loop that feeds this server):
        # then the verification the branches would race has ended, and its commit is a miss
        # drafted in one block, cheaper than branches for it; a worker that fell behind (a
        # flood of rows on a slow drafter) catches up instead of drafting for rounds long gone.
        self.pending: Callable[[], bool] = lambda: False

    # ----- messages (MessageServer.handle routes them) ----------------------------------
    def _open(self, msg: Open) -> None:
        sess = _Session(msg.sampling, msg.seed, list(msg.prompt_ids))
        sess.prepares = msg.branches
        self.sessions[msg.sid] = sess
        if msg.prepare and msg.branches:
            self._prepare(sess, None, None)

    def _close(self, sid: int) -> None:
        self.sessions.pop(sid, None)

    def _commits(self, msgs: list[Commit]) -> Iterator[object]:
        """One step's commits: every row's block first (hits at once, then the misses drafted),
        then every row's branches within one budget, while the target verifies the blocks."""
        live = [(m, self.sessions[m.sid]) for m in msgs if m.sid in self.sessions]
        verify = [m.verify_s for m, sess in live if sess.commits]  # commit 0 is the prefill
        if verify:
            self.budget.observe_verify(max(verify))
        wanted: list[tuple[Commit, _Session, Prepared | None, int]] = []
        for msg, sess in live:
            before = len(sess.committed)
            sess.committed += msg.tokens
            sess.commits += 1
            offered = len(sess.branches)
            prepared = sess.branches.get((before, len(msg.tokens) - 1, msg.tokens[-1]))
            sess.branches = {}
            # Without a block wanted a plain target step follows. The cache catches up only when
            # a block is next wanted (one forward over everything pending, inside that round's
            # draft): a drafter that reads along at every plain step would take a core from the
            # target.
            if msg.wants_block:
                wanted.append((msg, sess, prepared, offered))
        ready: list[tuple[int, _Session, Prepared, int | None]] = []
        hits = [w for w in wanted if w[2] is not None]
        misses = [w for w in wanted if w[2] is None]  # no branch prepared (budget 0) is one too
        for msg, sess, prepared, offered in hits:  # out at once: the target is waiting
            yield _block(msg, sess, prepared, offered, hit=True, work_s=0.0)
            ready.append((msg.sid, sess, prepared, msg.next_len))
        t0 = self.clock()
        try:  # every missed block in one forward
            drafted = self._draft_many([sess for _, sess, _, _ in misses]) if misses else []
        except Exception as exc:
            for msg, _, _, _ in misses:
                yield self._failed(msg.sid, exc)
            misses, drafted = [], []
        for (msg, sess, _, offered), block in zip(misses, drafted, strict=True):
            yield _block(msg, sess, block, offered, hit=False, work_s=self.clock() - t0)
            ready.append((msg.sid, sess, block, msg.next_len))
        yield from self._prepare_all([r for r in ready if r[1].prepares])

    def _prepare_all(
        self, ready: list[tuple[int, _Session, Prepared, int | None]]
    ) -> Iterator[object]:
        """Every ready row's branches (sid, session, the block handed out, drafts the target
        verifies), one row after another, until the next message is waiting."""
        for sid, sess, block, length in ready:
            if self.pending():
                break
            try:
                self._prepare(sess, block, length, rows=len(ready))
            except Exception as exc:
                yield self._failed(sid, exc)

    # ----- cache bookkeeping ------------------------------------------------------------
    def _rewind(self, sess: _Session) -> list[int]:
        """Cut the cache back to its longest prefix shared with the committed tokens except
        the last (the anchor); return the committed tokens it still lacks."""
        sess.cache, sess.cached_ids, pending = rewind(
            sess.cache, sess.cached_ids, sess.committed[:-1]
        )
        return pending

    @torch.inference_mode()
    def _draft_many(self, sessions: list[_Session]) -> list[Prepared]:
        """A block for each session now (the misses of a step): one drafter forward for all of
        them where the drafter allows (:func:`~d3d.worker.drafting.draft_blocks`)."""
        d = self.drafter
        pending = [self._rewind(s) for s in sessions]  # may give a session a fresh cache
        items = [(s.cache, p, s.committed[-1]) for s, p in zip(sessions, pending, strict=True)]
        if len(items) > 1 and can_batch(d):
            scores = draft_blocks(d, items)
        else:
            scores = [d.block_scores(a, cache, pending) for cache, pending, a in items]
        out = []
        for sess, sc in zip(sessions, scores, strict=True):
            sess.cached_ids = sess.committed[:-1]
            out.append(self._finish(sess, sc, len(sess.committed)))
        return out

    # ----- drafting ---------------------------------------------------------------------
    def _finish(self, sess: _Session, scores: torch.Tensor, pos: int) -> Prepared:
        """Tokens (and q) from a block's draft-space scores [K, V_d]; ``pos``: the committed
        length the block follows, which seeds its sampling."""
        d = self.drafter
        if sess.sampling.greedy:
            return Prepared(d.to_target_ids(scores.argmax(dim=-1)).tolist(), scores)
        probs = probabilities(scores, sess.sampling)  # [K, V_d]
        vals, idx = probs.topk(min(self.cfg.q_top, probs.shape[-1]), dim=-1)  # [K, M]
        vals = vals / vals.sum(dim=-1, keepdim=True)
        gen = torch.Generator(device=vals.device)
        gen.manual_seed((sess.seed * 1_000_003 + pos) % (2**63 - 1))
        pick = torch.multinomial(vals, 1, generator=gen)  # [K, 1]
        tokens = d.to_target_ids(idx.gather(1, pick).squeeze(1)).tolist()
        q_ids = d.to_target_ids(idx).cpu().numpy()
        return Prepared(tokens, scores, q_ids, vals.float().cpu().numpy())

    @torch.inference_mode()
    def _prepare(
        self, sess: _Session, block: Prepared | None, length: int | None, rows: int = 1
    ) -> None:
        """Draft the branches for the most likely outcomes of the verification of ``block``
        (None: of the prefill, i.e. the first answer token) of which the target verifies the
        first ``length`` drafts (None: all), and encode as much of the draft chain as they
        need, all in one forward (see :mod:`d3d.worker.drafting`). ``rows``: how many rows
        share this verification's budget. Its time is a sample of the budget's cost model
        unless it also read tokens the drafter had not (a prompt, the catch-up after plain
        steps): that reading grows with their number, not with the branches."""
        d = self.drafter
        t0 = self.clock()
        pending, anchor = self._rewind(sess), sess.committed[-1]
        reads = bool(pending)
        n0 = len(sess.committed)  # the anchor is committed token n0 - 1
        if block is None:  # the drafter's own next-token view at the prompt's end
            scores = encode_chain(d, sess.cache, [*pending, anchor], keep=1)  # [1, V_d]
            sess.cached_ids, pending = list(sess.committed), []
            drafts: list[int] = []
        else:  # the target verifies the first `length` drafts: rows 0..length are outcomes
            k_all = len(block.tokens)
            n = k_all if length is None else min(length, k_all)
            scores, drafts = block.scores[: n + 1], block.tokens[:n]  # [<=n+1, V_d]
        # Row k predicts the token after k accepted drafts; with the whole block verified the
        # bonus (k = K) has no row of its own: a zero row leaves it out.
        dist = torch.softmax(scores.float(), dim=-1)
        if dist.shape[0] == len(drafts):
            dist = torch.cat([dist, dist.new_zeros(1, dist.shape[1])])
        draft_idx = torch.tensor(drafts, dtype=torch.long, device=dist.device)
        if d.draft_index is not None:
            draft_idx = d.draft_index.to(dist.device)[draft_idx].clamp_min(0)
        n = self.cfg.fixed_branches
        outcomes = choose_branches(
            draft_idx, dist, self.budget.choose(rows) if n is None else n, self.cfg.cover
        )
        m = max((o.k for o in outcomes), default=0)
        chain = [*pending, anchor, *drafts[:m]] if block is not None else []
        if outcomes:
            ids = d.to_target_ids(torch.tensor([o.r for o in outcomes], device=d.device)).tolist()
            visible = [n0 + o.k for o in outcomes]
            branch_scores = draft_branches(d, sess.cache, visible, ids, chain)
            for o, r, sc in zip(outcomes, ids, branch_scores, strict=True):
                sess.branches[(n0, o.k, int(r))] = self._finish(sess, sc, n0 + o.k + 1)
        elif chain:  # no branch fits: still take the commit's catch-up off the critical path
            d.encode(chain, sess.cache)
        if chain:
            sess.cached_ids = sess.committed + drafts[:m]
        if not reads:
            self.budget.observe_cost(len(outcomes), self.clock() - t0)
