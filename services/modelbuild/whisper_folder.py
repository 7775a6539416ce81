"""Writes a Whisper model folder from CTranslate2's files (``model.bin``, ``config.json``,
``tokenizer.json``), in ONNX Runtime GenAI's Whisper layout plus the two Hugging Face files that
say how to feed it:

- ``encoder.onnx`` / ``decoder.onnx`` and ``genai_config.json`` (services/modelbuild/whisper_graph.py);
- ``tokenizer.json``: the model's own, less its post-processor (which wraps every encode in
  ``<|startoftranscript|><|notimestamps|> … <|endoftext|>``): prompt text is encoded bare, as
  faster-whisper does (``add_special_tokens=False``), and the server adds the special tokens;
- ``generation_config.json``: ``decoder_start_token_id``, ``forced_decoder_ids`` (the rest of the
  start sequence), ``prev_sot_token_id`` (before a text prompt), ``no_timestamps_token_id``,
  ``suppress_tokens`` (faster-whisper's default: CTranslate2's ``suppress_ids`` plus the task and
  start tokens it adds itself) and ``begin_suppress_tokens`` (``suppress_ids_begin``);
- ``preprocessor_config.json``: the log-mel parameters (Hugging Face's WhisperFeatureExtractor keys).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer

from services.modelbuild import encdec_graph, whisper_graph
from services.modelbuild.ctranslate2_model import (
    CTranslate2FormatError,
    read_ctranslate2_model,
)
from services.modelbuild.folder import DECODER_FILE, ENCODER_FILE, search_options
from services.modelbuild.graph_dtype import convert_model

SAMPLING_RATE, HOP_LENGTH, N_FFT = 16000, 160, 400
"""Whisper's audio front end (every released model): 16 kHz, 10-ms frames, 25-ms windows."""
_ADDED_SUPPRESS = ("<|transcribe|>", "<|translate|>", "<|startoftranscript|>", "<|startofprev|>",
                   "<|startoflm|>", "<|nocaptions|>")
"""The tokens faster-whisper's get_suppressed_tokens adds to the model's list (``<|nocaptions|>``
is tiny.en's no-speech token)."""


def _token(tokenizer: Tokenizer, text: str) -> int:
    token = tokenizer.token_to_id(text)
    if token is None:
        raise CTranslate2FormatError(f"the tokenizer has no {text} token")
    return token


def generation_config(tokenizer: Tokenizer, ct2_config: dict, context_length: int) -> dict:
    start, no_timestamps = _token(tokenizer, "<|startoftranscript|>"), _token(tokenizer, "<|notimestamps|>")
    added = [t for t in (tokenizer.token_to_id(s) for s in _ADDED_SUPPRESS) if t is not None]
    return {
        "decoder_start_token_id": start,
        "forced_decoder_ids": [[1, no_timestamps]],
        "prev_sot_token_id": _token(tokenizer, "<|startofprev|>"),
        "no_timestamps_token_id": no_timestamps,
        "eos_token_id": _token(tokenizer, "<|endoftext|>"),
        "suppress_tokens": sorted(set(ct2_config.get("suppress_ids", [])) | set(added)),
        "begin_suppress_tokens": list(ct2_config.get("suppress_ids_begin", [])),
        "max_length": context_length,
    }


def preprocessor_config(shape: whisper_graph.WhisperShape) -> dict:
    frames = 2 * shape.audio_positions  # the stride-2 convolution halves the frames
    return {
        "feature_extractor_type": "WhisperFeatureExtractor",
        "feature_size": shape.mels,
        "sampling_rate": SAMPLING_RATE,
        "hop_length": HOP_LENGTH,
        "n_fft": N_FFT,
        "chunk_length": frames * HOP_LENGTH // SAMPLING_RATE,
        "n_samples": frames * HOP_LENGTH,
        "nb_max_frames": frames,
        "padding_value": 0.0,
    }


def genai_config(shape: whisper_graph.WhisperShape, start: int, eos: int) -> dict:
    g = encdec_graph
    heads = {"head_size": shape.hidden_size // shape.decoder_heads, "hidden_size": shape.hidden_size,
             "num_attention_heads": shape.decoder_heads, "num_key_value_heads": shape.decoder_heads}
    session = {"log_id": "onnxruntime-genai", "provider_options": []}
    return {
        "model": {
            "bos_token_id": start,
            "context_length": shape.text_positions,
            "decoder_start_token_id": start,
            "encoder": {
                "session_options": session, "filename": ENCODER_FILE, **heads,
                "num_hidden_layers": shape.encoder_layers,
                "inputs": {"audio_features": whisper_graph.AUDIO_INPUT},
                "outputs": {"cross_present_key_names": g.CROSS_KEY, "cross_present_value_names": g.CROSS_VALUE},
            },
            "decoder": {
                "session_options": session, "filename": DECODER_FILE, **heads,
                "num_hidden_layers": shape.decoder_layers,
                "inputs": {"input_ids": "input_ids", "past_key_names": g.PAST_SELF_KEY, "past_value_names": g.PAST_SELF_VALUE,
                           "cross_past_key_names": g.PAST_CROSS_KEY, "cross_past_value_names": g.PAST_CROSS_VALUE},
                "outputs": {"logits": "logits", "present_key_names": g.PRESENT_SELF_KEY,
                            "present_value_names": g.PRESENT_SELF_VALUE},
            },
            "eos_token_id": eos,
            "pad_token_id": eos,
            "type": "whisper",
            "vocab_size": shape.vocab_size,
        },
        "search": search_options(shape.text_positions, share_buffer=False),
    }


def write_whisper_folder(source: Path, out_dir: Path, dtype: str = "float32") -> Path:
    """Converts the CTranslate2 Whisper model in ``source`` into ``out_dir`` (created), its float
    tensors in ``dtype`` (graph_dtype.MODEL_DTYPES); raises CTranslate2FormatError when the files
    are not a Whisper model this converter reads."""
    model = read_ctranslate2_model(source / "model.bin")
    shape = whisper_graph.WhisperShape.of(model)
    ct2_config = json.loads((source / "config.json").read_text(encoding="utf-8"))
    tokenizer = Tokenizer.from_file(str(source / "tokenizer.json"))
    tokenizer.post_processor = None
    generation = generation_config(tokenizer, ct2_config, shape.text_positions)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / ENCODER_FILE).write_bytes(convert_model(whisper_graph.build_encoder(model, shape), dtype).SerializeToString())
    (out_dir / DECODER_FILE).write_bytes(convert_model(whisper_graph.build_decoder(model, shape), dtype).SerializeToString())
    documents = {
        "genai_config.json": genai_config(shape, generation["decoder_start_token_id"], generation["eos_token_id"]),
        "generation_config.json": generation,
        "preprocessor_config.json": preprocessor_config(shape),
    }
    for name, document in documents.items():
        (out_dir / name).write_text(json.dumps(document, indent=4) + "\n", encoding="utf-8")
    tokenizer.save(str(out_dir / "tokenizer.json"))
    return out_dir
