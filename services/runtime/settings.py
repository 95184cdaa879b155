"""Settings of the Tandem services: the single source of truth of flags, env vars and defaults.

Each process (`tandem gateway|prefill|decode|draft`) is configured by flags, each with an env
fallback `TANDEM_<FLAG_IN_UPPER_SNAKE>`. Precedence: flag > env > default. `--redis-url` also
falls back to the standard `REDIS_URL`.

    ┌─────────────┐   OPTIONS (one row per flag: concern, field, parser, per-service default)
    │ dataclasses │──────────────────────────────────────────────────────────────┐
    └─────────────┘                                                              v
    build_parser(service) -> argparse parser      parse_settings(service, argv, environ)
    add_arguments(parser, service)                settings_from_namespace(service, ns, environ)
    env_vars(service) / default_ports(service)    -> GatewaySettings | PrefillSettings | ...

A service uses it as:

    settings = parse_settings("decode", argv, os.environ)    # raises SettingsError, names the value
    settings.common.grpc_port, settings.engine.block_size, settings.num_speculative_tokens

Settings are frozen dataclasses, one per concern; every field carries its documentation in its
metadata (that text is the flag's --help and the docs/deployment.md table). Values are validated
once, in `__post_init__`, so a settings object built directly (by `tandem up` or a test) is
checked the same way. Nothing here reads the environment at import time.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# parse_size: one size grammar for the engine and the services.
from common.config import CPU_GEMM_ENV, KERNEL_CACHE_ENV, parse_size
from common.models.gguf_convert import resolve_model_path

SERVICES: tuple[str, ...] = ("gateway", "prefill", "decode", "draft")
ENGINE_SERVICES: tuple[str, ...] = ("prefill", "decode", "draft")
ENV_PREFIX = "TANDEM_"

# Standard (non-TANDEM) variables the services read. Tracing is configured only by these.
REDIS_URL_FALLBACK_ENV = "REDIS_URL"
OTEL_ENV_VARS: tuple[str, ...] = (
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_HEADERS",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_TRACES_EXPORTER",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
)
# Read by the engine core's CPU kernels in any process (docs/performance.md), not by a flag.
KERNEL_ENV_VARS: tuple[str, ...] = (CPU_GEMM_ENV, KERNEL_CACHE_ENV)
STANDARD_ENV_VARS: tuple[str, ...] = (REDIS_URL_FALLBACK_ENV, *OTEL_ENV_VARS, *KERNEL_ENV_VARS)

DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("auto", "float32", "bfloat16", "float16")
WEIGHT_DTYPES = ("auto", "bfloat16")
ATTENTION_BACKENDS = ("auto", "torch", "triton")
GATEWAY_MODES = ("disaggregated", "aggregated")
TOOL_CALL_PARSERS = ("auto", "hermes", "llama3_json", "json_block", "qwen")  # services/gateway/tool_parsers.py
PUBLIC_TLS_MODES = ("tls", "mtls", "off")
SPECULATIVE_METHODS = ("none", "draft", "ngram")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
WILDCARD_HOSTS = ("0.0.0.0", "::", "")


class SettingsError(ValueError):
    """A bad setting; the message names the flag/env var and the offending value."""


def tracing_enabled(environ: Mapping[str, str]) -> bool:
    """Tracing is on only when an OTLP endpoint or a traces exporter is set (non-empty, not 'none')."""
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"):
        if environ.get(name, "").strip():
            return True
    return environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() not in ("", "none")


# ---------------------------------------------------------------------------------------------
# Value parsers: str -> typed value; raise ValueError with a short reason.

def parse_bool(text: str) -> bool:
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r} (use true/false, 1/0, yes/no, on/off)")


def _parse_int(text: str) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise ValueError(f"not an integer: {text!r}") from None


def _parse_float(text: str) -> float:
    try:
        value = float(str(text).strip())
    except ValueError:
        raise ValueError(f"not a number: {text!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"not a finite number: {text!r}")
    return value


def _parse_str(text: str) -> str:
    return str(text)


def _parse_list(text: str) -> tuple[str, ...]:
    """A comma-separated env value (TANDEM_API_KEYS=k1,k2) -> its non-empty items."""
    return tuple(item.strip() for item in str(text).split(",") if item.strip())


# ---------------------------------------------------------------------------------------------
# Field declaration helpers: documentation and range checks live in the field's metadata.

def _field(default: Any = dataclasses.MISSING, *, doc: str, choices: Sequence[str] | None = None,
           minimum: float | None = None, maximum: float | None = None,
           min_exclusive: bool = False, flag: str | None = None, env: str | None = None,
           secret: bool = False) -> Any:
    """flag/env override the names derived from the field's; a tuple field is a repeatable flag
    (and a comma-separated env var); secret keeps the value out of repr (and so out of logs)."""
    meta = {"doc": doc, "choices": tuple(choices) if choices else None, "minimum": minimum,
            "maximum": maximum, "min_exclusive": min_exclusive, "flag": flag, "env": env}
    return field(default=default, metadata=meta, repr=not secret)


def _check_fields(obj: Any) -> None:
    """Range/choice checks declared in field metadata; message names the field and value."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if value is None or isinstance(value, (bool, CommonSettings, EngineSettings)):
            continue
        choices, lo, hi = f.metadata.get("choices"), f.metadata.get("minimum"), f.metadata.get("maximum")
        if choices and value not in choices:
            raise _FieldError(f.name, value, f"must be one of {', '.join(choices)}")
        if lo is not None:
            if f.metadata.get("min_exclusive") and not value > lo:
                raise _FieldError(f.name, value, f"must be > {lo:g}")
            if not f.metadata.get("min_exclusive") and value < lo:
                raise _FieldError(f.name, value, f"must be >= {lo:g}")
        if hi is not None and value > hi:
            raise _FieldError(f.name, value, f"must be <= {hi:g}")


