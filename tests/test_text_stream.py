"""Streamed text deltas concatenate to the detokenised output and never split a character."""

import numpy as np
import pytest

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
