"""The SentencePiece tokenizer built from Gemma 3 270M's GGUF fields against llama.cpp's own ids and
text on the same GGUF (tests/fixtures/gemma3/llama_cpp_reference.json, from bench/gemma_references.py),
and the builder's rules on small vocabularies that need no GGUF."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from services.engine.request_limits import utf8_length
from services.modelbuild.spm_tokenizer import (
    SpmVocabulary,
    TokenType,
    score_merges,
    spm_tokenizer,
)
from services.runtime.tokenizer import TextTokenizer, TokenBytes

REFERENCE = json.loads((Path(__file__).parent / "fixtures" / "gemma3" / "llama_cpp_reference.json")
                       .read_text(encoding="utf-8"))
TEXTS = REFERENCE["tokenize"]
BYTES = [f"<0x{b:02X}>" for b in range(256)]


@pytest.fixture(scope="module")
def gemma_folder(gemma3) -> Path:
    """The tokenizer `kvshare fetch-model gemma-3-270m` wrote, built from the GGUF's fields."""
    return gemma3


@pytest.fixture(scope="module")
def gemma(gemma_folder) -> TextTokenizer:
    """As a served model's prompts and chat templates are tokenized: special tokens are parsed."""
    return TextTokenizer(gemma_folder / "tokenizer.json")


@pytest.fixture(scope="module")
def gemma_plain(gemma_folder) -> Tokenizer:
    """Control tokens' text taken as text, as llama.cpp's ``special=False``."""
    tokenizer = Tokenizer.from_file(str(gemma_folder / "tokenizer.json"))
    tokenizer.encode_special_tokens = True
    return tokenizer


def test_the_reference_is_of_the_catalogues_gguf():
    from services.local.model_catalogue import CATALOGUE

    assert REFERENCE["gguf_sha256"] == CATALOGUE["gemma-3-270m"].member_sha256


def test_generation_ends_where_llama_cpp_ends_it(gemma_folder):
    config = json.loads((gemma_folder / "genai_config.json").read_text())
    assert config["model"]["eos_token_id"] == REFERENCE["end_of_generation_ids"]
    assert config["model"]["bos_token_id"] == 2


@pytest.mark.parametrize("record", TEXTS, ids=range(len(TEXTS)))
def test_text_ids_equal_llama_cpp(gemma_plain, record):
    assert gemma_plain.encode(record["text"]).ids == record["ids"]


@pytest.mark.parametrize("record", TEXTS, ids=range(len(TEXTS)))
def test_ids_with_special_tokens_equal_llama_cpp(gemma, record):
    assert gemma.encode(record["text"]) == record["ids_special"]


@pytest.mark.parametrize("record", TEXTS, ids=range(len(TEXTS)))
def test_decoding_gives_llama_cpp_text(gemma, record):
    """The text comes back, but for control tokens, which read as nothing, and a literal '▁', which
    reads as a space (in llama.cpp too)."""
    assert gemma.decode(record["ids"]) == record["detokenized"] == record["text"].replace("▁", " ")
    assert gemma.decode(record["ids_special"]) == record["detokenized_special"]


@pytest.mark.parametrize("run", REFERENCE["greedy"], ids=lambda r: f"{r['prompt_tokens']}_tokens")
def test_prompts_of_the_greedy_reference_encode_as_llama_cpp(gemma, run):
    assert gemma.encode(run["prompt"]) == run["prompt_ids"]
    assert gemma.decode(run["prompt_ids"]) == run["prompt"]


@pytest.fixture(scope="module")
def gemma_token_bytes(gemma) -> TokenBytes:
    return gemma.token_bytes()


def test_token_bytes_bound_the_text_a_token_stands_for(gemma, gemma_plain, gemma_token_bytes):
    """Nothing drops text (a space becomes a longer '▁', unknown characters their bytes), and the
    longest entry in UTF-8 is one token, so the derived prompt limit is tight."""
    longest = max(gemma_plain.get_vocab(with_added_tokens=False), key=lambda t: len(t.encode()))
    assert gemma_token_bytes == TokenBytes(len(longest.encode()), None)
    assert len(gemma.encode(longest.replace("▁", " "))) == 2  # <bos> and the entry itself


