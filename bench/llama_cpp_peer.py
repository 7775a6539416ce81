"""Decode tokens/s of llama.cpp (llama-cpp-python) on a GGUF, for bench.decode's peer row. Run by
the Python that has llama_cpp installed (it need not have kvshare's packages: standard library and
llama_cpp only). Reads a JSON request on stdin, prints a JSON answer:

    {"gguf": PATH, "prompt": [ids], "new_tokens": N, "threads": T}
        ->  {"rate": tok/s, "tokens": [ids], "prefill_ms": ms, "version": V}

The rate counts tokens after the first, like the other rows; ``prefill_ms`` is the time from the
call to the first token (the prompt's evaluation and one sampling), the model already loaded.
"""

import json
import sys
import time

import llama_cpp


def main() -> None:
    request = json.load(sys.stdin)
    llm = llama_cpp.Llama(model_path=request["gguf"], n_ctx=len(request["prompt"]) + request["new_tokens"] + 8,
                          n_threads=request["threads"], n_batch=512, verbose=False)
    tokens, t0 = [], 0.0
    began = time.perf_counter()
    for token in llm.generate(request["prompt"], top_k=1, top_p=1.0, temp=0.0, repeat_penalty=1.0):
        tokens.append(int(token))
        if len(tokens) == 1:
            t0 = time.perf_counter()
        if len(tokens) == request["new_tokens"]:
            break
    rate = (len(tokens) - 1) / (time.perf_counter() - t0)
    json.dump({"rate": rate, "tokens": tokens, "prefill_ms": (t0 - began) * 1e3, "version": llama_cpp.__version__},
              sys.stdout)


if __name__ == "__main__":
    main()
