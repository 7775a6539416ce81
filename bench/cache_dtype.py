"""What storing K/V at half size costs in accuracy: logits over K/V that went through the store in
each storage dtype, against computing the whole prompt.

For each prompt: the cold run computes the whole prompt and 200 greedy tokens, keeping every
step's logits. For each dtype, the prompt's cached blocks (the K/V of the block-aligned shared
prefix, from the cold run) are narrowed to the dtype and widened into a fresh cache exactly as a
worker does it, the rest of the prompt runs over them, and the cold run's tokens are fed one by one
(teacher forcing), so that each of the 201 positions compares the same context. Reported per
dtype: the largest |logit difference|, top-1 agreement (every position agreeing means the greedy
output is identical), prompts whose 201 tokens all agree, and the smallest cold top-1/top-2 margin
those agreements relied on.

Prompts: the bench model gets 20 random prompts of 512 shared + 32 own tokens; a folder with a chat
template (``--model``, e.g. SmolLM2) gets the demo's support manual as system message and 20
different questions.

    .venv/bin/python -m bench.cache_dtype [--smoke] [--model DIR] [--tokens 200]
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import numpy as np

from bench.fleet import bench_model, parse_args, print_table
from cachestore.storage_dtype import STORAGE_DTYPES
from services.local.demo import QUESTIONS, system_prompt
from services.runtime.chat_template import Message, load_chat_template
from services.runtime.model_spec import load_model_spec
from services.runtime.onnx_decoder import DecoderSession
from services.runtime.tokenizer import TextTokenizer

BLOCK = 64
MORE_QUESTIONS = (
    "Do you sell children's bikes?", "What is the warranty on an e-bike battery?",
    "Can I pay in three instalments?", "How do I book a repair?", "Is there a store in Bordeaux?",
    "Can I change the delivery address after ordering?", "Do you take old bikes back?",
    "What sizes do your helmets come in?", "How long does a click-and-collect order take?",
    "Can I rent a bike for a weekend?", "Do gift cards expire?", "What if my parcel arrives damaged?",
    "Do you ship to Switzerland?", "How do I cancel an order?",
)


@dataclass
class Result:
    max_abs: float = 0.0
    positions: int = 0
    agreed: int = 0
    prompts_identical: int = 0
    margins: list[float] = field(default_factory=list)


def prompts(folder, smoke: bool, vocab: int) -> list[tuple[list[int], int]]:
    """(token ids, cached prefix tokens) per prompt."""
    template = load_chat_template(folder)
    count = 3 if smoke else 20
    if template is None:
        rng = np.random.default_rng(5)
        shared = rng.integers(3, vocab, size=128 if smoke else 512).tolist()
        return [(shared + rng.integers(3, vocab, size=32).tolist(), len(shared)) for _ in range(count)]
    tokenizer = TextTokenizer(folder / "tokenizer.json")
    system = Message("system", system_prompt())
    rendered = [tokenizer.encode(template.render([system, Message("user", q)]))
                for q in (QUESTIONS + MORE_QUESTIONS)[:count]]
    common = min(next(i for i, (x, y) in enumerate(zip(a, rendered[0], strict=False)) if x != y)
                 for a in rendered[1:])
    return [(ids, common // BLOCK * BLOCK) for ids in rendered]


def greedy_logits(session: DecoderSession, cache, first: list[int], feed: list[int] | None, steps: int) -> np.ndarray:
    """Logits after ``first`` and after each next token: ``feed``'s (teacher forcing) or the argmax."""
    logits, cache = session.run(first, cache)
    out = [logits]
    for i in range(steps):
        token = feed[i] if feed is not None else int(np.argmax(out[-1]))
        logits, cache = session.run([token], cache)
        out.append(logits)
    return np.stack(out)


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument("--tokens", type=int, default=200))
    model = bench_model(args)
    steps = 16 if args.smoke else args.tokens
    session = DecoderSession(load_model_spec(model.folder), "cpu", 2)
    results = {name: Result() for name in STORAGE_DTYPES}
    cases = prompts(model.folder, args.smoke, model.vocab_size)
    for n, (ids, cached) in enumerate(cases):
        capacity = len(ids) + steps + 1
        cold_cache = session.empty_cache(capacity)
        prefix_logits, cold_cache = session.run(ids[:cached], cold_cache)
        prefix = session.to_canonical(cold_cache, cached)
        cold = greedy_logits(session, cold_cache, ids[cached:], None, steps)
        tokens = [int(t) for t in cold.argmax(-1)]
        top2 = np.sort(cold, axis=-1)[:, -2:]
        margin = top2[:, 1] - top2[:, 0]
        for name, dtype in STORAGE_DTYPES.items():
            stored = np.ascontiguousarray(prefix.astype(dtype))
            warm = greedy_logits(session, session.cache_from_blocks([stored], cached, capacity), ids[cached:],
                                 tokens, steps)
            r = results[name]
            agree = warm.argmax(-1) == cold.argmax(-1)
            r.max_abs = max(r.max_abs, float(np.abs(warm - cold).max()))
            r.positions += len(agree)
            r.agreed += int(agree.sum())
            r.prompts_identical += bool(agree.all())
            r.margins.append(float(margin[agree].min()))
        print(f"prompt {n + 1}/{len(cases)}: {len(ids)} tokens, {cached} cached", file=sys.stderr, flush=True)
    itemsize = {name: dtype.itemsize for name, dtype in STORAGE_DTYPES.items()}
    spec = session.spec
    rows = [(name, spec.kv_bytes_per_token(itemsize[name]), f"{r.max_abs:.2e}", f"{100 * r.agreed / r.positions:.2f}%",
             f"{r.prompts_identical}/{len(cases)}", f"{min(r.margins):.4f}") for name, r in results.items()]
    print_table(f"{model.name}: {len(cases)} prompts, {steps + 1} greedy positions each, K/V of the cached prefix "
                f"({cases[0][1]} tokens) through each storage dtype vs computing it",
                ("storage dtype", "stored bytes/token", "max abs Δ logit", "top-1 agreement", "prompts identical",
                 "smallest margin relied on"), rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