class _FieldError(SettingsError):
    """Validation error tied to a field, so the parser can name the flag/env it came from."""

    def __init__(self, field_name: str, value: Any, reason: str) -> None:
        self.field_name, self.value, self.reason = field_name, value, reason
        super().__init__(f"{field_name}={value!r}: {reason}")


# ---------------------------------------------------------------------------------------------
# The settings, one frozen dataclass per concern.

@dataclass(frozen=True)
class CommonSettings:
    """What every service has: the model, its network identity, the Redis registry, logging."""

    model: str = _field(doc="Path to the Hugging Face model folder (config, weights, tokenizer) or a .gguf file; "
                            "the gateway reads only its tokenizer. Required.")
    served_model_name: str | None = _field(None, doc="Model id clients use in requests and "
                                           "/v1/models. Default: the model folder's name.")
    host: str = _field("0.0.0.0", doc="Address to bind the servers to.")
    advertise_host: str | None = _field(None, doc="Address other services use to reach this one "
                                        "(registered in Redis); in Kubernetes the pod IP. Default: "
                                        "--host, or 127.0.0.1 when --host is a wildcard.")
    grpc_port: int = _field(50051, doc="gRPC port (grpc.health.v1 and reflection are served here too).",
                            minimum=1, maximum=65535)
    metrics_port: int | None = _field(None, doc="Port of the Prometheus /metrics endpoint "
                                      "(the gateway serves /metrics on --http-port instead).",
                                      minimum=1, maximum=65535)
    redis_url: str | None = _field(None, doc="Redis server of the registry, e.g. redis://redis:6379/0 "
                                   "(env fallback: TANDEM_REDIS_URL, then REDIS_URL).")
    cluster: str = _field("tandem", doc="Namespace of every Redis key, so clusters can share a Redis.")
    heartbeat_interval: float = _field(1.0, doc="Seconds between registry heartbeats.",
                                       minimum=0.0, min_exclusive=True)
    drain_timeout: float = _field(30.0, doc="On SIGTERM: health NOT_SERVING and leave the registry "
                                  "at once, then let in-flight requests finish for up to this many "
                                  "seconds, then exit 0.", minimum=0.0)
    log_level: str = _field("info", doc="Logging level.", choices=LOG_LEVELS)
    grpc_keepalive: float = _field(30.0, doc="Seconds between the keepalive pings a gRPC server "
                                   "sends on a connection with calls open; a peer that does not "
                                   "answer one within --grpc-keepalive-timeout has its calls "
                                   "cancelled, so a caller whose host vanished (power, partition: no "
                                   "connection reset) frees its reservations and streams then, not at "
                                   "their lease. 0: no pings.", minimum=0.0)
    grpc_keepalive_timeout: float = _field(20.0, doc="Seconds a keepalive ping may wait for its "
                                           "answer (the peer's gRPC core answers, not its Python: a "
                                           "busy peer still does).", minimum=0.0, min_exclusive=True)
    # TLS: one certificate per service, one CA for the whole cluster (`tandem certs` makes both).
    tls_cert: str | None = _field(None, doc="PEM certificate of this service. With --tls-key and "
                                  "--tls-ca, every gRPC server requires client certificates signed "
                                  "by --tls-ca (mTLS) and every channel to another service presents "
                                  "this one; unset: plaintext.")
    tls_key: str | None = _field(None, doc="PEM private key of --tls-cert.")
    tls_ca: str | None = _field(None, doc="PEM CA certificate(s) that sign the cluster's services: "
                                "peers are verified against it.")

    @property
    def keepalive(self) -> tuple[float, float]:
        """(--grpc-keepalive, --grpc-keepalive-timeout), as GrpcServer takes them."""
        return self.grpc_keepalive, self.grpc_keepalive_timeout

    def __post_init__(self) -> None:
        _check_fields(self)
        tls = {"tls_cert": self.tls_cert, "tls_key": self.tls_key, "tls_ca": self.tls_ca}
        if any(tls.values()):  # (the files are read, and checked, when the service starts)
            for name, path in tls.items():
                if not path:
                    raise _FieldError(name, path, "--tls-cert, --tls-key and --tls-ca go together")
        if not self.model:
            raise _FieldError("model", self.model, "is required (path to a Hugging Face model folder)")
        if not self.cluster or not re.fullmatch(r"[A-Za-z0-9_.:-]+", self.cluster):
            raise _FieldError("cluster", self.cluster, "must be non-empty letters, digits, _ . : -")
        if self.redis_url is not None and not re.match(r"^(redis|rediss|unix)://", self.redis_url):
            raise _FieldError("redis_url", self.redis_url, "must start with redis://, rediss:// or unix://")
        if self.served_model_name is None:
            default_name = Path(self.model.rstrip("/"))
            default_name = default_name.stem if default_name.suffix.lower() == ".gguf" else default_name.name
            object.__setattr__(self, "served_model_name", default_name or self.model)
        try:  # a .gguf file: its converted folder (made once, cached)
            object.__setattr__(self, "model", resolve_model_path(self.model))
        except (OSError, ValueError) as e:
            raise _FieldError("model", self.model, str(e)) from e
        if self.advertise_host is None:
            object.__setattr__(self, "advertise_host",
                               "127.0.0.1" if self.host in WILDCARD_HOSTS else self.host)
        if self.metrics_port is not None and self.metrics_port == self.grpc_port:
            raise _FieldError("metrics_port", self.metrics_port, "must differ from grpc_port")

    @property
    def grpc_address(self) -> str:
        """host:port other services dial (what goes into the Redis registry)."""
        return f"{self.advertise_host}:{self.grpc_port}"

    @property
    def tls_enabled(self) -> bool:
        return self.tls_cert is not None


