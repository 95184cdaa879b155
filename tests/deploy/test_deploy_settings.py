"""services/runtime/settings.py: precedence, fallbacks, validation messages, the option table."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from services.runtime import settings as S

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_defaults_per_service():
    for service, ports in {"gateway": {"grpc": 50051, "http": 8000},
                           "prefill": {"grpc": 50061, "metrics": 9061},
                           "decode": {"grpc": 50071, "metrics": 9071},
                           "draft": {"grpc": 50081, "metrics": 9081}}.items():
        assert S.default_ports(service) == ports
        parsed = S.parse_settings(service, ["--model", "/models/m"], {})
        assert parsed.common.grpc_port == ports["grpc"]
        assert parsed.common.metrics_port == ports.get("metrics")
        assert parsed.common.served_model_name == "m"
        assert parsed.common.advertise_host == "127.0.0.1"
        assert parsed.common.cluster == "tandem" and parsed.common.heartbeat_interval == 1.0
    gw = S.parse_settings("gateway", ["--model", "m"], {})
    assert (gw.http_port, gw.mode) == (8000, "disaggregated")
    dec = S.parse_settings("decode", ["--model", "m"], {})
    assert dec.engine.block_size == 16 and dec.engine.enable_prefix_caching is True
    assert (dec.speculative_method, dec.num_speculative_tokens) == ("none", 0)


def test_flag_beats_env_beats_default():
    env = {"TANDEM_MODEL": "/env/model", "TANDEM_BLOCK_SIZE": "32", "TANDEM_GRPC_PORT": "6000"}
    parsed = S.parse_settings("prefill", ["--block-size", "64"], env)
    assert parsed.engine.block_size == 64          # flag over env
    assert parsed.common.grpc_port == 6000         # env over default
    assert parsed.common.model == "/env/model"
    assert parsed.engine.max_num_seqs == 128       # default


def test_redis_url_fallback_order():
    base = ["--model", "m"]
    assert S.parse_settings("decode", base, {"REDIS_URL": "redis://std:1"}).common.redis_url == "redis://std:1"
    env = {"REDIS_URL": "redis://std:1", "TANDEM_REDIS_URL": "redis://tandem:2"}
    assert S.parse_settings("decode", base, env).common.redis_url == "redis://tandem:2"
    assert S.parse_settings("decode", base + ["--redis-url", "redis://flag:3"], env).common.redis_url \
        == "redis://flag:3"
    assert S.parse_settings("decode", base, {}).common.redis_url is None


def test_empty_env_counts_as_unset():
    parsed = S.parse_settings("draft", ["--model", "m"], {"TANDEM_GRPC_PORT": ""})
    assert parsed.common.grpc_port == 50081


def test_booleans_and_sizes():
    env = {"TANDEM_ENABLE_PREFIX_CACHING": "false", "TANDEM_KV_CACHE_MEMORY": "2GiB"}
    parsed = S.parse_settings("decode", ["--model", "m"], env)
    assert parsed.engine.enable_prefix_caching is False
    assert parsed.engine.kv_cache_memory == 2 * 1024**3
    parsed = S.parse_settings("decode", ["--model", "m", "--enable-prefix-caching"], env)
    assert parsed.engine.enable_prefix_caching is True
    assert S.parse_size("512MiB") == 512 * 1024**2
    assert S.parse_size("1.5G") == 1_500_000_000
    assert S.parse_size("4096") == 4096
    assert S.parse_size(7) == 7


def test_advertise_host_follows_host():
    assert S.parse_settings("decode", ["--model", "m", "--host", "10.1.2.3"], {}).common.advertise_host == "10.1.2.3"
    parsed = S.parse_settings("decode", ["--model", "m"], {"TANDEM_ADVERTISE_HOST": "10.9.9.9"})
    assert parsed.common.advertise_host == "10.9.9.9"
    assert parsed.common.grpc_address == "10.9.9.9:50071"


@pytest.mark.parametrize("argv, env, needles", [
    ([], {}, ["--model", "required", "TANDEM_MODEL"]),
    (["--block-size", "0"], {}, ["--block-size", "0", ">= 1"]),
    ([], {"TANDEM_BLOCK_SIZE": "sixteen"}, ["TANDEM_BLOCK_SIZE", "sixteen", "integer"]),
    ([], {"TANDEM_DEVICE": "tpu"}, ["TANDEM_DEVICE", "tpu", "auto, cpu, cuda"]),
    ([], {"TANDEM_KV_CACHE_MEMORY": "2Gx"}, ["TANDEM_KV_CACHE_MEMORY", "2Gx"]),
    ([], {"TANDEM_ENABLE_PREFIX_CACHING": "maybe"}, ["TANDEM_ENABLE_PREFIX_CACHING", "maybe"]),
    (["--device", "cpu", "--gpu-memory-fraction", "0.5"], {}, ["--gpu-memory-fraction", "0.5", "CUDA"]),
    (["--gpu-memory-fraction", "1.5"], {}, ["--gpu-memory-fraction", "1.5", "<= 1"]),
    (["--num-speculative-tokens", "4"], {}, ["--num-speculative-tokens", "4", "speculative_method"]),
    ([], {"TANDEM_REDIS_URL": "http://x"}, ["TANDEM_REDIS_URL", "http://x", "redis://"]),
    ([], {"REDIS_URL": "localhost:6379"}, ["REDIS_URL", "localhost:6379"]),
    (["--grpc-port", "70000"], {}, ["--grpc-port", "70000", "65535"]),
    (["--heartbeat-interval", "0"], {}, ["--heartbeat-interval", "0", "> 0"]),
    (["--metrics-port", "50071"], {}, ["--metrics-port", "50071", "grpc_port"]),
    (["--weight-dtype", "float16"], {}, ["--weight-dtype", "float16", "auto, bfloat16"]),
    (["--dtype", "bfloat16", "--weight-dtype", "bfloat16"], {}, ["--weight-dtype", "bfloat16", "dtype=bfloat16"]),
])
def test_bad_values_are_named(argv, env, needles):
    full_argv = argv if not argv and not env else ["--model", "m", *argv]
    with pytest.raises(S.SettingsError) as info:
        S.parse_settings("decode", full_argv, env)
    for needle in needles:
        assert needle in str(info.value), (needle, str(info.value))


def test_gateway_has_no_metrics_port_and_no_engine_flags():
    names = S.env_vars("gateway")
    assert "TANDEM_METRICS_PORT" not in names and "TANDEM_BLOCK_SIZE" not in names
    assert {"TANDEM_HTTP_PORT", "TANDEM_MODE", "TANDEM_PREFILL_CHUNK_SIZE",
            "TANDEM_MAX_QUEUED_REQUESTS", "TANDEM_REQUEST_TIMEOUT"} <= set(names)
    with pytest.raises(SystemExit):
        S.parse_settings("gateway", ["--model", "m", "--block-size", "16"], {})


def test_contract_flags_exist():
    common = {"--model", "--served-model-name", "--host", "--advertise-host", "--grpc-port",
              "--redis-url", "--cluster", "--heartbeat-interval", "--log-level", "--drain-timeout",
              "--grpc-keepalive", "--grpc-keepalive-timeout",
              "--tls-cert", "--tls-key", "--tls-ca"}
    engine = {"--device", "--dtype", "--weight-dtype", "--block-size", "--num-kv-blocks", "--kv-cache-memory",
              "--gpu-memory-fraction", "--max-num-batched-tokens", "--max-num-seqs",
              "--enable-prefix-caching", "--attention-backend", "--torch-threads", "--engine-stall-timeout",
              "--grammar-compile-timeout"}
    flags = {s: {o.flag for o in S.options(s)} for s in S.SERVICES}
    assert flags["gateway"] == common | {"--http-port", "--mode", "--prefill-chunk-size",
                                         "--max-queued-requests", "--request-timeout", "--migration-limit",
                                         "--stall-timeout", "--stall-probe-timeout", "--api-key", "--api-key-file", "--metrics-auth",
                                         "--public-tls", "--max-request-body-bytes", "--max-n", "--tool-call-parser",
                                         "--standby-fd", "--http-fd", "--local-sockets"}
    assert flags["prefill"] == common | engine | {"--metrics-port"}
    assert flags["draft"] == common | engine | {"--metrics-port", "--max-num-draft-tokens", "--lease-seconds",
                                                "--lookahead"}
    assert flags["decode"] == common | engine | {"--metrics-port", "--num-speculative-tokens",
                                                 "--speculative-method", "--draft-timeout-ms",
                                                 "--kv-lease-seconds", "--draft-address", "--speculative-adaptive",
                                                 "--spec-torch-threads", "--stream-interval-ms", "--local-socket"}


def test_option_table_covers_every_field_once():
    for service in S.SERVICES:
        opts = S.options(service)
        assert len({o.env for o in opts}) == len(opts)
        covered = {(o.concern, o.field_name) for o in opts}
        concerns = [S.CommonSettings, S.SETTINGS_CLASSES[service]]
        if service in S.ENGINE_SERVICES:
            concerns.append(S.EngineSettings)
        fields = {(c, f.name) for c in concerns for f in dataclasses.fields(c)
                  if f.name not in ("common", "engine")}
        if service == "gateway":
            fields.discard((S.CommonSettings, "metrics_port"))
        assert covered == fields
        for o in opts:
            # One exception: the repeatable --api-key reads the plural TANDEM_API_KEYS (k1,k2).
            plural = "S" if o.repeatable else ""
            assert o.env == "TANDEM_" + o.flag[2:].upper().replace("-", "_") + plural
            assert o.doc.strip()


def test_settings_are_frozen_and_validated_on_direct_construction():
    common = S.CommonSettings(model="m")
    with pytest.raises(dataclasses.FrozenInstanceError):
        common.model = "x"  # type: ignore[misc]
    with pytest.raises(S.SettingsError, match="block_size=0"):
        S.EngineSettings(block_size=0)


def test_no_env_read_at_import():
    # Importing with a bad env var set must not fail: nothing is read until parse time.
    code = ("import os; os.environ['TANDEM_GRPC_PORT'] = 'not-a-port'\n"
            "import services.runtime.settings as S\n"
            "try:\n    S.parse_settings('decode', ['--model', 'm'])\n"
            "except S.SettingsError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=REPO_ROOT)
    assert "not-a-port" in out.stdout


def test_tracing_enabled():
    assert not S.tracing_enabled({})
    assert not S.tracing_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": ""})
    assert S.tracing_enabled({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://jaeger:4317"})
    assert S.tracing_enabled({"OTEL_TRACES_EXPORTER": "console"})
    assert not S.tracing_enabled({"OTEL_TRACES_EXPORTER": "none"})


def test_speculation_settings_parse():
    draft = S.parse_settings("draft", ["--model", "m", "--lease-seconds", "5", "--max-num-draft-tokens", "8"], {})
    assert (draft.lease_seconds, draft.max_num_draft_tokens) == (5.0, 8)
    decode = S.parse_settings("decode", ["--model", "m"], {"TANDEM_DRAFT_ADDRESS": "10.0.0.7:50081"})
    assert decode.draft_address == "10.0.0.7:50081"
    with pytest.raises(S.SettingsError, match="max_num_draft_tokens|max-num-draft-tokens"):
        S.parse_settings("draft", ["--model", "m", "--max-num-draft-tokens", "0"], {})


def test_engine_flags_alone_for_tandem_generate():
    """`tandem generate` takes the services' engine flags: same env vars, defaults and messages."""
    import argparse

    from services.runtime.engine_factory import engine_config

    parser = S.add_engine_arguments(argparse.ArgumentParser())
    engine = S.engine_settings_from_namespace(parser.parse_args(["--block-size", "32"]),
                                              {"TANDEM_NUM_KV_BLOCKS": "64", "TANDEM_BLOCK_SIZE": "8"})
    assert (engine.block_size, engine.num_kv_blocks) == (32, 64)  # flag over env, env over default
    config = engine_config("/m", engine, seed=3, max_model_len=100)
    assert (config.cache.block_size, config.cache.num_kv_blocks, config.seed, config.max_model_len) == (32, 64, 3, 100)
    assert config.cache.gpu_memory_fraction == 0.85  # unset: the engine's default, which the doc states
    assert "0.85" in dict((o.field_name, o.doc) for o in S.options("decode"))["gpu_memory_fraction"]
    with pytest.raises(S.SettingsError, match="--max-num-seqs"):
        S.engine_settings_from_namespace(parser.parse_args(["--max-num-seqs", "0"]), {})
