"""The tokenizer files of a converted GGUF, chosen by its ``tokenizer.ggml.model``.

``gpt2`` (byte-level BPE with merges) is tokenizer_build.tokenizer_from_vocabulary. ``llama``
(SentencePiece, Gemma 3's) is, for now, ``_sentencepiece_placeholder``: a Unigram over the
vocabulary and scores that loads and round-trips text but does not split exactly as llama.cpp's
SentencePiece-BPE does; it is to be replaced by the exact one (services/modelbuild/spm_tokenizer.py).
"""

from __future__ import annotations

from services.modelbuild.gguf_model import PRE_TOKENIZERS, GGUFModel
from services.modelbuild.tokenizer_build import (
    TokenizerFiles,
    _files,
    tokenizer_from_vocabulary,
)

_CONTROL, _USER_DEFINED = 3, 4


def tokenizer_from_gguf(source: GGUFModel) -> TokenizerFiles:
    if source.tokenizer_model == "gpt2":
        return tokenizer_from_vocabulary(source.tokens, source.token_types, source.merges,
                                         PRE_TOKENIZERS[source.pre_tokenizer], source.bos_token_id,
                                         source.eos_token_id, source.pad_token_id, source.chat_template)
    return _sentencepiece_placeholder(source)


def _sentencepiece_placeholder(source: GGUFModel) -> TokenizerFiles:
    """A Unigram over ``tokens`` with ``scores``, byte fallback, spaces as ``▁``, BOS first when
    the file says so; control and user-defined tokens matched whole."""
    from tokenizers import (
        AddedToken,
        Tokenizer,
        decoders,
        models,
        normalizers,
        processors,
    )

    pieces = [(t, s) for t, s in zip(source.tokens, source.scores or [0.0] * len(source.tokens), strict=True)]
    tokenizer = Tokenizer(models.Unigram(pieces, unk_id=source.unknown_token_id, byte_fallback=True))
    steps = [normalizers.Prepend("▁")] if source.add_space_prefix else []
    tokenizer.normalizer = normalizers.Sequence([*steps, normalizers.Replace(" ", "▁")])
    tokenizer.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    tokenizer.add_tokens([AddedToken(t, special=kind == _CONTROL, normalized=False)
                          for t, kind in zip(source.tokens, source.token_types, strict=True)
                          if kind in (_CONTROL, _USER_DEFINED)])
    if source.add_bos_token:
        bos = source.tokens[source.bos_token_id]
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, source.bos_token_id)])
    return _files(tokenizer, len(source.tokens), source.bos_token_id, source.eos_token_id, source.pad_token_id,
                  source.chat_template)
