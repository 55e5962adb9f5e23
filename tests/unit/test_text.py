"""Stop strings and incremental UTF-8 (pure)."""

from __future__ import annotations

from workers.engine.text import ChoiceText

VOCAB = {1: b"Hel", 2: b"lo", 3: b" wor", 4: b"ld", 5: b"\xe2\x82", 6: b"\xac", 7: b"!", 8: b"\n\n"}


def feed_all(ct: ChoiceText, ids: list[int]) -> str:
    out = ""
    for t in ids:
        ct.feed(t)
        if ct.finish_reason:
            break
        out += ct.take()
    if not ct.finish_reason:
        ct.finish("length")
    return out + ct.take()


def test_plain_text_streams_everything():
    ct = ChoiceText((), VOCAB.__getitem__)
    assert feed_all(ct, [1, 2, 3, 4]) == "Hello world"
    assert ct.finish_reason == "length"


def test_stop_string_across_tokens_is_cut_and_never_sent():
    ct = ChoiceText(("o wo",), VOCAB.__getitem__)
    sent = feed_all(ct, [1, 2, 3, 4])
    assert sent == "Hell"
    assert ct.text == "Hell" and ct.finish_reason == "stop"


def test_held_back_prefix_is_released_when_it_is_not_a_stop():
    ct = ChoiceText(("low",), VOCAB.__getitem__)
    ct.feed(1)
    ct.feed(2)
    assert ct.take() == "Hel"  # "lo" might start "low"
    ct.feed(7)
    assert ct.take() == "lo!"  # "lo!" can no longer become "low"
    ct.finish("length")
    assert ct.take() == ""


def test_multibyte_character_split_over_tokens():
    ct = ChoiceText((), VOCAB.__getitem__)
    ct.feed(5)
    assert ct.take() == ""
    ct.feed(6)
    assert ct.take() == "€"


def test_earliest_of_several_stops_wins():
    ct = ChoiceText(("world", "lo"), VOCAB.__getitem__)
    assert feed_all(ct, [1, 2, 3, 4]) == "Hel"


def test_restore_continues_without_resending():
    first = ChoiceText(("xyz",), VOCAB.__getitem__)
    for t in (1, 2, 3):
        first.feed(t)
    sent = first.take()
    resumed = ChoiceText(("xyz",), VOCAB.__getitem__)
    resumed.restore([1, 2, 3], sent)
    resumed.feed(4)
    resumed.finish("length")
    assert sent + resumed.take() == "Hello world"