@settings(max_examples=200, deadline=None, derandomize=True, database=None)
@given(text=st.text(min_size=1, max_size=300))
def test_no_text_fits_fewer_tokens_than_the_bound(gemma, gemma_token_bytes, text):
    assert len(gemma.encode(text)) >= math.ceil(utf8_length(text) / gemma_token_bytes.longest)


def toy(pieces: dict[str, float], types: dict[str, int] | None = None, **changes) -> SpmVocabulary:
    """Control tokens <pad> <eos> <bos> <unk>, the 256 byte tokens, then ``pieces`` with their scores."""
    types = types or {}
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", *BYTES, *pieces]
    kinds = [TokenType.CONTROL] * 4 + [TokenType.BYTE] * 256 + [types.get(p, TokenType.NORMAL) for p in pieces]
    fields = {"tokens": tokens, "scores": [0.0] * 260 + list(pieces.values()), "token_types": [int(k) for k in kinds],
              "bos_token_id": 2, "eos_token_id": 1, "unk_token_id": 3, "pad_token_id": 0, "add_bos_token": True,
              "add_space_prefix": False}
    return SpmVocabulary(**{**fields, **changes})


def encode(vocab: SpmVocabulary, text: str) -> list[str]:
    tokenizer = Tokenizer.from_str(spm_tokenizer(vocab).tokenizer_json)
    return [tokenizer.id_to_token(i) for i in tokenizer.encode(text).ids]


def test_the_highest_scoring_pair_merges_first_wherever_it_is():
    pieces = {"a": -10, "b": -11, "c": -12, "▁": -13, "ab": -2, "bc": -1, "▁a": -3, "\n": -1000}
    vocab = toy(pieces, {"\n": TokenType.USER_DEFINED})
    assert encode(vocab, "abc") == ["<bos>", "a", "bc"]
    assert encode(vocab, " ab") == ["<bos>", "▁", "ab"]
    assert encode(vocab, " ac\nz") == ["<bos>", "▁a", "c", "\n", "<0x7A>"]
    assert encode(vocab, "<bos>") == ["<bos>", "<bos>"]
    assert encode(vocab, "") == ["<bos>"]


def test_user_defined_tokens_that_end_generation_are_control_tokens():
    """llama.cpp makes ``</s>`` a control token (it ends generation): cut only when special tokens
    are parsed and read as nothing, while ``<s>`` stays user-defined: always cut, read as text."""
    pieces = {"<": -1, "/": -2, "s": -3, ">": -4, "</s>": -1000, "<s>": -1000}
    tokenizer = Tokenizer.from_str(spm_tokenizer(toy(pieces, {"</s>": TokenType.USER_DEFINED,
                                                              "<s>": TokenType.USER_DEFINED})).tokenizer_json)
    assert [tokenizer.id_to_token(i) for i in tokenizer.encode("</s><s>").ids] == ["<bos>", "</s>", "<s>"]
    tokenizer.encode_special_tokens = True
    ids = tokenizer.encode("</s><s>").ids
    assert [tokenizer.id_to_token(i) for i in ids] == ["<bos>", "<", "/", "s", ">", "<s>"]
    assert tokenizer.decode([tokenizer.token_to_id("</s>"), *ids], skip_special_tokens=True) == "</s><s>"


def test_merges_rank_every_split_by_the_merged_entrys_score():
    assert score_merges(["a", "b", "c", "ab", "bc", "abc"], [0, 0, 0, -2, -1, -3]) == \
        [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]


def test_what_llama_cpp_would_cut_otherwise_is_refused():
    runs = {" " * n: -1000 for n in range(2, 6)}
    spm_tokenizer(toy(runs, dict.fromkeys(runs, TokenType.USER_DEFINED)))
    overlapping = {"<x": -1000, "x>y": -1000}  # llama.cpp cuts "<x>y" into "<", "x>y"
    with pytest.raises(ValueError, match="overlap"):
        spm_tokenizer(toy(overlapping, dict.fromkeys(overlapping, TokenType.USER_DEFINED)))
    with pytest.raises(ValueError, match="add_space_prefix"):
        spm_tokenizer(toy({"a": -1}, add_space_prefix=True))
