"""What kvshare knows about a model folder, read from its genai_config.json and ONNX file.

A model folder is in ONNX Runtime GenAI's layout: ``genai_config.json`` names the ONNX file and its
input/output names, head counts, context length and special token ids; ``tokenizer.json`` sits
beside it. Nothing here is hard-coded per model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import onnx
from google.protobuf.message import DecodeError

from services.audio.log_mel import AudioFeatures
from services.errors import ModelLoadError
from services.runtime.kv_layout import KVLayout
from services.runtime.layer_windows import (
    LayerWindows,
    quantizes_activations,
    read_layer_windows,
)

FINGERPRINT_VERSION = b"kvshare-model-fingerprint-v1"


@dataclass(frozen=True, slots=True)
class KVNames:
    """Per-layer names of the self-attention cache tensors.

    SEPARATE layout: ``past[i] == (key_name, value_name)``; COMBINED: ``past[i] == (name,)`` with a
    leading K/V axis of size 2.
    """

    layout: KVLayout
    past: tuple[tuple[str, ...], ...]
    present: tuple[tuple[str, ...], ...]

    @property
    def flat_past(self) -> list[str]:
        return [name for layer in self.past for name in layer]

    @property
    def flat_present(self) -> list[str]:
        return [name for layer in self.present for name in layer]


@dataclass(frozen=True, slots=True)
class EncoderSpec:
    """The encoder of an encoder-decoder model: one input (token ids or float features) in, the
    cross-attention K/V of every decoder layer out (each ``[batch, heads, encoder_seq, head]``)."""

    onnx_path: Path
    input_name: str
    cross_outputs: tuple[tuple[str, str], ...]
    """Per decoder layer, the encoder's (key, value) output names."""
    cross_inputs: tuple[tuple[str, str], ...]
    """Per decoder layer, the decoder's (key, value) input names for the same tensors."""
    context_length: int | None
    """Most encoder input tokens, where the model states it."""


@dataclass(frozen=True, slots=True)
class LayerGroup:
    """Decoder layers that read the same span of earlier positions."""

    layers: tuple[int, ...]
    window: int = 0
    """Positions a query of these layers sees, its own included; 0: every earlier position."""


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A decoder model's geometry, names and identity (all lengths in tokens)."""

    name: str
    folder: Path
    onnx_path: Path
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    context_length: int
    vocab_size: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    input_ids_name: str
    attention_mask_name: str | None
    position_ids_name: str | None
    logits_name: str
    kv: KVNames
    past_present_share_buffer: bool
    """genai_config's search.past_present_share_buffer: the graph can append K/V in place."""
    fingerprint: str
    encoder: EncoderSpec | None = None
    """Set for encoder-decoder models."""
    decoder_start_token_id: int | None = None
    """First decoder token of an encoder-decoder model when the request has no decoder prompt."""
    audio: AudioFeatures | None = None
    """How audio becomes the encoder's input, for an encoder-decoder model whose folder has a
    preprocessor_config.json (Whisper); None: the model takes no audio."""
    windows: LayerWindows = LayerWindows()
    """The self-attention layers that see only the last ``windows.window`` positions (read from the
    graph: ``layer_windows``); a continuation needs only that much of their cached K/V."""

    quantized_activations: bool = False
    """The graph's matmuls round activations to 8 bits (``layer_windows.quantizes_activations``)."""

    def kv_bytes_per_token(self, element_size: int, layers: int | None = None) -> int:
        """Self-attention K/V bytes one token occupies in ``layers`` layers (default: all of them):
        2 x layers x kv_heads x head_size x element."""
        return 2 * (self.num_layers if layers is None else layers) * self.num_kv_heads * self.head_size * element_size

    @property
    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """The layers that read every earlier position, then (if any) the windowed ones."""
        windowed = self.windows.layers
        full = LayerGroup(tuple(i for i in range(self.num_layers) if i not in windowed))
        return (full, LayerGroup(windowed, self.windows.window)) if windowed else (full,)

    @property
    def layer_order(self) -> tuple[int, ...]:
        """The layers grouped as the store keeps them: those that read every earlier position, then
        the windowed ones, each group ascending (the model's own order when nothing is windowed)."""
        return tuple(layer for group in self.layer_groups for layer in group.layers)


def _kv_names(inputs: dict, outputs: dict, num_layers: int) -> KVNames:
    if "past_names" in inputs:
        layout = KVLayout.COMBINED
        past = tuple((inputs["past_names"] % i,) for i in range(num_layers))
        present = tuple((outputs["present_names"] % i,) for i in range(num_layers))
    else:
        layout = KVLayout.SEPARATE
        pk = inputs.get("past_key_names", "past_key_values.%d.key")
        pv = inputs.get("past_value_names", "past_key_values.%d.value")
        ok = outputs.get("present_key_names", "present.%d.key")
        ov = outputs.get("present_value_names", "present.%d.value")
        past = tuple((pk % i, pv % i) for i in range(num_layers))
        present = tuple((ok % i, ov % i) for i in range(num_layers))
    return KVNames(layout=layout, past=past, present=present)


