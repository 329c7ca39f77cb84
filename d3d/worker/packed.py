"""The drafter worker's server over the cuda backend's packed drafter: a step's blocks in one
forward, every row's branches in one forward, the branches chosen on the device.

Same messages, sessions and invariants as :class:`~d3d.worker.server.DraftServer` (hits out at
once, misses drafted, then the branches while the target verifies; branches keyed by
(committed length, k, r)), but each session's cache is a slot of
:class:`~d3d.backends.cuda.drafter.PackedDrafter`'s KV instead of a ``DynamicCache``: cutting it
back is setting its length, and appending never concatenates. A worker step runs

1. the misses: one packed forward, a block per row ``[anchor, MASK x K]`` after the tokens the
   row has not read (its chain), visible length = its committed tokens but the anchor;
2. the branches of every ready row: the outcome scores of every row's handed-out block and the
   top n of them as tensors (:func:`~d3d.worker.branches.choose_rows`, the same rule as
   :func:`~d3d.worker.branches.choose_branches`), fed on the device into one packed forward
   whose chain per row is the catch-up, the anchor and the drafts the target verifies (kept:
   the next commit cuts back to what it accepted), and whose blocks are ``[r_b, MASK x K]``
   seeing the committed tokens and the first k_b drafts.

Greedy rows take their tokens back in one device-to-host copy per forward (blocks) and one per
branch step (tokens, k, r and which branches are real); a sampling row draws its tokens per
block as the row-by-row server does (:meth:`DraftServer._finish`, seeded by position). A prompt
that the worker reads before its first branches (an ``Open`` with ``prepare``) is one more
forward, scoring its last token.

A row whose slot cannot hold what a step would write for it (its tokens, a chain and its
branches) fails alone before the step, as one that cannot open its slot does: its request goes
on on the target, and the other rows' step is not lost.

Letters: R rows, K drafts a block, Bk = K+1, n branches a row, V_d draft vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch

from d3d.backends.cuda.drafter import PackedDrafter, PackedPlan
from d3d.backends.cuda.kv import SlotLimitError
from d3d.backends.slabs import KvRow
from d3d.model.session import common_prefix
from d3d.worker.branches import Choice, choose_rows
from d3d.worker.protocol import Open
from d3d.worker.server import DraftServer, Prepared, ServerConfig, _Session


def cut_back(row: KvRow, held: Sequence[int], want: Sequence[int]) -> list[int]:
    """Cut a packed drafter's ``row`` (holding the ids ``held``) back to their longest prefix
    shared with ``want`` — its length only: the keys past it are scratch — and return what it
    still lacks of ``want``."""
    row.length = common_prefix(held, want)
    return list(want[row.length :])


class PackedDraftServer(DraftServer):
    """See the module docstring."""

    def __init__(
        self, drafter, cfg: ServerConfig | None = None, clock=None, plan: PackedPlan | None = None
    ):
        super().__init__(drafter, cfg, clock)
        self.packed = PackedDrafter(drafter, plan)
        # positions past a session's tokens a step may write: a chain and its branch blocks
        self.reserve = self.packed.reserve(self.cfg.max_branches)

    @property
    def shapes(self) -> int:
        return self.packed.runner.shapes

    # ----- sessions -----------------------------------------------------------------------
    def _open(self, msg: Open) -> None:
        sess = _Session(msg.sampling, msg.seed, list(msg.prompt_ids))
        sess.prepares = msg.branches
        sess.row = self.packed.open(len(msg.prompt_ids) + self.reserve)
        self.sessions[msg.sid] = sess
        if msg.prepare and msg.branches:
            self._prepare_rows([(sess, None, None)])

    def _commits(self, msgs: list) -> Iterator[object]:
        """A row whose slot cannot hold what this step would write fails alone (its request
        goes on on the target, lossless); the step goes on for the others."""
        fit = []
        for msg in msgs:
            sess = self.sessions.get(msg.sid)
            try:
                if sess is not None:
                    self.packed.check_room(len(sess.committed) + len(msg.tokens), self.reserve)
            except SlotLimitError as exc:
                yield self._failed(msg.sid, exc)
            else:
                fit.append(msg)
        yield from super()._commits(fit)

    def _close(self, sid: int) -> None:
        sess = self.sessions.pop(sid, None)
        if sess is not None and sess.row is not None:
            self.packed.close(sess.row)

    def _rewind(self, sess: _Session) -> list[int]:
        """Cut the row back to its longest prefix shared with the committed tokens but the
        anchor (its length only: the keys past it are scratch); return what it still lacks."""
        want = sess.committed[:-1]
        pending = cut_back(sess.row, sess.cached_ids, want)
        sess.cached_ids = want[: sess.row.length]
        return pending

    # ----- blocks -------------------------------------------------------------------------
    @torch.inference_mode()
    def _draft_many(self, sessions: list[_Session]) -> list[Prepared]:
        """Every missed row's block in one packed forward."""
        pending = [self._rewind(s) for s in sessions]
        visible = torch.tensor(
            [[s.row.length + len(p)] for s, p in zip(sessions, pending, strict=True)]
        )
        anchors = torch.tensor([[s.committed[-1]] for s in sessions])
        out = self.packed.run([s.row for s in sessions], pending, visible, anchors)
        for s in sessions:
            s.cached_ids = s.committed[:-1]
        return self._finish_rows(sessions, out.blocks[:, 0], [len(s.committed) for s in sessions])

    def _finish_rows(
        self, sessions: list[_Session], scores: torch.Tensor, pos: list[int]
    ) -> list[Prepared]:
        """Prepared blocks of scores [R, K, V_d]: greedy rows' tokens in one copy back."""
        greedy = [i for i, s in enumerate(sessions) if s.sampling.greedy]
        out: list[Prepared | None] = [None] * len(sessions)
        if greedy:  # every row greedy (the usual step): no index to copy over first
            some = scores
            if len(greedy) < len(sessions):
                idx = torch.tensor(greedy).to(scores.device, non_blocking=True)
                some = scores.index_select(0, idx)
            tokens = self.drafter.to_target_ids(some.argmax(-1)).tolist()
            for i, t in zip(greedy, tokens, strict=True):
                out[i] = Prepared(t, scores[i])
        return [
            p if p is not None else self._finish(s, scores[i], pos[i])
            for i, (s, p) in enumerate(zip(sessions, out, strict=True))
        ]

    # ----- branches -----------------------------------------------------------------------
    def _prepare_all(self, ready: list) -> Iterator[object]:
        if not ready or self.pending():
            return
        try:
            self._prepare_rows([(sess, block, length) for _, sess, block, length in ready])
        except Exception as exc:
            for sid, *_ in ready:
                yield self._failed(sid, exc)

    @torch.inference_mode()
    def _prepare_rows(self, items: list[tuple[_Session, Prepared | None, int | None]]) -> None:
        """Every row's branches for the outcomes of the block it handed out (None: of its
        prompt's end) of which the target verifies the first ``length`` drafts (None: all), in
        one packed forward (module docstring)."""
        d, kb = self.drafter, self.packed.block
        k, r = kb - 1, len(items)
        t0 = self.clock()
        sessions = [s for s, _, _ in items]
        pending = [self._rewind(s) for s in sessions]
        reads = any(pending)
        heads = self._read_prompts(items, pending)  # rows without a block: [1, V_d] each
        scores, drafts, chains = [], [], []
        for i, (sess, block, length) in enumerate(items):
            if block is None:
                sc, ds, chain = heads[i], [], []
            else:
                n = len(block.tokens) if length is None else min(length, len(block.tokens))
                sc, ds = block.scores, block.tokens[:n]
                chain = [*pending[i], sess.committed[-1], *ds]
            scores.append(torch.cat([sc, sc.new_zeros(k - sc.shape[0], sc.shape[1])]))
            drafts.append(ds)
            chains.append(chain)
        n = self.cfg.fixed_branches
        n = self.budget.choose(r) if n is None else n
        host = torch.tensor(
            [
                [*ds, *[0] * (k - len(ds)), len(ds), len(s.committed)]
                for s, ds in zip(sessions, drafts, strict=True)
            ]
        )
        dev = host.to(d.device, non_blocking=True)
        draft_idx, verified, n0 = dev[:, :k], dev[:, k], dev[:, k + 1]
        if d.draft_index is not None:
            draft_idx = d.draft_index[draft_idx].clamp_min(0)
        # row j of a block's scores predicts the token after j accepted drafts; rows past the
        # verified drafts are no outcome, and with every draft verified the bonus has no row
        dist = torch.softmax(torch.stack(scores).float(), dim=-1)  # [R, K, V_d]
        dist = torch.cat([dist, dist.new_zeros(r, 1, dist.shape[2])], dim=1)  # [R, K+1, V_d]
        live = torch.arange(k + 1, device=dist.device)[None, :] <= verified[:, None]
        dist = dist * live[:, :, None]
        rows = [s.row for s in sessions]
        if n > 0:
            choice = choose_rows(draft_idx, dist, verified, n, self.cfg.cover)
            anchors = d.to_target_ids(choice.r)  # [R, n]
            visible = n0[:, None] + torch.minimum(choice.k, verified[:, None])
            out = self.packed.run(rows, chains, visible, anchors)
            self._keep(sessions, choice, anchors, out.blocks)
        elif any(chains):  # no branch fits: still take the commit's catch-up off the critical path
            empty = torch.zeros(r, 0, dtype=torch.long)
            self.packed.run(rows, chains, empty, empty)
        for sess, ds, chain in zip(sessions, drafts, chains, strict=True):
            if chain:
                sess.cached_ids = sess.committed + ds
        if not reads:
            self.budget.observe_cost(n, (self.clock() - t0) / r)

    def _read_prompts(self, items: list, pending: list[list[int]]) -> dict[int, torch.Tensor]:
        """Rows without a block read what they lack and their anchor in one forward; the
        draft-space scores [1, V_d] at each one's anchor (the first answer token's)."""
        fresh = [i for i, (_, block, _) in enumerate(items) if block is None]
        if not fresh:
            return {}
        sessions = [items[i][0] for i in fresh]
        chains = [[*pending[i], s.committed[-1]] for i, s in zip(fresh, sessions, strict=True)]
        empty = torch.zeros(len(fresh), 0, dtype=torch.long)
        out = self.packed.run([s.row for s in sessions], chains, empty, empty, last=True)
        for i, s in zip(fresh, sessions, strict=True):
            s.cached_ids, pending[i] = list(s.committed), []
        return {i: out.last[j : j + 1] for j, i in enumerate(fresh)}

    def _keep(
        self, sessions: list[_Session], choice: Choice, anchors: torch.Tensor, blocks: torch.Tensor
    ) -> None:
        """File each row's real branches (blocks [R, n, K, V_d], anchors [R, n] target ids)
        under (n0, k, r); greedy rows' tokens, and which branches are real, in one copy back."""
        d = self.drafter
        n = anchors.shape[1]
        tokens = d.to_target_ids(blocks.argmax(-1)).flatten(1)  # [R, n*K]
        real = (choice.logp > float("-inf")).long()
        back = torch.cat([tokens, choice.k, anchors, real], dim=1).tolist()
        k = blocks.shape[2]
        for i, sess in enumerate(sessions):
            row = back[i]
            n0 = len(sess.committed)
            ks, rs, ok = row[n * k : n * k + n], row[n * k + n : n * k + 2 * n], row[-n:]
            for b in range(n):
                if not ok[b]:
                    continue
                sc = blocks[i, b]
                if sess.sampling.greedy:
                    prepared = Prepared(row[b * k : (b + 1) * k], sc)
                else:
                    prepared = self._finish(sess, sc, n0 + ks[b] + 1)
                sess.branches[(n0, ks[b], rs[b])] = prepared