@dataclass(frozen=True)
class EngineSettings:
    """The engine of prefill, decode and draft: device, KV cache, batching budget."""

    device: str = _field("auto", doc="Device to run on; auto picks cuda when available.", choices=DEVICES)
    dtype: str = _field("auto", doc="Weights/activations dtype; auto takes the model config's "
                        "(float32 on CPU).", choices=DTYPES)
    weight_dtype: str = _field("auto", doc="auto (the dtype) or bfloat16: weight matrices stored in "
                               "bf16 (half the bytes per decode step) under float32 math, "
                               "activations and KV cache. Needs dtype float32 (or auto on a "
                               "float32 model).", choices=WEIGHT_DTYPES)
    block_size: int = _field(16, doc="Tokens per KV cache block.", minimum=1, maximum=1024)
    num_kv_blocks: int | None = _field(None, doc="KV cache blocks to allocate; overrides "
                                       "--kv-cache-memory and --gpu-memory-fraction.", minimum=1)
    kv_cache_memory: int | None = _field(None, doc="Bytes for the KV cache (accepts 2GiB, 512MiB, "
                                         "1.5G). Default on CPU: 1GiB.", minimum=1)
    gpu_memory_fraction: float | None = _field(None, doc="CUDA only: fraction of GPU memory for "
                                               "weights + KV cache. Default on CUDA: 0.85.",
                                               minimum=0.0, maximum=1.0, min_exclusive=True)
    max_num_batched_tokens: int | None = _field(None, doc="Token budget of one engine step "
                                                "(prefill chunks + decode tokens). Default: 2048 on "
                                                "CUDA; on CPU sized to ~55 GFLOP of the model's "
                                                "layers (256 tokens for a 135M model, 64-2048).",
                                                minimum=1)
    max_num_seqs: int = _field(128, doc="Most requests running in one step.", minimum=1)
    enable_prefix_caching: bool = _field(True, doc="Reuse KV blocks of identical prompt prefixes.")
    attention_backend: str = _field("auto", doc="Attention implementation; auto: triton on CUDA, "
                                    "torch on CPU.", choices=ATTENTION_BACKENDS)
    torch_threads: int | None = _field(None, doc="torch.set_num_threads for CPU work; default: "
                                       "torch's choice.", minimum=1)
    engine_stall_timeout: float = _field(60.0, doc="Services: an engine thread stuck this many "
                                         "seconds in one step or command turns grpc.health.v1 "
                                         "NOT_SERVING until it comes back.", minimum=0.0,
                                         min_exclusive=True)
    grammar_compile_timeout: float = _field(10.0, doc="Seconds a structured-output grammar may take "
                                            "to compile; a slower one fails its request with 400.",
                                            minimum=0.0, min_exclusive=True)

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.gpu_memory_fraction is not None and self.device == "cpu":
            raise _FieldError("gpu_memory_fraction", self.gpu_memory_fraction,
                              "applies to CUDA only, but device='cpu'")
        if self.weight_dtype == "bfloat16" and self.dtype in ("bfloat16", "float16"):
            raise _FieldError("weight_dtype", self.weight_dtype, f"stores float32 weights in bf16, but dtype={self.dtype}")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.block_size:
            raise _FieldError("max_num_batched_tokens", self.max_num_batched_tokens,
                              f"must be >= block_size ({self.block_size})")


