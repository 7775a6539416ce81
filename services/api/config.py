"""Worker configuration: one typed object, from command-line flags over ``KVSHARE_*`` variables.

Precedence: a flag given on the command line, else the environment variable ``KVSHARE_<FIELD>``
(upper-case field name), else the default below; ``services/serving/flags.py`` holds those rules,
which the router's settings (``services/route/config.py``) follow under a prefix of their own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from cachestore.storage_dtype import CHOICES as CACHE_DTYPES
from cachestore.storage_dtype import DEFAULT as DEFAULT_CACHE_DTYPE
from services.runtime.device_choice import DeviceChoice
from services.runtime.threads import SPINNING
from services.serving.flags import FlagSettings

ENV_PREFIX = "KVSHARE_"


@dataclass(slots=True)
class Settings(FlagSettings):
    """Everything ``kvshare serve`` can be told. Units are in the names (ms, bytes, s)."""

    env_prefix: ClassVar[str] = ENV_PREFIX

    model: Path | None = field(default=None, metadata={"help": "Model folder in ONNX Runtime GenAI's layout (genai_config.json, *.onnx, tokenizer.json)."})
    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on; 0.0.0.0 inside a container."})
    port: int = field(default=50051, metadata={"help": "TCP port; 0 picks a free one (the chosen port is printed)."})
    metrics_port: int = field(default=0, metadata={"min": 0, "help": "Port of the Prometheus /metrics endpoint (on --host; a port of its own, not for gRPC clients); 0 = no metrics."})
    http_port: int = field(default=0, metadata={"min": 0, "max": 65535, "help": "Port (on --host) of the OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions, /v1/audio/transcriptions, /v1/models, /health; over TLS, and mutual TLS, exactly as the gRPC port is; 0 = none."})
    http_timeout_s: float = field(default=0.0, metadata={"min": 0.0, "max": 86400.0, "help": "Deadline of one HTTP API request, its whole stream included; past it the answer is 504 (or a stream ends with an error event). 0 = none."})
    http_max_connections: int = field(default=512, metadata={"min": 1, "max": 1_000_000, "help": "Open connections of the HTTP API; at the limit a new connection takes the place of the one idle longest (no request begun), which is closed; with none idle it is answered 503 (with Retry-After) and closed at once, never queued. 512: above the requests a worker holds at once by default (--max-queued 128 plus up to 64 running) with room for idle keep-alive connections, within the usual soft limit of 1,024 open files; besides its body (--http-max-buffered-bytes) each may hold up to about 0.4 MiB that aiohttp reads ahead."})
    http_max_buffered_bytes: int = field(default=64 * 1024 * 1024, metadata={"min": 1, "help": "Bytes of HTTP request bodies held at once, all requests together, decoded (a compressed body counts what it decodes to; an upload counts its Content-Length, or its whole bound when chunked or compressed); past it a request gets 503 with Retry-After, and a body larger than this alone gets 413. 64 MiB: sixteen of the largest JSON bodies (4 MiB), or two of the largest uploads by default, at once."})
    http_header_timeout_s: float = field(default=10.0, metadata={"min": 0.001, "max": 3600.0, "help": "Seconds from a request's first byte (or a TLS connection's opening) to its complete head, request line and headers; past it the connection is closed. A connection that begins no request is closed after 75 s idle."})
    http_body_timeout_s: float = field(default=60.0, metadata={"min": 0.001, "max": 86400.0, "help": "Seconds a request's body may take to arrive once its head has; past it the answer is 408."})
    cache_url: str = field(default="memory://", metadata={"help": "Shared KV store: memory://, redis://host:port, rediss://, unix://, redis+cluster://, tiered+<redis URL>.", "aliases": ["--cache"]})
    cache_ttl_s: int = field(default=3600, metadata={"help": "Seconds a published block lives in Redis (SET NX EX)."})
    cache_op_timeout_ms: float = field(default=250.0, metadata={"help": "Bounds each socket wait of a store call (a connection to open or come free, a command to send, each reply). A request's waits on a store that stops answering add up to at most twice this in all (lookup, lease claim, windowed layers and cross K/V together, the one retry included); then it computes. Bytes that keep arriving are not cut."})
    cache_connect_timeout_ms: float = field(default=100.0, metadata={"help": "Deadline for opening a connection to the store."})
    cache_max_connections: int = field(default=32, metadata={"help": "Connections per Redis node in the worker's pool."})
    cache_memory_bytes: int = field(default=512 * 1024 * 1024, metadata={"help": "Size bound of the memory:// store."})
    cache_max_value_bytes: int = field(default=128 * 1024 * 1024, metadata={"help": "Cross-attention K/V values larger than this are not stored (skipped, never split); no value longer than this (and 4 KiB of headers) is read from the store: a longer one is a miss, counted and deleted."})
    cache_l1_bytes: int = field(default=256 * 1024 * 1024, metadata={"help": "Size bound of the in-worker L1 of a tiered+ store."})
    cache_tls_ca_file: Path | None = field(default=None, metadata={"help": "CA bundle that signed the Redis server's certificate (rediss:// URLs; default: the system's CAs)."})
    cache_tls_cert_file: Path | None = field(default=None, metadata={"help": "Client certificate for Redis servers that require one (tls-auth-clients yes); needs --cache-tls-key-file."})
    cache_tls_key_file: Path | None = field(default=None, metadata={"help": "Private key of --cache-tls-cert-file."})
    cache_username: str = field(default="", metadata={"help": "Redis ACL user (AUTH username); empty: default, or the URL's."})
    cache_password_file: Path | None = field(default=None, metadata={"help": "File holding the Redis AUTH password (or set KVSHARE_CACHE_PASSWORD); never give a password on the command line."})
    cache_signing_key_file: Path | None = field(default=None, metadata={"help": "Keys that sign cache values, one 'KEY_ID SECRET' line each (secrets of 32+ characters): the first signs, all verify; values that do not verify are never used."})
    cache_namespace_secret_file: Path | None = field(default=None, metadata={"help": "A secret (32+ characters) under which block keys are derived, so that nobody without it can compute or probe a key; the same on every worker."})
    api_keys_file: Path | None = field(default=None, metadata={"help": "Clients must send 'authorization: Bearer KEY'; one 'TENANT_ID SHA256_HEX_OF_KEY' line per key. Tenants never share cached blocks."})
    tls_cert_file: Path | None = field(default=None, metadata={"help": "Serve gRPC over TLS with this certificate chain (PEM); needs --tls-key-file."})
    tls_key_file: Path | None = field(default=None, metadata={"help": "Private key of --tls-cert-file (PEM)."})
    tls_client_ca_file: Path | None = field(default=None, metadata={"help": "Require client certificates signed by this CA (mutual TLS); needs --tls-cert-file."})
    health_port: int = field(default=0, metadata={"min": 0, "max": 65535, "help": "A second, plaintext port (on --host) serving only grpc.health.v1, for probes that speak no TLS (Kubernetes' gRPC probes) while the gRPC port uses TLS; 0 = none."})
    reflection: bool = field(default=True, metadata={"help": "Serve gRPC server reflection (lets grpcurl list and call the API without the .proto files); it also tells any caller the API's shape."})
    breaker_failures: int = field(default=3, metadata={"help": "Consecutive store failures that open the circuit breaker."})
    breaker_backoff_ms: float = field(default=1000.0, metadata={"help": "First pause before the breaker probes the store again (doubles per failed probe)."})
    breaker_max_backoff_ms: float = field(default=30000.0, metadata={"help": "Longest pause between probes of a failing store."})
    cache_required: bool = field(default=False, metadata={"help": "Take this worker out of rotation while its cache store does not answer, for fleets that would rather not compute every prompt: the store is pinged every --breaker-backoff-ms (at least 100 ms apart), and once --breaker-failures pings in a row failed the health service kvshare.v1.Generator (what readiness probes and kvshare route ask) reports NOT_SERVING, until a ping is answered; from the start, until the first one is. Readiness only steers balancers: calls that reach the worker meanwhile are still answered (computed). The whole server's health (\"\": liveness probes, the HTTP /health) stays SERVING, so that a liveness probe never restarts workers for a store outage."})
    device: str = field(default="auto", metadata={"help": "Where the model runs and its K/V slots live: cpu, cuda or cuda:N (a CUDA device; one that cannot be used stops the worker at start, exit 2, never a silent fallback), or auto (CUDA device 0 when onnxruntime-gpu, CuPy and a GPU can be used, else the CPU; the start-up log says which)."})
    intra_op_threads: int = field(default=0, metadata={"help": "ONNX Runtime threads per run; 0 lets ONNX Runtime choose (one per physical core), or, where this process may use fewer CPUs than the machine has (its affinity, or a cgroup CPU quota such as a Kubernetes CPU limit, rounded up), one per usable CPU."})
    intra_op_spinning: str = field(default="in-run", metadata={"help": "When ONNX Runtime's idle intra-op threads spin-wait for the next parallel section instead of sleeping: in-run (within a model run; they sleep as soon as it returns, between steps, while the worker samples, sends and other processes run), always (ONNX Runtime's default: also for a while after each run) or never. in-run decoded one SmolLM2 stream 10-16 per cent faster than never here; always is a few per cent faster still for one stream alone but holds the cores between steps. (The old boolean: true is always, false is never.)", "choices": list(SPINNING)})
    prefault_tokens: int = field(default=2048, metadata={"min": 0, "help": "At start, beside serving, fault in the slot memory of the first this many positions of the first row a request gets (without writing it), so a fresh worker's first warm fetch costs what later ones do: on a virtual machine the first write into never-touched memory is slow (SmolLM2, 1,216 cached tokens: 0.9-1.7 s for the first fetch, 56-82 ms later). Costs that memory (46 KB per token for SmolLM2) from the start. 0 = none."})
    max_batch: int = field(default=0, metadata={"min": 0, "help": "Sequences holding a slot at once (rows of the batched decode step; graphs without a shared GQA past/present buffer and encoder-decoders run each row batch 1); 0 derives it from --kv-cache-bytes (1 to 64)."})
    kv_cache_bytes: int = field(default=0, metadata={"min": 0, "help": "K/V memory for the slots when --max-batch is 0: each slot can hold a whole context. 0: 2 GiB on the CPU; on CUDA 45 per cent of the device's free memory at start (that memory is split once: 10 per cent kept for the CUDA context and libraries, 40 for ONNX Runtime's arenas, split between the model's sessions by their weights, 50 for the K/V bank, whose slots get 90 per cent; GetModelInfo.device_memory and the start-up log give the figures)."})
    max_queued: int = field(default=128, metadata={"min": 0, "help": "Requests waiting for a slot; past this a new call gets RESOURCE_EXHAUSTED at once."})
    max_prefill_tokens_per_step: int = field(default=256, metadata={"min": 1, "help": "Prompt tokens prefilled between two decode steps: bounds the gap between tokens of running streams while long prompts arrive."})
    max_unread_tokens: int = field(default=256, metadata={"min": 1, "help": "A stream whose client has not read this many tokens pauses (keeps its slot) until it reads."})
    max_paused_s: float = field(default=30.0, metadata={"min": 0.001, "max": 86400.0, "help": "A stream paused this long because its client stopped reading is ended, freeing its slot: with FINISH_REASON_ABORT after the tokens already made, or RESOURCE_EXHAUSTED if none had been made."})
    max_unread_bytes: int = field(default=64 * 1024, metadata={"min": 64, "help": "A stream pauses, as at --max-unread-tokens, once its unread tokens' messages would take about this many bytes: with logprobs and 20 top_logprobs a token is ~50x a plain one (64 KiB: ~150 such tokens)."})
    max_client_rows: int = field(default=0, metadata={"min": 0, "help": "Rows (streams; each of n samples and beams is one) one client may hold being prepared, queued or running; one more request gets RESOURCE_EXHAUSTED at once, before it is tokenized. A client is its tenant with --api-keys-file, else its IP address (behind kvshare route without API keys: the router's, so all its callers are one client). 0 = no fixed bound: a client alone may use the whole worker, and when the worker is full a newcomer takes the queue place of the newest queued request of the client holding the most rows (that request gets RESOURCE_EXHAUSTED), while that client holds more than the newcomer would."})
    yield_paused_s: float = field(default=2.0, metadata={"min": 0.0, "max": 86400.0, "help": "While another client's request waits for a slot, a stream paused this long (its client not reading) whose client holds more than its fair part of the slots (--max-batch over the clients running or waiting) is ended (RESOURCE_EXHAUSTED, or an ABORT finish after tokens went out), and the waiting client gets its slot."})
    stream_interval: int = field(default=1, metadata={"min": 1, "max": 256, "help": "Tokens a stream sends at once: 1 sends each token as it is made; N sends every N tokens in one message (the first token, the last, and any held a quarter second at once; a request with stop strings still sends each token, since stops are matched on what is sent), fewer messages and wake-ups per token for the worker and its clients, at up to N tokens' delay (as vLLM's --stream-interval). Measured here (2 vCPUs, one SmolLM2 stream): each message costs the worker about 1 ms of CPU, most of it gRPC's and the event loop's wake-ups (docs/benchmarks.md)."})
    store_read_threads: int = field(default=4, metadata={"min": 1, "help": "Threads for store lookups (never shared with publishes)."})
    store_write_threads: int = field(default=2, metadata={"min": 1, "help": "Threads for publishing blocks to the store."})
    max_new_tokens_cap: int = field(default=4096, metadata={"help": "Largest max_new_tokens a request may ask for."})
    max_message_bytes: int = field(default=32 * 1024 * 1024, metadata={"help": "Largest gRPC request message; larger ones are refused with RESOURCE_EXHAUSTED before any field is read. 32 MiB lets audio through to the checks that name its limit (a 30-s 48 kHz stereo float WAV is 11.5 MB, a 10-minute 16 kHz mono one 19.2 MB and gets INVALID_ARGUMENT saying 30 s is the most; OpenAI's audio upload limit is 25 MB)."})
    max_prompt_bytes: int = field(default=0, metadata={"min": 0, "help": "UTF-8 bytes of a prompt's text (prompt, all messages' roles and contents together, encoder_prompt, Tokenize text or messages); larger ones get INVALID_ARGUMENT before any tokenizing. 0 derives the most text that can fit the context: context length x the longest token's bytes, when every byte of a text lies inside some token (byte-level BPE, SentencePiece BPE); 4x that, logged, for tokenizers that can drop text."})
    max_stop_strings: int = field(default=64, metadata={"min": 0, "help": "Stop strings per request; more get INVALID_ARGUMENT."})
    max_stop_string_bytes: int = field(default=256, metadata={"min": 1, "help": "UTF-8 bytes of one stop string; longer ones get INVALID_ARGUMENT (text that could begin a stop string is held back, up to this long)."})
    tokenizer_threads: int = field(default=2, metadata={"min": 1, "help": "Threads that render chat templates and tokenize, off the event loop (the tokenizer releases the GIL)."})
    audio_threads: int = field(default=1, metadata={"min": 1, "help": "Threads that decode requests' audio (WAV, resampling to 16 kHz, log-mel: up to ~1.4 s of CPU for a 30-s file), apart from the tokenizer threads, so that text requests never wait behind audio."})
    max_audio_requests: int = field(default=8, metadata={"min": 1, "help": "Generate calls to a model that takes audio, from the door until prepared (the body read, the audio decoded or waiting for an audio thread); one more gets RESOURCE_EXHAUSTED at once, before its body is read (each may hold ~130 MB while decoded). One client (tenant, else address) holds at most half of them."})
    max_tokenize_requests: int = field(default=4, metadata={"min": 1, "help": "Tokenize calls in progress, from the door to their answer, on a thread of their own (never ahead of a Generate call's tokenizing); one more gets RESOURCE_EXHAUSTED at once, before its body is read. One client holds at most half of them."})
    request_read_timeout_s: float = field(default=60.0, metadata={"min": 0.0, "max": 86400.0, "help": "Seconds a gRPC call admitted at the door may take to send its request message; past it the call gets RESOURCE_EXHAUSTED and its place is given back (0: no bound)."})
    max_concurrent_rpcs: int = field(default=0, metadata={"min": 0, "help": "gRPC calls in progress at once on the API port, every method together; one more gets RESOURCE_EXHAUSTED from gRPC before anything of it is read. 0: none. Health checks on the API port count too, so that one client holding this many calls open would fail its liveness probes: set it only with --health-port serving the probes."})
    block_size: int = field(default=64, metadata={"min": 1, "help": "Tokens per shared cache block."})
    cache_dtype: str = field(default=DEFAULT_CACHE_DTYPE, metadata={"help": "Element type of K/V in the store: auto (a float16 or bfloat16 model's own dtype; for a float32 model, float32 where its matmuls round activations to 8 bits, such as fetch-model's gguf and int8 folders, where float16 storage moved SmolLM2's logits by up to 0.83, else float16), float16 (half the bytes of float32; greedy answers equal computing on every measured prompt of float models), bfloat16 (half the bytes, coarser: some greedy tokens change) or float32 (bit-identical to computing). Part of every key: workers with different values never share blocks; the start-up log says which one auto chose.", "choices": list(CACHE_DTYPES)})
    lease_wait_factor: float = field(default=2.0, metadata={"min": 0.0, "max": 100.0, "help": "Fleet-wide single-flight: a worker missing a prompt's blocks takes a lease on computing them; one that finds another worker's lease waits for that worker's blocks instead, and computes them itself once they stop coming or come slower than this many times its own expected time to compute them (from its measured prefill pace). 0 = no leases: every worker computes what it lacks."})
    lease_poll_ms: float = field(default=10.0, metadata={"min": 1.0, "max": 1000.0, "help": "How often a worker waiting for another worker's blocks looks for them in the store; while Redis announces the other worker's chunks (pub/sub), it looks when one is announced, and 5 times this apart otherwise."})
    lease_max_ttl_ms: int = field(default=60_000, metadata={"min": 1000, "max": 3_600_000, "help": "The longest a lease on computing a prompt's blocks lives past its holder's latest chunk (its usual life is twice the holder's expected compute time plus 0.5 s, and each chunk published renews it). With --cache-signing-key-file a lease is signed with its expiry, and a worker honours one only while that expiry lies between now minus --lease-clock-skew-ms and now plus this plus the skew: a lease copied from Redis and written back later holds nobody back. Must exceed one prefill chunk's time on the slowest worker."})
    lease_clock_skew_ms: int = field(default=1000, metadata={"min": 0, "max": 600_000, "help": "How far apart the wall clocks of the fleet's workers may be (ms): a signed lease is honoured until this long after its signed expiry, and while its expiry lies no further ahead than --lease-max-ttl-ms plus this."})
    window_fetch: bool = field(default=True, metadata={"help": "Models with sliding-window layers (Gemma 3): a cached run's windowed layers are stored apart and fetched only for the blocks a continuation reads (its last window), the other layers for the whole run. false: every block is one value of every layer, as for other models (workers sharing a store must agree: the two keep different keys)."})
    prefix_fetch: str = field(default="auto", metadata={"help": "auto: on a device (not the CPU provider), a prompt's cached blocks are computed instead of fetched when this worker's running estimates (its prefill pace, the store's latency and bytes/s) expect computing at least twice as fast, once each estimate has 8 observations; counted in kvshare_prefix_fetch_skipped_total. On the CPU provider auto always fetches (fetching wins there by 10-40x for real models). always: always fetch.", "choices": ["auto", "always"]})
    not_serving_s: float = field(default=2.0, metadata={"help": "On SIGTERM, seconds to keep accepting calls while health reports NOT_SERVING, so balancers stop routing here first."})
    drain_s: float = field(default=20.0, metadata={"help": "On SIGTERM, seconds in-flight streams get to finish before the server stops."})
    log_level: str = field(default="INFO", metadata={"help": "Python logging level."})
    log_format: str = field(default="text", metadata={"help": "Log lines as text, or json (one object per line, for log shippers); one line per finished request either way.", "choices": ["text", "json"]})

    def problems(self) -> list[str]:
        """``FlagSettings.problems``, and a ``--device`` that names no device."""
        found = FlagSettings.problems(self)
        try:
            DeviceChoice.parse(self.device)
        except ValueError as exc:
            found.append(f"{exc} (env {ENV_PREFIX}DEVICE)")
        return found
