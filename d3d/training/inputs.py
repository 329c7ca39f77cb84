"""What ``d3d train`` and ``d3d prune`` train on, checked once, with one-line errors.

Design:

- Bad input is found before anything trains, and each cause gets one line that names the file,
  what is wrong and the flag or command that fixes it (the CLI prints it as
  ``d3d: error: ...``, exit 2). What can be seen in the files alone (unreadable, empty, not
  records, no training split, responses too short, a validation split that leaves nothing) is
  checked before a model loads; what needs the target (its vocabulary and tokenizer) right
  after it loads (:func:`check_tokenizer`).
- Records whose response is too short to hold a block anchor are skipped with a log line; only
  when none is left is it an error (saying how many there are and the minimum).
- The validation split (``--val-seqs``) comes out of the training records. Left at its default
  it takes at most a quarter of them (so a small file still trains, and a log line says the
  split was shrunk); asked for explicitly, a split that would leave nothing to train on is an
  error naming the flag, never a silent change of what was asked.
- Records carry token ids, not the tokenizer that made them. A file made with another target's
  tokenizer shows as ids past the target's vocabulary, or (same vocabulary size) as stored
  response ``text`` that the target's tokenizer does not decode the ids to.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from d3d.training.data import MIN_RESPONSE_TOKENS, read_many, training_guard, validation_split

log = logging.getLogger(__name__)

DEFAULT_VAL_SEQS = 12  # training records set aside for validation when --val-seqs is not given
TEXT_SAMPLE = 16  # records whose stored text is compared with the target's decoding


@dataclass(frozen=True)
class TrainingData:
    """The records a run trains on and the ones it validates on."""

    train: list[dict]
    val: list[dict]
    name: str  # the data files, for messages

    def check_tokenizer(self, target) -> None:
        """:func:`check_tokenizer` over every record of the run."""
        check_tokenizer(self.train + self.val, target, self.name)


def _name(paths: Sequence[str | Path]) -> str:
    return ", ".join(str(p) for p in paths)


def load_training_data(
    paths: str | Path | Sequence[str | Path], val_seqs: int | None = None, allow_eval: bool = False
) -> TrainingData:
    """The training split of ``paths``, checked (see the module docstring), less ``val_seqs``
    records set aside for validation (None: the default, shrunk for small files)."""
    paths = [paths] if isinstance(paths, (str, Path)) else list(paths)
    name = _name(paths)
    every = read_many(paths)
    records = training_guard([r for r in every if r["split"] == "train"], allow_eval)
    if not records:
        raise ValueError(
            f"{name}: no training records (all {len(every)} are in the held-out split): write "
            "more with `d3d data`, or hold out fewer with its --heldout-fraction"
        )
    long_enough = [r for r in records if len(r["response_ids"]) >= MIN_RESPONSE_TOKENS]
    if not long_enough:
        longest = max(len(r["response_ids"]) for r in records)
        raise ValueError(
            f"{name}: all {len(records)} training records are too short: a record needs "
            f"{MIN_RESPONSE_TOKENS} response tokens or more, the longest has {longest} "
            "(write longer responses with `d3d data --max-new-tokens`)"
        )
    if len(long_enough) < len(records):
        log.warning("%s: skipping %d of %d training records with fewer than %d response tokens",
                    name, len(records) - len(long_enough), len(records), MIN_RESPONSE_TOKENS)  # fmt: skip
    n_val = validation_size(len(long_enough), val_seqs, name)
    train, val = validation_split(long_enough, n_val)
    return TrainingData(train, val, name)


def validation_size(n: int, val_seqs: int | None, name: str = "the data") -> int:
    """How many of ``n`` training records to set aside (see the module docstring)."""
    if val_seqs is None:
        size = min(DEFAULT_VAL_SEQS, n // 4)
        if size < DEFAULT_VAL_SEQS:
            log.warning("%s: %d training records: setting %d aside for validation instead of %d "
                        "(at most a quarter; choose with --val-seqs)", name, n, size,
                        DEFAULT_VAL_SEQS)  # fmt: skip
        return size
    if val_seqs < 0:
        raise ValueError(f"--val-seqs must be >= 0, got {val_seqs}")
    if val_seqs >= n:
        raise ValueError(
            f"{name}: --val-seqs {val_seqs} sets aside all {n} training records and leaves none "
            f"to train on: pass --val-seqs {n // 4} (or any value below {n}), or more data"
        )
    return val_seqs


def check_tokenizer(records: Sequence[dict], target, name: str = "the data") -> None:
    """Refuse records made with another tokenizer than the target's (``target``: a
    :class:`~d3d.model.load.LoadedModel`; its tokenizer may be None, then only the vocabulary
    is checked)."""
    vocab = target.vocab_size
    top = max((max(r["prompt_ids"] + r["response_ids"], default=-1) for r in records), default=-1)
    if top >= vocab:
        raise ValueError(
            f"{name}: token id {top} is outside the target's vocabulary ({vocab} ids, target "
            f"{target.spec}): the data was made with another tokenizer; make it with "
            f"`d3d data --target {target.spec}`"
        )
    tok = target.tokenizer
    texts = [r for r in records if isinstance(r.get("text"), str) and r["response_ids"]]
    if tok is None or not texts:
        return
    sample = texts[:TEXT_SAMPLE]
    differ = sum(_words(tok.decode(r["response_ids"], skip_special_tokens=True)) != _words(r["text"])
                 for r in sample)  # fmt: skip
    if differ * 2 > len(sample):
        raise ValueError(
            f"{name}: made with another tokenizer: the target's tokenizer ({target.spec}) decodes "
            f"the stored ids to other text than the stored one in {differ} of {len(sample)} "
            f"records checked; make the data with `d3d data --target {target.spec}`"
        )


def _words(text: str) -> list[str]:
    """Text compared up to whitespace (decoders differ in how they clean spaces)."""
    return text.split()