@dataclass(frozen=True)
class GatewaySettings:
    """`tandem gateway`: OpenAI REST + public gRPC Generation service; routes to the workers."""

    common: CommonSettings
    http_port: int = _field(8000, doc="HTTP port: OpenAI REST, GET /health, /v1/models, /metrics.",
                            minimum=1, maximum=65535)
    mode: str = _field("disaggregated", doc="disaggregated: prefill workers compute prompts and "
                       "ship KV to decode; aggregated: decode prefills itself.", choices=GATEWAY_MODES)
    prefill_chunk_size: int = _field(512, doc="Prompt tokens per chunk streamed to prefill.", minimum=1)
    max_queued_requests: int = _field(256, doc="Sequences that may wait beyond what the decode "
                                      "workers run at once (the sum of their --max-num-seqs; a request "
                                      "counts its n, running ones included); past that new requests "
                                      "get 429/RESOURCE_EXHAUSTED.", minimum=0)
    request_timeout: float = _field(600.0, doc="Seconds a request may take end to end before it is "
                                    "aborted.", minimum=0.0, min_exclusive=True)
    migration_limit: int = _field(3, doc="Times one request may move to another decode worker "
                                  "when its worker dies or stalls mid-stream (continuing from the "
                                  "tokens already sent); 0: such a request ends with an error.", minimum=0)
    stall_timeout: float = _field(10.0, doc="Seconds without a token after which the gateway checks "
                                  "the request's decode worker (gRPC health, which follows its "
                                  "engine loop); no SERVING answer: the request is migrated.",
                                  minimum=0.0, min_exclusive=True)
    stall_probe_timeout: float = _field(5.0, doc="Seconds the stall check waits for that health "
                                        "answer, still taking any token that arrives meanwhile; "
                                        "a loaded machine stretches a live worker's answer, so "
                                        "keep it generous (a frozen one never answers).",
                                        minimum=0.0, min_exclusive=True)
    max_request_body_bytes: int = _field(8 * 2**20, doc="Largest REST request body (accepts 8MiB, "
                                         "1MB, or bytes); a bigger one gets 413 before it is read "
                                         "or parsed.", minimum=1)
    max_n: int = _field(128, doc="Most choices (n) one request may ask for (OpenAI's cap); each "
                        "counts against --max-queued-requests' bound.", minimum=1)
    local_sockets: bool = _field(True, doc="Send Generate calls to a decode worker on this host "
                                 "through its Unix socket when it offers one (decode --local-socket), "
                                 "gRPC otherwise; false: always gRPC.")
    tool_call_parser: str = _field("auto", doc="How chat tool calls are read from the model's output: "
                                   "hermes (<tool_call>{...}</tool_call>: Hermes, SmolLM2), "
                                   "llama3_json, json_block (fenced ```json calls of declared tools), "
                                   "qwen (hermes + json_block: Qwen2.5, Qwen2.5-Coder), or auto (chosen "
                                   "from the chat template).",
                                   choices=TOOL_CALL_PARSERS)
    api_keys: tuple[str, ...] = _field((), flag="--api-key", env="TANDEM_API_KEYS", secret=True,
                                       doc="An API key clients must send (REST `Authorization: Bearer "
                                       "KEY`, gRPC `authorization` metadata); repeat the flag for "
                                       "several, or comma-separate them in the env var. No key (and "
                                       "no --api-key-file): no authentication.")
    api_key_file: str | None = _field(None, doc="File of API keys, one per line (blank lines and "
                                      "`#` comments skipped), added to --api-key's.")
    metrics_auth: bool = _field(False, doc="Require an API key on GET /metrics too (GET /health "
                                "stays open).")
    public_tls: str = _field("tls", choices=PUBLIC_TLS_MODES,
                             doc="With --tls-cert: the public ports (HTTP and gRPC) serve TLS with "
                             "this service's certificate (tls), also require a client certificate "
                             "signed by --tls-ca (mtls), or stay plaintext behind a TLS-terminating "
                             "proxy (off). Without --tls-cert they are plaintext.")
    http_fd: int | None = _field(None, doc="Serve HTTP on this inherited listening socket instead "
                                 "of binding --http-port (`tandem up` does this, so the port stays "
                                 "open while a dead gateway's standby takes over).", minimum=0)
    standby_fd: int | None = _field(None, doc="Start as a warm standby (`tandem up --standby-gateway` "
                                    "does this): load the tokenizer, read the registry, probe decode, "
                                    "but bind no port until the launcher writes `serve` on this "
                                    "inherited socket; its EOF ends the process.", minimum=0)

    def __post_init__(self) -> None:
        _check_fields(self)
        if self.http_port == self.common.grpc_port:
            raise _FieldError("http_port", self.http_port, "must differ from grpc_port")
        object.__setattr__(self, "api_keys", tuple(self.api_keys))
        for key in self.api_keys:
            if not key or key != key.strip() or not key.isprintable():
                raise _FieldError("api_keys", "(hidden)", "an API key must be non-empty printable "
                                  "text without surrounding spaces")
        if self.public_tls == "mtls" and not self.common.tls_enabled:
            raise _FieldError("public_tls", self.public_tls, "needs --tls-cert, --tls-key and --tls-ca")


