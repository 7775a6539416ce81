"""A Hugging Face tokenizer that tokenizes as llama.cpp's SentencePiece tokenizer does, built from a
GGUF's ``tokenizer.ggml.*`` fields (``tokenizer.ggml.model = 'llama'``: a vocabulary with scores
and no merges).

What llama.cpp does (``llama_vocab::impl::tokenize`` and ``llm_tokenizer_spm_session`` in
llama-vocab.cpp) and how each step is reproduced here:

1. Control and unknown tokens (only when special tokens are parsed) and user-defined tokens
   (always) are cut out of the raw text, longest token first. Here they are added tokens matched
   on the raw text, leftmost-longest; control ones are "special" (``encode_special_tokens`` turns
   their matching off, as llama.cpp's ``special=False`` does). llama.cpp makes every token whose
   text ends generation a control token whatever its GGUF type (``END_OF_GENERATION_TEXTS``), and
   so does this. The two orders cut the same pieces unless an added token's end overlaps another's
   start, which ``spm_tokenizer`` refuses.
2. In each remaining piece every ``' '`` becomes ``'▁'`` (a ``Replace`` normalizer).
3. The piece is split into characters, and the adjacent pair whose concatenation is a vocabulary
   entry of the highest score is merged, again and again (on equal scores the leftmost pair). Here
   that is a BPE model whose merges are every split of every vocabulary entry into two entries,
   ranked by the entry's score. Different splits of one entry share a score in llama.cpp but get
   distinct ranks here, so the two could part where two such splits compete at once; on Gemma 3's
   vocabulary no text found does that (tests/test_gemma_tokenizer.py).
4. A character that is no vocabulary entry becomes its UTF-8 bytes' ``<0xXX>`` tokens
   (``byte_fallback``).
5. ``<bos>`` goes in front when the GGUF says ``add_bos_token``.

Decoding turns ``'▁'`` back into ``' '`` and byte tokens into their bytes; user-defined tokens
read as their text, control tokens as nothing (``skip_special_tokens``), as llama.cpp's
``token_to_piece`` without ``special`` does. (It also reads unused tokens, type 5, as nothing;
here they read as their text. Gemma 3 has none.)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers, processors

from services.modelbuild.tokenizer_build import TokenizerFiles, tokenizer_files

SPACE = "▁"
"""U+2581, the character SentencePiece writes for a space."""
END_OF_GENERATION_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>", "<｜end▁of▁sentence｜>", "[e~[",
})
"""Token texts that llama.cpp (llama-vocab.cpp, ``special_eog_ids``) takes to end generation, and
therefore makes control tokens whatever their GGUF type: Gemma 3's user-defined ``</s>`` is cut
from the text only when special tokens are parsed, and reads as nothing."""
_UNREPRODUCED_TEXTS = frozenset({"<|channel|>", "<|message|>", "<|start|>", "<|constrain|>", "<|plamo:eos|>",
                                 "<|tool_response>"})
"""Texts for which llama.cpp changes other tokens' types in ways not reproduced here."""


class TokenType(IntEnum):
    """``tokenizer.ggml.token_type`` values (llama.h's ``llama_token_type``)."""

    NORMAL = 1
    UNKNOWN = 2
    CONTROL = 3
    USER_DEFINED = 4
    UNUSED = 5
    BYTE = 6


@dataclass(frozen=True, slots=True)
class SpmVocabulary:
    """The GGUF fields of a SentencePiece vocabulary, as plain values."""

    tokens: list[str]
    """``tokenizer.ggml.tokens``; the index is the id."""
    scores: list[float]
    """``tokenizer.ggml.scores``: higher merges first."""
    token_types: list[int]
    """``tokenizer.ggml.token_type`` (``TokenType``)."""
    bos_token_id: int
    eos_token_id: int
    unk_token_id: int
    pad_token_id: int
    add_bos_token: bool
    """``tokenizer.ggml.add_bos_token``."""
    add_space_prefix: bool
    """``tokenizer.ggml.add_space_prefix`` (only False is supported)."""
    chat_template: str | None = None


def end_of_generation_ids(vocab: SpmVocabulary) -> list[int]:
    """The ids at which llama.cpp stops generating, ascending: the EOS token and the tokens whose
    text is one of ``END_OF_GENERATION_TEXTS`` (llama.cpp adds EOT, EOM and FIM ids a GGUF names;
    ``SpmVocabulary`` carries none)."""
    return sorted({vocab.eos_token_id, *(i for i, t in enumerate(vocab.tokens) if t in END_OF_GENERATION_TEXTS)})


