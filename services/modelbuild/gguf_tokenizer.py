"""The tokenizer files of a converted GGUF, chosen by its ``tokenizer.ggml.model``: ``gpt2``
(byte-level BPE with merges: tokenizer_build.tokenizer_from_vocabulary) or ``llama``
(SentencePiece, Gemma 3's: spm_tokenizer), each tokenizing as llama.cpp does."""

from __future__ import annotations

from services.modelbuild.gguf_model import PRE_TOKENIZERS, GGUFModel
from services.modelbuild.spm_tokenizer import (
    SpmVocabulary,
    end_of_generation_ids,
    spm_tokenizer,
)
from services.modelbuild.tokenizer_build import (
    TokenizerFiles,
    tokenizer_from_vocabulary,
)


def tokenizer_from_gguf(source: GGUFModel) -> TokenizerFiles:
    if source.tokenizer_model == "gpt2":
        return tokenizer_from_vocabulary(source.tokens, source.token_types, source.merges,
                                         PRE_TOKENIZERS[source.pre_tokenizer], source.bos_token_id,
                                         source.eos_token_id, source.pad_token_id, source.chat_template)
    return spm_tokenizer(_vocabulary(source))


def stop_token_ids(source: GGUFModel) -> list[int]:
    """The ids at which llama.cpp ends generation on this vocabulary: its EOS, and for SentencePiece
    vocabularies the end-of-turn tokens it recognises by name (Gemma 3: ``<eos>``,
    ``<end_of_turn>``, ``</s>``)."""
    if source.tokenizer_model == "gpt2":
        return [source.eos_token_id]
    return end_of_generation_ids(_vocabulary(source))


def _vocabulary(source: GGUFModel) -> SpmVocabulary:
    return SpmVocabulary(
        tokens=source.tokens, scores=list(source.scores or [0.0] * len(source.tokens)),
        token_types=source.token_types, bos_token_id=source.bos_token_id, eos_token_id=source.eos_token_id,
        unk_token_id=source.unknown_token_id if source.unknown_token_id is not None else 0,
        pad_token_id=source.pad_token_id, add_bos_token=source.add_bos_token,
        add_space_prefix=source.add_space_prefix, chat_template=source.chat_template,
    )