def _encoder_spec(folder: Path, model: dict, num_layers: int) -> EncoderSpec:
    encoder, decoder = model["encoder"], model["decoder"]
    enc_out, dec_in = encoder["outputs"], decoder["inputs"]
    return EncoderSpec(
        onnx_path=folder / encoder["filename"],
        input_name=next(iter(encoder["inputs"].values())),
        cross_outputs=tuple((enc_out["cross_present_key_names"] % i, enc_out["cross_present_value_names"] % i)
                            for i in range(num_layers)),
        cross_inputs=tuple((dec_in["cross_past_key_names"] % i, dec_in["cross_past_value_names"] % i)
                           for i in range(num_layers)),
        context_length=encoder.get("context_length"),
    )


def _model_files(folder: Path, filename: str) -> list[Path]:
    """The ONNX file and its external-data files, in a fixed order."""
    main = folder / filename
    extra = sorted(p for p in folder.iterdir() if p.is_file() and p.name.startswith(filename) and p != main)
    return [main, *extra]


def fingerprint(files: list[Path], kv_shaping_config: dict) -> str:
    """sha256 over the model files' bytes and the configuration that shapes the K/V (hex)."""
    digest = hashlib.sha256(FINGERPRINT_VERSION)
    for path in files:
        digest.update(path.name.encode() + b"\0")
        with path.open("rb") as f:
            digest.update(hashlib.file_digest(f, "sha256").digest())
    digest.update(json.dumps(kv_shaping_config, sort_keys=True, separators=(",", ":")).encode())
    return digest.hexdigest()


def _graph(onnx_path: Path) -> onnx.GraphProto:
    """The decoder's graph without its external data. A file onnx cannot parse is an empty graph
    here (no windows, no quantization): opening the session says what is wrong with it."""
    try:
        return onnx.load(str(onnx_path), load_external_data=False).graph
    except DecodeError:
        return onnx.GraphProto()


def load_model_spec(folder: Path) -> ModelSpec:
    """Reads ``folder/genai_config.json``; raises ModelLoadError with the reason when unusable."""
    config_path = folder / "genai_config.json"
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
        model = config["model"]
        decoder = model["decoder"]
        inputs, outputs = decoder["inputs"], decoder["outputs"]
        num_layers = int(decoder["num_hidden_layers"])
        num_heads = int(decoder["num_attention_heads"])
        num_kv_heads = int(decoder.get("num_key_value_heads", num_heads))
        head_size = int(decoder.get("head_size") or decoder["hidden_size"] // num_heads)
        eos = model["eos_token_id"]
        eos_ids = tuple(int(e) for e in (eos if isinstance(eos, list) else [eos]))
        onnx_path = folder / decoder["filename"]
        files = _model_files(folder, decoder["filename"])
        encoder = _encoder_spec(folder, model, num_layers) if "encoder" in model else None
        if encoder is not None:
            files += _model_files(folder, model["encoder"]["filename"])
        kv = _kv_names(inputs, outputs, num_layers)
        graph = _graph(onnx_path)
        windows = (read_layer_windows(graph, [names[0] for names in kv.present])
                   if kv.layout is KVLayout.SEPARATE else LayerWindows())
        shaping = {
            "layers": num_layers, "heads": num_heads, "kv_heads": num_kv_heads, "head_size": head_size,
            "layout": kv.layout.value, "past": kv.flat_past, "present": kv.flat_present,
            "encoder": encoder is not None,
        }
        return ModelSpec(
            name=folder.resolve().name,
            folder=folder,
            onnx_path=onnx_path,
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_size=head_size,
            context_length=int(model["context_length"]),
            vocab_size=int(model["vocab_size"]),
            bos_token_id=model.get("bos_token_id"),
            eos_token_ids=eos_ids,
            input_ids_name=inputs.get("input_ids", "input_ids"),
            attention_mask_name=inputs.get("attention_mask"),
            position_ids_name=inputs.get("position_ids"),
            logits_name=outputs.get("logits", "logits"),
            kv=kv,
            past_present_share_buffer=bool(config.get("search", {}).get("past_present_share_buffer", False)),
            fingerprint=fingerprint(files, shaping),
            encoder=encoder,
            decoder_start_token_id=model.get("decoder_start_token_id", model.get("bos_token_id")),
            audio=AudioFeatures.from_folder(folder) if encoder is not None else None,
            windows=windows,
            quantized_activations=quantizes_activations(graph),
        )
    except FileNotFoundError as exc:
        raise ModelLoadError(f"{exc.filename}: not found; a model folder needs genai_config.json and its ONNX file") from exc
    except (KeyError, TypeError, ValueError) as exc:
        raise ModelLoadError(f"{config_path}: missing or malformed field {exc}") from exc
