"""Streamed text deltas concatenate to the detokenised output and never split a character."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.engine.text_stream import TextStream
from services.runtime.tokenizer import TextTokenizer

TEXT = "Zürich → 日本語 🙂🚀 café naïve ∑∞ and plain words. " * 3


@pytest.fixture(scope="module")
def tokenizer(tiny_model) -> TextTokenizer:
    return TextTokenizer(tiny_model / "tokenizer.json")


def stream_all(tokenizer, ids, stop=()):
    stream = TextStream(tokenizer, stop)
    deltas = []
    for t in ids:
        deltas.append(stream.push(t))
        if stream.stopped:
            break
    deltas.append(stream.finish())
    return deltas, stream


def test_multibyte_text_streams_whole_characters(tokenizer):
    ids = tokenizer.encode(TEXT)
    # Byte-level BPE splits these characters over several tokens: the case that matters.
    assert any("\ufffd" in tokenizer.decode([t]) for t in ids)
    deltas, _ = stream_all(tokenizer, ids)
    assert "".join(deltas) == tokenizer.decode(ids) == TEXT
    assert not any("\ufffd" in d for d in deltas)


def test_random_ids_concatenate_to_decode(tokenizer):
    rng = np.random.default_rng(3)
    for _ in range(50):
        ids = rng.integers(0, 512, size=int(rng.integers(1, 40))).tolist()
        deltas, _ = stream_all(tokenizer, ids)
        assert "".join(deltas) == tokenizer.decode(ids)


def test_stop_string_ends_output_and_is_not_sent(tokenizer):
    ids = tokenizer.encode("alpha beta STOP gamma delta")
    deltas, stream = stream_all(tokenizer, ids, stop=["STOP"])
    assert stream.stopped
    assert "".join(deltas) == "alpha beta "
    assert not any("S" in d for d in deltas)


def test_stop_string_before_an_unfinished_character_stops_at_once(tokenizer):
    # A byte-level token can hold a whole character and the first byte of the next one: the stop
    # string completes inside that token while the text still ends in an unfinished character.
    split = next(i for i in range(512) if tokenizer.decode([i]) == " \ufffd")
    ids = tokenizer.encode("alpha") + [split]
    stream = TextStream(tokenizer, ["a "])
    sent = "".join(stream.push(t) for t in ids)
    assert stream.stopped and sent == "alph"


def test_partial_stop_prefix_is_released_when_not_a_stop(tokenizer):
    ids = tokenizer.encode("one ST two STOX three")
    deltas, stream = stream_all(tokenizer, ids, stop=["STOP"])
    assert not stream.stopped
    assert "".join(deltas) == "one ST two STOX three"


class PieceTokenizer:
    """Token i decodes to ``pieces[i]``: text streams of any shape, without a real vocabulary."""

    def __init__(self, pieces: list[str]) -> None:
        self.pieces = pieces

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


def first_stop_cut(pieces: list[str], stops: list[str]) -> tuple[str, bool]:
    """What the stream must send in all: the text up to the piece that completes a stop string, cut
    before the earliest-starting stop string in it; or all of it when none completes."""
    text = ""
    for piece in pieces:
        text += piece
        starts = [text.find(s) for s in stops if s in text]
        if starts:
            return text[: min(starts)], True
    return text, False


def held_back(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    return max((n for s in stops for n in range(1, len(s)) if text.endswith(s[:n])), default=0)


def check_stream(pieces: list[str], stops: list[str]) -> None:
    stream = TextStream(PieceTokenizer(pieces), stops)
    sent, text = "", ""
    for i, piece in enumerate(pieces):
        sent += stream.push(i)
        text += piece
        if stream.stopped:
            break
        # Everything that cannot begin a stop string is sent at once, nothing that can is.
        assert sent == text[: len(text) - held_back(text, stops)]
    sent += stream.finish()
    assert (sent, stream.stopped) == first_stop_cut(pieces, stops)


@settings(max_examples=400, deadline=None, derandomize=True, database=None)
@given(pieces=st.lists(st.text("abé", min_size=1, max_size=4), min_size=1, max_size=30),
       stops=st.lists(st.text("abé", min_size=1, max_size=6), min_size=1, max_size=40))
def test_overlapping_stops_match_the_definition(pieces, stops):
    check_stream(pieces, stops)


def test_deeply_overlapping_stops():
    # Every stop is a prefix, suffix or infix of others: the automaton's failure and output links
    # all matter. The text holds back up to 70 characters, then completes only the longest stop.
    stops = ["a" * n + "b" for n in range(1, 60)] + ["ba" * n for n in range(2, 40)] + ["b" + "a" * 70 + "c"]
    check_stream(["b"] + ["a"] * 70 + ["x", "c", "b", "a", "a", "a"], stops)
    pieces = ["b"] + ["a"] * 70 + ["c"]
    assert first_stop_cut(pieces, stops) == ("", True)
    check_stream(pieces, stops)


def test_thousands_of_stops():
    stops = [f"<{i}>" for i in range(5000)] + ["a" * n for n in range(2, 200)]
    pieces = ["x<", "12", "3", "4", "9", ">", "<49", "99", ">y"]
    deltas, stream = stream_all(PieceTokenizer(pieces), range(len(pieces)), stops)
    assert stream.stopped and "".join(deltas) == "x<12349>" == first_stop_cut(pieces, stops)[0]
