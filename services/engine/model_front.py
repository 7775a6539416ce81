"""What a worker reads of its model folder before the weights: the model's spec, its generation
defaults, its tokenizer and the request limits they give.

Read first, before the worker's ports are served, because the largest valid request message
follows from the limits (``RequestLimits.message_bytes``) and a gRPC server's receive bound is
fixed when the server is built: a message announcing more is then refused on its length, before
its bytes are held. Seconds at most (Gemma 3's 262k-token vocabulary: ~5 s here), where loading the
sessions is the rest of the load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from services.engine.engine_options import EngineOptions
from services.engine.request_limits import RequestLimits, limits_for
from services.runtime.generation_config import GenerationDefaults
from services.runtime.model_spec import ModelSpec, load_model_spec
from services.runtime.tokenizer import TextTokenizer


@dataclass(frozen=True, slots=True)
class ModelFront:
    spec: ModelSpec
    defaults: GenerationDefaults
    tokenizer: TextTokenizer
    limits: RequestLimits

    @classmethod
    def read(cls, folder: Path, options: EngineOptions) -> ModelFront:
        """Raises ModelLoadError naming what in ``folder`` cannot be used (the folder's own files
        first, before ``options`` are used)."""
        spec = load_model_spec(folder)
        defaults = GenerationDefaults.from_folder(folder, spec.vocab_size)
        tokenizer = TextTokenizer(folder / "tokenizer.json")
        return cls(spec, defaults, tokenizer,
                   limits_for(spec, tokenizer, options.max_prompt_bytes, options.max_stop_strings,
                              options.max_stop_string_bytes, options.max_answer_bytes))
