"""The scheduler: every request, alone or among many, decodes through :meth:`Scheduler.step`.

``d3d generate`` is a batch of one, the service a batch of many; there is no other decode
loop. One step reads as the algorithm::

    admit      waiting requests join as the KV budget allows (continuous batching)
    propose    each decoding row's proposer: nothing (ar), a drafter block (sync), the block the
               drafter worker prepared while the last step was verified (async), a copy of the
               row's own text, or whichever of these auto's policy says pays
    verify     ONE target forward over every decoding row's [anchor, d_1..d_K], and the next
               chunks of the prompts being read
    accept     :func:`d3d.decoding.verify.accept` per row (its logits processed with the row's
               history where penalties apply, each position with its own); the KV keeps the
               anchor and the accepted drafts (rollback = not committing the rest)
    emit       tokens out; the proposers are told what was committed, and the worker gets every
               row's commit in one message, so it drafts step t+1 while the target verifies it

Prompts are read in chunks inside the same forward as the decoding rows (one flat sequence,
:mod:`d3d.backends.ragged`: the weights are read once a step), shortest prompt first, so a short
request is not queued behind a long document; while rows decode, the chunks may make the step
at most ``1 + share`` times as long as the rows alone, or half a second where that is more
(:class:`PrefillBudget`): a long prompt costs running rows a bounded share of each step, never
a whole prefill; short prompts (chats) are read whole, so their rows decode from the next step.
A prompt prefix that requests share (document QA: the instruction and the document's head) is
read once, on its own up to its end, and kept in the prefix cache; other rows copy it
(:mod:`d3d.engine.prefixes`).

Rows keep the invariants of every mode (the KV holds the committed tokens but the last; the
last token of every round comes from the target), so each row's greedy output is plain greedy
decoding of the target, whatever else shares the batch.

Each row's part of a step is one :class:`~d3d.engine.request.RowStep` (its round's proposal or
its prompt chunk, its slice of the forward, its logits): :meth:`Scheduler.step` reads as the
algorithm, each stage a call over those parts.

Why one file of about 480 lines: it is one class whose step reads and writes the batch's rows,
their KV and the policy's state together; what is pure already lives elsewhere (acceptance and
proposers in :mod:`d3d.decoding`, the KV budget in :mod:`d3d.engine.kv_store`, shared prefixes in
:mod:`d3d.engine.prefixes`, the per-row parts in :mod:`d3d.engine.request`).

Letters: n decoding rows, T new tokens per row, K draft length, V vocab.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Sequence

import torch

from d3d.backends import Backend, for_model
from d3d.backends.clock import WALL, Clock
from d3d.backends.kv import KvLimitError
from d3d.backends.sizes import window as model_window
from d3d.decoding.costs import LinearCost, batch_prices
from d3d.decoding.processors import History
from d3d.decoding.proposers import NO_DRAFT, Proposer
from d3d.decoding.rounds import round_record, round_seconds
from d3d.decoding.stats import DecodeStats
from d3d.decoding.verify import Acceptance, accept
from d3d.engine.kv_store import PrefixCache
from d3d.engine.prefixes import SharedPrefixes
from d3d.engine.request import GenRequest, Row, RowStep
from d3d.sampling import TokenLogprob, make_generator

log = logging.getLogger(__name__)

CHUNK_STEP = 16  # prefill chunks are multiples of this many tokens


class PrefillBudget:
    """Tokens of prompt to read in this step's forward (see the module docstring).

    Every forward is fitted as ``t(n) = a + b n`` over its n new tokens (a: reading the weights,
    b: a token's compute). While rows decode (d tokens), the prompts get the largest c with
    ``t(d + c) <= (1 + share) t(d)``, i.e. ``c = share (a + b d) / b``: the decoding rows' step
    grows by at most ``share`` (at least ``min_chunk`` tokens, so every prompt advances), or to
    ``floor_s`` seconds where that is more: with a few rows decoding their step is short, and a
    share of it (~80 tokens with one row here) reads documents at a fraction of a whole
    chunk's speed while each step still pays for reading the weights. With nothing decoding,
    ``max_chunk``.

    Short prompts are read whole: the waiting prompts of at most ``short`` tokens, shortest
    first, as many as keep the step within ``burst`` tokens, even past the share. A request
    reading its prompt does not decode, so under many short requests (chats, the field's
    benchmarks) a prompt spread over several share-sized steps leaves its row idle for each of
    them and the batch runs part-full; read whole, it decodes from the next step (vLLM reads
    up to 2,048 tokens a step on a CPU). A long prompt (a document) still costs the decoding
    rows at most ``share`` a step. ``short=0`` turns this off.
    """

    def __init__(
        self,
        share: float = 2.0,
        min_chunk: int = 16,
        max_chunk: int = 512,
        short: int = 512,
        burst: int = 2048,
        floor_s: float = 0.5,
    ):
        if share <= 0 or not 0 < min_chunk <= max_chunk:
            raise ValueError("need share > 0 and 0 < min_chunk <= max_chunk")
        if short < 0 or burst < short:
            raise ValueError("need 0 <= short <= burst")
        if floor_s < 0:
            raise ValueError("need floor_s >= 0")
        self.floor_s = floor_s
        self.share, self.min_chunk, self.max_chunk = share, min_chunk, max_chunk
        self.short, self.burst = short, burst
        self.cost = LinearCost(window=64)

    def observe(self, tokens: int, seconds: float) -> None:
        self.cost.observe(tokens, seconds)

    def tokens(self, decode_tokens: int, waiting: Sequence[int] = ()) -> int:
        """The step's prompt tokens while ``decode_tokens`` decode and prompts with ``waiting``
        tokens left wait to be read."""
        whole = 0
        for n in sorted(waiting):
            if n > self.short or decode_tokens + whole + n > self.burst:
                break
            whole += n
        return max(whole, self._shared(decode_tokens))

    def _shared(self, decode_tokens: int) -> int:
        if decode_tokens == 0:
            return self.max_chunk
        fit = self.cost.fit()
        if fit is None:
            return self.min_chunk
        a, b = fit
        step = a + b * decode_tokens
        allowed = max((1 + self.share) * step, self.floor_s)
        c = int((allowed - step) / b) // CHUNK_STEP * CHUNK_STEP
        return max(self.min_chunk, min(self.max_chunk, c))


ProposerFactory = Callable[[GenRequest], Proposer]


class Scheduler:
    """Continuous batching over one target (see the module docstring)."""

    def __init__(
        self,
        model,
        eos_ids: set[int],
        proposers: ProposerFactory,
        *,
        block_size: int = 16,
        max_batch: int = 32,
        max_kv_tokens: int = 1 << 16,
        prefix_cache: PrefixCache | None = None,
        prefill: PrefillBudget | None = None,
        clock: Clock = WALL,
        window: int | None = None,
        after_step: Callable[[Sequence[Row]], None] | None = None,
        backend: Backend | None = None,
    ):
        """``proposers(req)`` makes a request's proposer; ``after_step(rows)`` runs after each
        step's commits were observed (the engine sends the worker its commits there, and sizes
        the target's CPU budget); ``backend``: how the target runs its steps (default: chosen
        by its device, :mod:`d3d.backends`)."""
        self.target = (backend or for_model(model)).target(
            model, max_kv_tokens, clock, rows=max_batch, block=block_size
        )
        self.kv = self.target.kv
        self.eos_ids = set(eos_ids)
        self.proposers = proposers
        self.block_size = block_size
        self.max_batch = max_batch
        self.prefix_cache = prefix_cache
        self.prefill_budget = prefill or PrefillBudget()
        self.prefixes = SharedPrefixes(prefix_cache, self.target, self.prefill_budget.max_chunk)
        self.clock = clock
        self.window = window or model_window(model.config)
        self.after_step = after_step or (lambda rows: None)
        self.waiting: deque[GenRequest] = deque()
        self.rows: list[Row] = []
        self.last_verify_s: float | None = None

    # -- intake --------------------------------------------------------------------------------
    def need(self, req: GenRequest) -> int:
        """KV tokens a request reserves: prompt, budget and one draft block."""
        return len(req.prompt_ids) + req.max_new_tokens + self.block_size

    def check(self, req: GenRequest) -> None:
        """Raise ValueError naming the problem if ``req`` can never run (:class:`KvLimitError`
        when it can never fit the KV budget)."""
        if not req.prompt_ids:
            raise ValueError("the prompt is empty")
        if req.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {req.max_new_tokens}")
        if self.window and self.need(req) > self.window:
            raise ValueError(
                f"prompt ({len(req.prompt_ids)} tokens) + max_new_tokens ({req.max_new_tokens}) "
                f"exceeds the model's {self.window}-token window"
            )
        self.kv.check(self.need(req))

    def add(self, req: GenRequest) -> None:
        """Queue a request; it joins the batch when the KV budget allows (raises ValueError if
        it never can)."""
        self.check(req)
        self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not self.rows and not self.waiting

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> None:
        """One step, as the algorithm reads (module docstring): admit, propose, one forward,
        accept and emit; then the worker hears the commits and finished rows leave."""
        try:
            self._drop_cancelled()
            self._admit()
            if self.rows:
                t0 = self.clock.wall()  # the last step's tokens came back: the devices are idle
                rounds = self._propose([r for r in self.rows if r.decoding])
                width = sum(len(p.ids) for p in rounds)
                chunks = self._chunks([r for r in self.rows if not r.decoding], width)
                seconds, tokens = self._forward(rounds, chunks)
                self._accept(rounds, seconds, t0, shared=bool(chunks))
                self._read(chunks, seconds, tokens)
            self.after_step(self.rows)
            self._sweep()
        except Exception as exc:  # a failed forward fails its batch, never the engine
            log.exception("engine step failed; failing %d request(s)", len(self.rows))
            for row in list(self.rows):
                self._finish(row, "error", exc)

    def _drop_cancelled(self) -> None:
        for req in [r for r in self.waiting if r.cancelled]:
            self.waiting.remove(req)
            stats = DecodeStats(mode=req.mode, prompt_tokens=len(req.prompt_ids))
            stats.stop_reason = "cancelled"
            req.on_finish(stats, None)
        for row in [r for r in self.rows if r.req.cancelled]:
            self._finish(row, "cancelled")

    def _admit(self) -> None:
        while self.waiting and len(self.rows) < self.max_batch:
            req = self.waiting[0]
            if not self.kv.fits(self.need(req)):
                break  # waits until running rows give their reservations back
            self.waiting.popleft()
            if req.stats is None:  # kept on the request: its proposer may name itself there
                req.stats = DecodeStats(mode=req.mode)
            stats = req.stats
            stats.prompt_tokens = len(req.prompt_ids)
            try:
                proposer = self.proposers(req)
                gen = make_generator(req.sampling, self.target.device)
                proposer.start(req.prompt_ids, req.sampling, gen, req.draft_prompt_ids)
            except Exception as exc:  # this request cannot run (e.g. no drafter for its mode)
                stats.stop_reason = "error"
                req.on_finish(stats, exc)
                continue
            row = Row(req, self.kv.open(self.need(req)), proposer, stats, gen, list(req.prompt_ids))
            row.stops = req.sampling.stops(self.eos_ids)
            row.history = History.of(req.sampling, req.prompt_ids, row.stops)
            self.rows.append(row)
            self.prefixes.reuse(row)

    # -- the step's forward --------------------------------------------------------------------
    def _forward(self, rounds: Sequence[RowStep], chunks: Sequence[RowStep]) -> tuple[float, int]:
        """ONE target forward over every row's part (the rounds first, then the prompt chunks);
        each part gets its logits (and its argmax where :meth:`_tops` takes one). Returns the
        forward's seconds, which teach the prefill budget and, with no chunk beside them, are
        the rounds' verify time, and the tokens it read."""
        parts = [*rounds, *chunks]
        logits = self.target.forward(
            [p.row.kv for p in parts], [p.ids for p in parts], [p.keep for p in parts]
        )
        for p, lg, top in zip(parts, logits, self._tops(parts, logits), strict=True):
            p.logits, p.top = lg, top
        seconds, tokens = self.target.last_seconds, sum(len(p.ids) for p in parts)
        self.prefill_budget.observe(tokens, seconds)
        self.last_verify_s = seconds if rounds and not chunks else None
        return seconds, tokens

    def _tops(
        self, parts: Sequence[RowStep], logits: Sequence[torch.Tensor]
    ) -> list[list[int] | None]:
        """Each plain greedy row's argmax at its kept positions, from ONE argmax over the step's
        logits (one call per row cost ~0.1 ms each at a 49k vocabulary: 5 % of a 64-row step);
        None for the other rows (sampled, penalised, or asking for logprobs)."""
        plain = [_plain_greedy(p.row) for p in parts]
        if not any(plain):
            return [None] * len(parts)
        flat = self.target.last_logits.argmax(dim=-1).tolist()
        out, at = [], 0
        for lg, ok in zip(logits, plain, strict=True):
            out.append(flat[at : at + lg.shape[0]] if ok else None)
            at += lg.shape[0]
        return out

    def _propose(self, rows: Sequence[Row]) -> list[RowStep]:
        """Every decoding row's round: its anchor and its proposer's drafts. Rows that price
        their rounds are told their share of the step first (:meth:`share_s`): every verified
        token widens the one flat forward, whichever row it belongs to, so a round pays in a
        batch only against that share."""
        share, token_s = self._prices(len(rows))
        for r in rows:
            r.proposer.batch(share, token_s)
        rounds = []
        for r in rows:
            p = r.proposer.propose(r.tokens)
            rounds.append(RowStep(r, [r.tokens[-1], *p.tokens.tolist()], p))
        return rounds

    def share_s(self, rows: int) -> float | None:
        """A decoding row's share of a plain step among ``rows`` rows: the step's time from the
        fitted forward cost ``t(n) = a + b n`` (:class:`PrefillBudget`) over the rows; None for
        a row alone (it is priced with the host's plain step) or before any forward was timed."""
        return self._prices(rows)[0]

    def _prices(self, rows: int) -> tuple[float | None, float | None]:
        """(a row's share of the step, a token's cost ``b``) from one fit; (None, None) alone."""
        return batch_prices(self.prefill_budget.cost, rows)

    def _accept(self, rounds: Sequence[RowStep], seconds: float, t0: float, shared: bool) -> None:
        """Accept every row's round, then commit, tell its proposer, emit and record it.
        ``shared``: prompt chunks rode in the forward too, so its time is no row's own."""
        if not rounds:
            return
        accs = [self._round(p.row, p.logits, p.proposal.tokens, p.proposal.q, p.top)
                for p in rounds]  # fmt: skip
        now = self.clock.wall()  # after the step's tokens came back: no wait
        step_s = now - t0  # waits for blocks + the forward + acceptance
        # A hit step: every row that drafted with the worker had its block ready (the drafting
        # was hidden); only those steps are counted as such, against their verify forward.
        props = [p.proposal for p in rounds]
        hit_step = any(p.hit for p in props) and all(p.hit is not False for p in props)
        widest = max(p.k for p in props)
        for part, acc in zip(rounds, accs, strict=True):
            row, p = part.row, part.proposal
            self.kv.commit(row.kv, acc.num_emitted)
            # A round in a wider forward (or beside a prompt) did not pay for it alone.
            row.proposer.observe(acc, round_seconds(p.k, widest, shared, seconds))
            emitted = self._emit(row, acc.tokens, acc.logprobs, now)
            step = step_s if hit_step and not shared else 0.0
            row.stats.record(round_record(p, p.k, acc, emitted, seconds, step))

    @staticmethod
    def _round(
        row: Row,
        logits: torch.Tensor,
        draft: torch.Tensor,
        q: torch.Tensor | None,
        top: list[int] | None = None,
    ) -> Acceptance:
        """A row's acceptance of one round: logits [K+1, V], draft [K], q [K, V] or None; ``top``
        the logits' argmax where taken for the step (:meth:`_tops`)."""
        req = row.req
        return accept(logits, draft, q, req.sampling, row.generator, row.history, req.logprobs, top)

    # -- reading prompts -----------------------------------------------------------------------
    def _chunks(self, rows: Sequence[Row], decode_tokens: int) -> list[RowStep]:
        """The next chunk of each prompt being read, shortest first, up to the step's budget.
        A chunk stops at the end of a shared prefix (kept in the prefix cache there); a prefix
        that one row is reading is read by that row alone (:meth:`SharedPrefixes.waits`)."""
        reading = self.prefixes.reading(rows)
        wants: list[tuple[Row, int]] = []  # what each row that may read now would read whole
        for row in sorted(rows, key=lambda r: r.prompt_left):
            if self.prefixes.waits(row, reading):
                continue
            shared = self.prefixes.length(row)
            end = shared if row.prefilled < shared else len(row.req.prompt_ids)
            wants.append((row, end - row.prefilled))
        # The budget counts only what these rows read: a row waiting for a prefix, or one whose
        # chunk stops at its prefix's end, lends no tokens to a document read after it.
        budget = self.prefill_budget.tokens(decode_tokens, [n for _, n in wants])
        out: list[RowStep] = []
        for row, want in wants:
            if budget <= 0:
                break
            n = min(want, budget)
            ids = row.req.prompt_ids[row.prefilled : row.prefilled + n]
            out.append(RowStep(row, ids, last=row.prefilled + n == len(row.req.prompt_ids)))
            budget -= n
        return out

    def _read(self, chunks: Sequence[RowStep], seconds: float, tokens: int) -> None:
        """Commit each prompt chunk the forward read (its share of the forward's time by
        tokens); a chunk that ends its prompt gives the row its first token."""
        for p in chunks:
            row, n = p.row, len(p.ids)
            self.kv.commit(row.kv, n)
            row.prefilled += n
            row.prefill_s += seconds * n / tokens
            self.prefixes.keep(row)
            if p.last:
                self._first_token(row, p.logits[-1], p.top)

    def _first_token(self, row: Row, logits: torch.Tensor, top: list[int] | None = None) -> None:
        """The prompt is read: the first token, reported to the proposer as round 0 (the
        prompt's time with a cached prefix priced like the rest)."""
        st = row.stats
        st.prefill_seconds = row.prefill_s
        acc = self._round(row, logits[None], NO_DRAFT.tokens, None, top)
        prompt = len(row.req.prompt_ids)
        encoded = max(prompt - st.cached_prompt_tokens, 1)
        row.proposer.observe(Acceptance(0, acc.tokens), row.prefill_s * prompt / encoded)
        row.first_token_at = now = self.clock.wall()
        self._emit(row, acc.tokens, acc.logprobs, now)

    # -- output and bookkeeping ----------------------------------------------------------------
    def _emit(
        self, row: Row, tokens: list[int], logprobs: list[TokenLogprob] | None, now: float
    ) -> list[int]:
        """Commit a round's tokens to the row and its caller (``now``: the step's end)."""
        st, req = row.stats, row.req
        tokens, reason = clip(tokens, row.stops, req.max_new_tokens - st.num_tokens)
        row.tokens += tokens
        st.num_tokens += len(tokens)
        st.decode_seconds = now - row.first_token_at
        if row.history is not None:
            row.history.commit(tokens)
        if logprobs is not None and req.on_logprobs is not None:
            req.on_logprobs(logprobs[: len(tokens)])
        req.on_tokens(tokens)
        if reason:
            st.stop_reason = reason
        return tokens

    def _sweep(self) -> None:
        for row in [r for r in self.rows if r.stats.stop_reason]:
            self._finish(row, row.stats.stop_reason)
        if (
            not self.rows
            and not self.waiting
            and self.kv.allocated_tokens > self.kv.max_tokens // 2
        ):
            self.kv.trim()  # idle: a large KV allocation goes back (a small one stays warm)

    def _finish(self, row: Row, reason: str, error: BaseException | None = None) -> None:
        row.stats.stop_reason = reason
        self.rows.remove(row)
        self.kv.close(row.kv)
        try:
            row.proposer.close()
        except Exception:  # closing a proposer must not fail the request
            log.exception("closing a proposer failed")
        row.req.on_finish(row.stats, error)

    # -- outside the batch ---------------------------------------------------------------------
    def encode_prefix(self, ids: Sequence[int]) -> None:
        """Read a prompt prefix that requests will share into the prefix cache, outside the
        batch (:meth:`SharedPrefixes.encode`)."""
        self.prefixes.encode(ids)


def _plain_greedy(row: Row) -> bool:
    """Whether a row's token is its raw logits' argmax (greedy, no history, no logprobs)."""
    return row.req.sampling.greedy and row.history is None and row.req.logprobs is None


def clip(tokens: list[int], stops: set[int], room: int) -> tuple[list[int], str]:
    """Cut a round's tokens at the first stop id (kept: EOS or a request's stop token) or at the
    token budget."""
    for i, t in enumerate(tokens[:room]):
        if t in stops:
            return tokens[: i + 1], "eos"
    if len(tokens) >= room:
        return tokens[:room], "length"
    return tokens, ""


__all__ = ["KvLimitError", "PrefillBudget", "Scheduler", "clip"]