@dataclass(frozen=True)
class PrefillSettings:
    """`tandem prefill`: computes prompt chunks and pushes their KV blocks to decode."""

    common: CommonSettings
    engine: EngineSettings


@dataclass(frozen=True)
class DecodeSettings:
    """`tandem decode`: receives KV, runs continuous batching, optional speculative decoding."""

    common: CommonSettings
    engine: EngineSettings
    num_speculative_tokens: int = _field(0, doc="Draft tokens proposed per step; 0 turns "
                                         "speculation off.", minimum=0, maximum=64)
    speculative_method: str = _field("none", doc="Where proposals come from: a draft worker, "
                                     "n-gram lookup in the context, or none.", choices=SPECULATIVE_METHODS)
    speculative_adaptive: bool = _field(True, doc="Adapt each request's number of draft tokens "
                                        "to its acceptance rate and the measured cost of a draft "
                                        "token (0 up to --num-speculative-tokens); false: always "
                                        "draft --num-speculative-tokens.")
    spec_torch_threads: int | None = _field(None, doc="torch threads of a step that verifies drafts "
                                            "(steps without drafts keep --torch-threads), for a draft "
                                            "worker that drafts on cores given up here while decode "
                                            "verifies (split cores, with draft --lookahead); default: "
                                            "--torch-threads throughout (tandem up: the two take turns "
                                            "on every core).", minimum=1)
    draft_timeout_ms: int = _field(2000, doc="Wait this long for a draft worker's proposal, then "
                                   "decode without speculation for that step (and back off). It "
                                   "only bounds a hung draft: adaptive k already stops drafting "
                                   "where a slow draft does not pay, and a real draft on a CPU "
                                   "takes hundreds of ms per call.", minimum=1)
    stream_interval_ms: float = _field(10.0, doc="Where decode steps are short (a small model), "
                                       "keep stepping a decode-only batch for up to this long and "
                                       "stream those steps' tokens together, one message a request: "
                                       "the per-message cost (gRPC, SSE) is then paid per few tokens. "
                                       "A new request or a prompt to compute ends the run at once, and "
                                       "a request's tokens go out step by step until one shows text "
                                       "(its first text is never held back); steps longer than this "
                                       "stream every token as it comes; 0: stream every step.",
                                       minimum=0.0, maximum=1000.0)
    kv_lease_seconds: float = _field(30.0, doc="A block reservation whose KV has not fully arrived "
                                     "within this time is freed.", minimum=0.0, min_exclusive=True)
    draft_address: str | None = _field(None, doc="host:port of the draft worker to use; default: "
                                       "found in the Redis registry (role draft).")
    local_socket: str | None = _field(None, doc="Also serve Generate on a Unix socket at this path "
                                      "(owner-only), for gateways on the same host: cheaper per request "
                                      "than the gRPC port, which still serves everything (tandem up "
                                      "sets one for each decode worker; services/runtime/local_stream.py). "
                                      "Default: none.")

    def __post_init__(self) -> None:
        _check_fields(self)
        if (self.speculative_method == "none") != (self.num_speculative_tokens == 0):
            raise _FieldError("num_speculative_tokens", self.num_speculative_tokens,
                              f"must be > 0 exactly when speculative_method != 'none' "
                              f"(speculative_method={self.speculative_method!r})")


