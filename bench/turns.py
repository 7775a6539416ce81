"""How much of a chat's second turn is served from the first turn's published answer.

Two workers A and B share one Redis. Each conversation asks one question under the demo's support
manual as system message: turn 1 on A ([system, user], greedy), then turn 2 on B ([system, user,
assistant = turn 1's text, user 2], as every chat client sends it). A stream that ends by EOS, a
stop token id or its length publishes the full blocks of its prompt and its generated tokens but
the last (whose K/V was never computed), so turn 2 finds turn 1's answer on a replica that never
saw it. For each turn 2: its prompt tokens, the tokens hit, the part of the hit taken from turn 1's
answer, the share of turn 1's prompt + answer reused, and where the rest went:

- ``retok``: tokens of turn 1's prompt + answer that turn 2's prompt no longer holds: the answer's
  text, tokenized again inside the template, differs from the generated ids from there on;
- ``last``: the last generated token (the EOS ``<|im_end|>`` that ended turn 1, or the last token of
  a length-limited answer) was never fed to the model, so it has no K/V;
- ``partial``: tokens in the last, partial block, which is never shared.

Every hit is also checked against the one these predict from the Tokenize RPC's ids (``expected``).
All conversations share the system prompt's blocks, as they would in a fleet; publishes are
awaited by counting keys in Redis before the next request. The model is SmolLM2's fp32 folder
(float activations): a folder whose matmuls quantize activations, such as the default gguf one,
publishes no answers (README, "Storage dtype").

    .venv/bin/python -m bench.turns [--smoke] [--model DIR]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from bench.fleet import BenchModel, fleet, parse_args, print_table, wait_for_keys
from kvshare.v1 import generator_pb2 as pb
from services.client import complete
from services.local.demo import QUESTIONS as DEMO_QUESTIONS
from services.local.demo import system_prompt
from services.local.model_catalogue import fetch_model
from services.local.redis_process import RedisServer, stored_values

# The demo's six questions get long answers (SmolLM2 runs to the length limit under the manual);
# these four end by EOS, after 3 to 86 tokens. In the answer to the last one the model spells
# "ville" as "v" + "ille", which the tokenizer, given the text, merges into one token.
QUESTIONS = (*DEMO_QUESTIONS,
             "Is the Lyon store open on Mondays? Answer yes or no.",
             "What is the phone line's opening time?",
             "What is your name?",
             "What does 'vélo' mean?")
SMOKE_QUESTIONS = (QUESTIONS[0], QUESTIONS[7])
FOLLOW_UPS = ("Thank you. Can you say that in one sentence?", "And what if I live outside France?")
CALL_TIMEOUT_S = 300.0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def messages(*turns: tuple[str, str]) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=role, content=content) for role, content in turns]


def conversation(f, question: str, follow_up: str, max_new_tokens: int) -> dict:
    """Turn 1 on A, its publishes awaited, turn 2 on B; the hit and where the rest of turn 1 went."""
    a, b = f.stubs
    size = f.block_size
    turn1 = messages(("system", system_prompt()), ("user", question))
    prompt1 = list(a.Tokenize(pb.TokenizeRequest(messages=turn1)).token_ids)
    before = stored_values(f.client)
    first = complete(a, pb.GenerateRequest(messages=turn1, max_new_tokens=max_new_tokens), CALL_TIMEOUT_S)
    answer, finish = first.token_ids, first.last.finish_reason
    assert finish in (pb.FINISH_REASON_EOS, pb.FINISH_REASON_LENGTH), pb.FinishReason.Name(finish)
    stored = len(prompt1) + len(answer) - 1  # the last generated token has no K/V
    wait_for_keys(f.client, before + stored // size - first.last.usage.cached_prompt_tokens // size)

    turn2 = messages(("system", system_prompt()), ("user", question), ("assistant", first.text), ("user", follow_up))
    prompt2 = list(b.Tokenize(pb.TokenizeRequest(messages=turn2)).token_ids)
    common = common_prefix(prompt1 + answer, prompt2)
    usable = min(common, stored)
    expected = min(usable // size * size, len(prompt2) - 1)
    before = stored_values(f.client)
    second = complete(b, pb.GenerateRequest(messages=turn2, max_new_tokens=1), CALL_TIMEOUT_S).last
    hit = second.usage.cached_prompt_tokens
    assert second.usage.prompt_tokens == len(prompt2)
    # Turn 2 publishes the blocks of its prompt it computed (one token generated: no answer blocks).
    wait_for_keys(f.client, before + len(prompt2) // size - min(usable, len(prompt2)) // size)
    total1 = len(prompt1) + len(answer)
    return {
        "finish": pb.FinishReason.Name(finish).removeprefix("FINISH_REASON_"), "prompt1": len(prompt1),
        "answer": len(answer), "prompt2": len(prompt2), "hit": hit, "expected": expected,
        "from_answer": max(0, hit - len(prompt1)), "prompt_only": len(prompt1) // size * size,
        "reused": hit / total1, "retok": total1 - common, "last": common - usable, "partial": usable - hit,
    }


def main() -> int:
    args = parse_args(__doc__.splitlines()[0], lambda p: p.add_argument(
        "--max-new-tokens", type=int, default=128, help="turn 1's answer length limit (greedy)"))
    folder = args.model or fetch_model("smollm2-135m-instruct", weights="fp32")
    model = BenchModel.of(folder, None if args.model else "SmolLM2-135M-Instruct")
    questions, block_sizes, max_new = (SMOKE_QUESTIONS, (16,), 16) if args.smoke else \
        (QUESTIONS, (16, 64), args.max_new_tokens)
    rows, summary, wrong = [], [], []
    with RedisServer() as server:
        for size in block_sizes:
            results = []
            with fleet(model, block_size=size, redis_server=server, extra_args=("--not-serving-s", "0")) as f:
                for i, question in enumerate(questions):
                    r = conversation(f, question, FOLLOW_UPS[i % len(FOLLOW_UPS)], max_new)
                    results.append(r)
                    if r["hit"] != r["expected"]:
                        wrong.append(f"block {size}, conversation {i + 1}: hit {r['hit']}, expected {r['expected']}")
                    rows.append((size, i + 1, r["finish"], r["prompt1"], r["answer"], r["prompt2"], r["hit"],
                                 r["expected"], r["from_answer"], r["hit"] - r["prompt_only"], f"{r['reused']:.1%}",
                                 r["retok"], r["last"], r["partial"]))
            print(f"block size {size} done", flush=True)
            n = len(results)
            answer_tokens = sum(r["answer"] for r in results)
            summary.append((size, n, sum(r["answer"] for r in results) / n,
                            sum(r["from_answer"] for r in results) / n,
                            f"{sum(r['from_answer'] for r in results) / answer_tokens:.1%}",
                            f"{sum(r['reused'] for r in results) / n:.1%}",
                            sum(r["retok"] for r in results) / n, sum(r["last"] for r in results) / n,
                            sum(r["partial"] for r in results) / n))
    print_table(
        f"{model.name}, demo system prompt, turn 1 greedy up to {max_new} tokens on replica A, turn 2 on replica B",
        ("block", "conv", "turn 1 end", "turn 1 prompt", "answer", "turn 2 prompt", "hit", "expected", "hit from answer",
         "gain over prompt blocks", "reused of turn 1", "retok", "last", "partial"), rows)
    print_table("Means per conversation",
                ("block", "conversations", "answer tokens", "hit from answer", "of answer tokens",
                 "reused of turn 1", "retok", "last", "partial"), summary)
    if wrong:
        print("\nFAILED: hits other than the prediction: " + "; ".join(wrong), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