def score_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Every split of every vocabulary entry into two entries, as BPE merges: highest score of the
    merged entry first, then lower id, then the longer left part (the order among one entry's
    splits is a choice: llama.cpp has none, it merges the leftmost). Linear in the vocabulary's
    total length: about 0.5 M merges from 262 k entries in a second or two."""
    ids = {t: i for i, t in enumerate(tokens)}
    ranked = []
    for i, token in enumerate(tokens):
        for cut in range(len(token) - 1, 0, -1):
            left, right = token[:cut], token[cut:]
            if left in ids and right in ids:
                ranked.append((-scores[i], i, -cut, left, right))
    ranked.sort()
    return [(left, right) for *_, left, right in ranked]


def _check_added_tokens(texts: list[str]) -> None:
    """Refuses added tokens where llama.cpp's cutting (longest token first, each at all its places)
    and the tokenizers library's matching (leftmost, then longest) can differ: a proper suffix of a
    token that is a prefix of another token at least as long. Runs of one character are exempt
    among themselves: in a run both cut the longest run token at the run's start first."""
    by_first: dict[str, list[str]] = {}
    for text in texts:
        by_first.setdefault(text[0], []).append(text)
    for text in texts:
        for k in range(1, len(text)):
            suffix = text[k:]
            for other in by_first.get(suffix[0], ()):
                if other != text and len(other) >= len(text) and other.startswith(suffix) \
                        and set(text + other) != {suffix[0]}:
                    raise ValueError(f"added tokens {text!r} and {other!r} overlap; llama.cpp would cut them "
                                     "in another order than the tokenizer matches them")


def spm_tokenizer(vocab: SpmVocabulary) -> TokenizerFiles:
    """tokenizer.json and tokenizer_config.json that tokenize and decode as llama.cpp does with
    this vocabulary (the module's docstring says how); ValueError for a vocabulary where that
    cannot be done. About 2.5 s for Gemma 3's 262,144 entries on two cores."""
    if vocab.add_space_prefix:
        raise ValueError("add_space_prefix: llama.cpp's leading space before each piece is not reproduced")
    tokens, types = vocab.tokens, vocab.token_types
    if not len(tokens) == len(vocab.scores) == len(types):
        raise ValueError(f"{len(tokens)} tokens, {len(vocab.scores)} scores, {len(types)} token types")
    known = set(tokens)
    missing = [f"<0x{b:02X}>" for b in range(256) if f"<0x{b:02X}>" not in known]
    if missing:
        raise ValueError(f"no byte tokens {missing[:4]}...: characters outside the vocabulary cannot be encoded")
    if odd := sorted(_UNREPRODUCED_TEXTS.intersection(tokens)):
        raise ValueError(f"tokens {odd}: llama.cpp changes token types for them in ways not reproduced")
    control = {i for i, (t, kind) in enumerate(zip(tokens, types, strict=True))
               if kind in (TokenType.CONTROL, TokenType.UNKNOWN) or t in END_OF_GENERATION_TEXTS}
    cut_always = [t for i, (t, kind) in enumerate(zip(tokens, types, strict=True))
                  if kind == TokenType.USER_DEFINED and i not in control]
    cut_special = [tokens[i] for i in sorted(control)]
    _check_added_tokens(cut_always + cut_special)

    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=score_merges(tokens, vocab.scores),
                                     unk_token=tokens[vocab.unk_token_id], fuse_unk=False, byte_fallback=True))
    tokenizer.normalizer = normalizers.Replace(" ", SPACE)
    tokenizer.decoder = decoders.Sequence([decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in cut_always])
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in cut_special])
    bos = tokens[vocab.bos_token_id]
    if vocab.add_bos_token:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, vocab.bos_token_id)])
    return tokenizer_files(tokenizer, len(tokens), vocab.bos_token_id, vocab.eos_token_id, vocab.pad_token_id,
                           vocab.chat_template, unk=vocab.unk_token_id,
                           # transformers' SentencePiece BPE without a leading space
                           tokenizer_class="GemmaTokenizer",
                           add_bos_token=vocab.add_bos_token)