@dataclass(frozen=True)
class DraftSettings:
    """`tandem draft`: runs the small draft model and proposes tokens for decode, batched."""

    common: CommonSettings
    engine: EngineSettings
    max_num_draft_tokens: int = _field(16, doc="Most draft tokens one Propose may ask for per "
                                       "sequence.", minimum=1, maximum=64)
    lease_seconds: float = _field(60.0, doc="A sequence decode has not touched for this long is "
                                  "freed (a decode worker that died cannot leak draft blocks).",
                                  minimum=0.0, min_exclusive=True)
    lookahead: bool = _field(True, doc="Between Propose calls, keep drafting greedy sequences past "
                             "their proposals (betting they are all accepted), so the next call "
                             "answers without a forward: drafting hides behind the target's "
                             "verification. For a draft on a device of its own; tandem up (draft "
                             "and decode on the same cores) turns it off.")

    def __post_init__(self) -> None:
        _check_fields(self)


# EngineSettings that only a serving process uses (not `tandem generate`).
SERVICE_ONLY_ENGINE_FIELDS = ("engine_stall_timeout",)

ServiceSettings = GatewaySettings | PrefillSettings | DecodeSettings | DraftSettings
SETTINGS_CLASSES: dict[str, type] = {
    "gateway": GatewaySettings, "prefill": PrefillSettings,
    "decode": DecodeSettings, "draft": DraftSettings,
}


# ---------------------------------------------------------------------------------------------
# The option table: one row per flag. Defaults come from the dataclass field unless a service
# overrides them (ports); help text comes from the field's doc.

@dataclass(frozen=True)
class Option:
    """One flag of one service, with its env var, parser, default and documentation."""

    flag: str                         # "--block-size"
    concern: type                     # CommonSettings, EngineSettings or the service's class
    field_name: str                   # attribute on `concern`
    parse: Callable[[str], Any]       # str (from argv or env) -> value
    default: Any                      # typed default for this service
    doc: str
    choices: tuple[str, ...] | None = None
    is_bool: bool = False
    required: bool = False
    env_fallbacks: tuple[str, ...] = ()   # consulted after the TANDEM_ name, in order
    repeatable: bool = False              # the flag may be given several times (a tuple field)
    env_name: str | None = None           # overrides the TANDEM_ name derived from the flag

    @property
    def env(self) -> str:
        return self.env_name or ENV_PREFIX + self.flag.removeprefix("--").upper().replace("-", "_")

    @property
    def dest(self) -> str:
        return self.flag.removeprefix("--").replace("-", "_")

    @property
    def default_text(self) -> str:
        """The default as documentation shows it."""
        if self.required:
            return "(required)"
        if self.default is None or self.default == ():
            return "(unset)"
        if isinstance(self.default, bool):
            return "true" if self.default else "false"
        return str(self.default)


_PARSERS: dict[str, Callable[[str], Any]] = {
    "kv_cache_memory": parse_size, "max_request_body_bytes": parse_size,
    "heartbeat_interval": _parse_float, "gpu_memory_fraction": _parse_float,
    "request_timeout": _parse_float, "kv_lease_seconds": _parse_float,
}


def _parser_for(f: dataclasses.Field) -> tuple[Callable[[str], Any], bool]:
    if f.name in _PARSERS:
        return _PARSERS[f.name], False
    annotation = str(f.type)
    if annotation.startswith("tuple"):
        return _parse_list, False
    if annotation.startswith("bool"):
        return parse_bool, True
    if annotation.startswith("int"):
        return _parse_int, False
    if annotation.startswith("float"):
        return _parse_float, False
    return _parse_str, False


