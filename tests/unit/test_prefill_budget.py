"""The prefill budget: a long prompt costs the decoding rows at most their share of a step;
short prompts are read whole, up to the step's burst of tokens."""

import pytest

from d3d.engine.scheduler import PrefillBudget


def fitted(**kw) -> PrefillBudget:
    """A budget whose cost fit is t(n) = 30 ms + 1 ms n."""
    b = PrefillBudget(**kw)
    for n in (1, 16, 64, 256):
        b.observe(n, 0.030 + 0.001 * n)
    return b


def test_a_long_prompt_gets_the_share_while_rows_decode():
    b = fitted(share=2.0, floor_s=0.0)
    # c = share (a + b d) / b = 2 (30 + 16) = 92 -> 80 (a multiple of 16)
    assert b.tokens(16, [3000]) == 80
    assert b.tokens(0, [3000]) == b.max_chunk  # nothing decodes: a whole chunk


def test_short_prompts_are_read_whole_up_to_the_burst():
    b = fitted(share=2.0, short=512, burst=2048, floor_s=0.0)
    assert b.tokens(16, [256]) == 256  # past the share (80): the row decodes next step
    assert b.tokens(16, [256, 300, 3000]) == 556  # the document waits for a share-sized chunk
    # 2048 - 16 decoding = 2032 tokens: seven 256-token prompts fit, the eighth waits
    assert b.tokens(16, [256] * 10) == 7 * 256
    assert b.tokens(0, [256] * 10) == 8 * 256


def test_prompts_past_short_or_short_off_keep_the_share():
    assert fitted(short=512, floor_s=0).tokens(16, [513]) == 80
    assert fitted(short=0, floor_s=0).tokens(16, [40, 40]) == 80
    assert fitted(short=512, floor_s=0).tokens(16, []) == 80


def test_a_short_step_may_grow_to_the_floor():
    # one row decodes: its step is 31 ms, a share of it 2 x 31 -> 48 tokens; the floor lets the
    # step grow to 0.2 s: (200 - 31) / 1 = 169 -> 160 tokens
    assert fitted(floor_s=0.0).tokens(1, [3000]) == 48
    assert fitted(floor_s=0.2).tokens(1, [3000]) == 160
    # many rows decode: their step (30 + 400 ms) times 1 + share is past the floor; the share holds
    assert fitted(floor_s=0.2, max_chunk=4096).tokens(400, [5000]) == 848
    assert fitted().tokens(1, [3000]) == 464  # the default 0.5 s: (500 - 31) / 1 -> 464


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="short"):
        PrefillBudget(short=4096, burst=2048)
    with pytest.raises(ValueError, match="short"):
        PrefillBudget(short=-1)
    with pytest.raises(ValueError, match="floor"):
        PrefillBudget(floor_s=-0.1)
