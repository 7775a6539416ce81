"""Builds the byte-level BPE tokenizer that ships with every seeded model folder.

The training text is the embedded English/Unicode/code sample (corpus.txt) plus a seeded stream of
made-up words, so that the requested vocabulary size is actually reached. The same arguments give
the same tokenizer.json bytes in every process: training input, order and settings are fixed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

BOS_TOKEN = "<s>"
EOS_TOKEN = "</s>"
PAD_TOKEN = "<pad>"
SPECIAL_TOKENS = (BOS_TOKEN, EOS_TOKEN, PAD_TOKEN)

_SYLLABLES = (
    "ka ri to mu se la po ne vi da qu ar en th in or st ch sh pr tr bl gr fl ow ea ou io "
    "al el il ol ul an on un er ir ur ex im de re co pro sub ing ed ly ment tion ness"
).split()


@dataclass(frozen=True, slots=True)
class TokenizerFiles:
    """The JSON documents of a tokenizer folder: tokenizer.json and tokenizer_config.json."""

    tokenizer_json: str
    tokenizer_config_json: str
    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    pad_token_id: int


def _training_lines(seed: int, words: int) -> list[str]:
    corpus = resources.files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 5, size=words)
    picks = rng.integers(0, len(_SYLLABLES), size=int(lengths.sum()))
    made_up, start = [], 0
    for n in lengths.tolist():
        made_up.append("".join(_SYLLABLES[i] for i in picks[start : start + n]))
        start += n
    lines = corpus.splitlines() * 4
    lines += [" ".join(made_up[i : i + 12]) for i in range(0, len(made_up), 12)]
    return lines


def build_tokenizer(vocab_size: int, seed: int = 0) -> TokenizerFiles:
    """Trains a byte-level BPE of exactly ``vocab_size`` entries (special tokens at ids 0, 1, 2)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_training_lines(seed, words=vocab_size * 8), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise ValueError(f"tokenizer reached {tokenizer.get_vocab_size()} entries, not {vocab_size}")
    ids = [tokenizer.token_to_id(tok) for tok in SPECIAL_TOKENS]
    return tokenizer_files(tokenizer, vocab_size, *ids, chat_template=None)


def tokenizer_files(tokenizer: Tokenizer, vocab_size: int, bos: int, eos: int, pad: int, chat_template: str | None, *,
                    unk: int | None = None, tokenizer_class: str = "GPT2Tokenizer",
                    add_bos_token: bool = False) -> TokenizerFiles:
    """tokenizer.json and a tokenizer_config.json naming the transformers class, the special
    tokens (the unknown token is ``eos`` unless given) and the chat template, if any."""
    token = tokenizer.id_to_token
    config = {
        "tokenizer_class": tokenizer_class,
        "bos_token": token(bos),
        "eos_token": token(eos),
        "pad_token": token(pad),
        "unk_token": token(eos if unk is None else unk),
        "add_bos_token": add_bos_token,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
        **({"chat_template": chat_template} if chat_template else {}),
    }
    return TokenizerFiles(
        tokenizer_json=tokenizer.to_str(pretty=True),
        tokenizer_config_json=json.dumps(config, indent=2, sort_keys=True) + "\n",
        vocab_size=vocab_size, bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
    )


def tokenizer_from_vocabulary(tokens: list[str], token_types: list[int], merges: list[str], pre_tokenizer: tuple[str, ...],
                              bos_token_id: int, eos_token_id: int, pad_token_id: int,
                              chat_template: str | None) -> TokenizerFiles:
    """The byte-level BPE tokenizer of a converted model, from its vocabulary and merges (GGUF's
    ``tokenizer.ggml.*``). ``pre_tokenizer`` lists llama.cpp's splits in order: ``digits`` (every
    digit alone), then ``gpt2`` (GPT-2's regular expression). Control tokens (type 3) are special
    tokens: matched whole in the input, never split, skipped when decoding."""
    from tokenizers import AddedToken

    steps = {"digits": pre_tokenizers.Digits(individual_digits=True),
             "gpt2": pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)}
    tokenizer = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)},
                                     merges=[tuple(m.split(" ", 1)) for m in merges], fuse_unk=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([steps[s] for s in pre_tokenizer])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t, kind in zip(tokens, token_types, strict=True) if kind == 3])
    return tokenizer_files(tokenizer, len(tokens), bos_token_id, eos_token_id, pad_token_id, chat_template)