def _options_of(concern: type, defaults: Mapping[str, Any] = (), skip: Sequence[str] = ()) -> list[Option]:
    defaults = dict(defaults)
    rows = []
    for f in dataclasses.fields(concern):
        if f.name in skip or f.name in ("common", "engine"):
            continue
        parse, is_bool = _parser_for(f)
        required = f.default is dataclasses.MISSING and f.name not in defaults
        rows.append(Option(
            flag=f.metadata.get("flag") or "--" + f.name.replace("_", "-"), concern=concern,
            field_name=f.name, parse=parse, repeatable=str(f.type).startswith("tuple"),
            env_name=f.metadata.get("env"),
            default=defaults.get(f.name, None if required else f.default), doc=f.metadata["doc"],
            choices=f.metadata.get("choices"), is_bool=is_bool, required=required,
            env_fallbacks=(REDIS_URL_FALLBACK_ENV,) if f.name == "redis_url" else (),
        ))
    return rows


# Default ports per service: (gRPC, metrics). The gateway's metrics live on its HTTP port.
_PORTS: dict[str, dict[str, Any]] = {
    "gateway": {"grpc_port": 50051},
    "prefill": {"grpc_port": 50061, "metrics_port": 9061},
    "decode": {"grpc_port": 50071, "metrics_port": 9071},
    "draft": {"grpc_port": 50081, "metrics_port": 9081},
}


def options(service: str) -> tuple[Option, ...]:
    """The option table of one service, in --help order."""
    _check_service(service)
    rows = _options_of(CommonSettings, _PORTS[service],
                       skip=("metrics_port",) if service == "gateway" else ())
    if service in ENGINE_SERVICES:
        rows += _options_of(EngineSettings)
    rows += _options_of(SETTINGS_CLASSES[service])
    return tuple(rows)


def env_vars(service: str) -> dict[str, Option]:
    """Every TANDEM_* env var the service reads, name -> option (for checks and docs)."""
    return {opt.env: opt for opt in options(service)}


def all_env_vars(service: str) -> set[str]:
    """Every env var name the service reads: its TANDEM_* names plus REDIS_URL and OTEL_*."""
    return set(env_vars(service)) | set(STANDARD_ENV_VARS)


def default_ports(service: str) -> dict[str, int]:
    """Default listening ports by kind: {'grpc': ..., 'metrics': ...} or {'grpc', 'http'} for the gateway."""
    return {opt.field_name.removesuffix("_port"): opt.default
            for opt in options(service) if opt.field_name.endswith("_port")}


# ---------------------------------------------------------------------------------------------
# argparse and parsing

def _check_service(service: str) -> None:
    if service not in SETTINGS_CLASSES:
        raise SettingsError(f"unknown service {service!r}; expected one of {', '.join(SERVICES)}")


def _add_option(group: argparse._ArgumentGroup, opt: Option) -> None:
    env_help = opt.env + "".join(f", {name}" for name in opt.env_fallbacks)
    help_text = f"{opt.doc} [env {env_help}; default {opt.default_text}]".replace("%", "%%")
    if opt.is_bool:
        group.add_argument(opt.flag, dest=opt.dest, action=argparse.BooleanOptionalAction,
                           default=None, help=help_text)
    elif opt.repeatable:
        group.add_argument(opt.flag, dest=opt.dest, action="append", default=None,
                           help=help_text + " (repeatable)")
    else:
        group.add_argument(opt.flag, dest=opt.dest, default=None, help=help_text,
                           metavar="{" + ",".join(opt.choices) + "}" if opt.choices else None)


def add_arguments(parser: argparse.ArgumentParser, service: str) -> argparse.ArgumentParser:
    """Add the service's flags to `parser` (e.g. a `tandem <service>` subparser).

    Every flag defaults to None so that `settings_from_namespace` can tell "not given" from a
    value and fall back to env, then the default.
    """
    groups = {CommonSettings: parser.add_argument_group("common"),
              EngineSettings: parser.add_argument_group("engine")}
    for opt in options(service):
        _add_option(groups.get(opt.concern) or groups.setdefault(opt.concern, parser.add_argument_group(service)), opt)
    return parser


def add_engine_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """EngineSettings' flags alone, for a tool that runs an engine without serving it
    (`tandem generate`): the same flags, env vars, defaults and checks as the services'."""
    group = parser.add_argument_group("engine")
    for opt in _options_of(EngineSettings, skip=SERVICE_ONLY_ENGINE_FIELDS):
        _add_option(group, opt)
    return parser


def build_parser(service: str, prog: str | None = None) -> argparse.ArgumentParser:
    """A stand-alone parser for `tandem <service>`."""
    _check_service(service)
    parser = argparse.ArgumentParser(
        prog=prog or f"tandem {service}",
        description=SETTINGS_CLASSES[service].__doc__,
        epilog="Flags override TANDEM_* env vars, which override defaults.")
    return add_arguments(parser, service)


def _source(opt: Option, origin: str) -> str:
    return f"{opt.flag}" if origin == "flag" else f"{origin} (for {opt.flag})"


_Origins = dict[str, tuple[Option, str]]


def _resolve(opts: Sequence[Option], namespace: argparse.Namespace, environ: Mapping[str, str],
             ) -> tuple[dict[type, dict[str, Any]], _Origins]:
    """flag > env > default for every option: values by concern, and where each came from."""
    values: dict[type, dict[str, Any]] = {}
    origins: _Origins = {}
    for opt in opts:
        raw, origin = getattr(namespace, opt.dest, None), "flag"
        if raw is None:
            for name in (opt.env, *opt.env_fallbacks):
                if environ.get(name, "") != "":     # an empty env var counts as unset
                    raw, origin = environ[name], name
                    break
        if raw is None:
            if opt.required:
                raise SettingsError(f"{opt.flag} is required (or set {opt.env})")
            value, origin = opt.default, "default"
        elif isinstance(raw, (bool, list)):  # a boolean flag, or a repeatable flag's values
            value = tuple(raw) if isinstance(raw, list) else raw
        else:
            try:
                value = opt.parse(raw)
            except ValueError as exc:
                raise SettingsError(f"invalid {_source(opt, origin)}={raw!r}: {exc}") from None
            if opt.choices and value not in opt.choices:
                raise SettingsError(f"invalid {_source(opt, origin)}={raw!r}: must be one of "
                                    f"{', '.join(opt.choices)}")
        values.setdefault(opt.concern, {})[opt.field_name] = value
        origins[f"{opt.concern.__name__}.{opt.field_name}"] = (opt, origin)
    return values, origins


def _build(concern: type, values: dict[type, dict[str, Any]], origins: _Origins, **nested: Any) -> Any:
    """concern(**values), a field's validation error restated with the flag or env it came from."""
    try:
        return concern(**values.get(concern, {}), **nested)
    except _FieldError as exc:
        opt, origin = origins[f"{concern.__name__}.{exc.field_name}"]
        raise SettingsError(f"invalid {_source(opt, origin)}={exc.value!r}: {exc.reason}") from None


def settings_from_namespace(service: str, namespace: argparse.Namespace,
                            environ: Mapping[str, str] | None = None) -> ServiceSettings:
    """Resolve flag > env > default for every option, then build and validate the settings."""
    values, origins = _resolve(options(service), namespace, os.environ if environ is None else environ)
    nested = {"common": _build(CommonSettings, values, origins)}
    if service in ENGINE_SERVICES:
        nested["engine"] = _build(EngineSettings, values, origins)
    return _build(SETTINGS_CLASSES[service], values, origins, **nested)


def engine_settings_from_namespace(namespace: argparse.Namespace,
                                   environ: Mapping[str, str] | None = None) -> EngineSettings:
    """The EngineSettings of a parser built with `add_engine_arguments`."""
    values, origins = _resolve(_options_of(EngineSettings, skip=SERVICE_ONLY_ENGINE_FIELDS), namespace,
                               os.environ if environ is None else environ)
    return _build(EngineSettings, values, origins)


def parse_settings(service: str, argv: Sequence[str] | None = None,
                   environ: Mapping[str, str] | None = None) -> ServiceSettings:
    """argv + environ -> validated settings of `service`. Raises SettingsError on a bad value.

    argv defaults to sys.argv[1:] and environ to os.environ, read at call time.
    """
    parser = build_parser(service)
    namespace = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    return settings_from_namespace(service, namespace, environ)


# ---------------------------------------------------------------------------------------------
# Documentation: `python -m services.runtime.settings --markdown` prints the settings tables
# that docs/deployment.md embeds (a test checks the doc is up to date).

def settings_markdown() -> str:
    out = []
    for service in SERVICES:
        out.append(f"#### `tandem {service}`\n")
        out.append("| flag | env | default | meaning |")
        out.append("|---|---|---|---|")
        for opt in options(service):
            env = f"`{opt.env}`" + "".join(f", `{name}`" for name in opt.env_fallbacks)
            flag = f"`{opt.flag}`" + (f" / `--no-{opt.flag[2:]}`" if opt.is_bool else "") \
                + (" (repeatable)" if opt.repeatable else "")
            choices = f" One of: {', '.join(opt.choices)}." if opt.choices else ""
            out.append(f"| {flag} | {env} | `{opt.default_text}` | {opt.doc}{choices} |")
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.runtime.settings")
    parser.add_argument("--markdown", action="store_true", help="print the settings tables")
    args = parser.parse_args(argv)
    if args.markdown:
        sys.stdout.write(settings_markdown())
    else:
        parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
