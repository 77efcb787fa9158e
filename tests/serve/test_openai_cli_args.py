"""`kimi-jax serve` flags: vLLM spellings parse, the server settings derived from them, and the server they build."""

import argparse
import threading
import time

import httpx
import pytest

from kimi_jax.tokenizer import load_tokenizer
from serve.cli import engine_args_from_cli
from serve.openai import add_serve_args, build_server, server_config_from_args
from serve.openai.background import free_port
from tests.serve.fake_engine import FakeAsyncEngine


def parse(*argv):
    return add_serve_args(argparse.ArgumentParser()).parse_args(list(argv))


@pytest.fixture(scope="module")
def engines():
    return {name: FakeAsyncEngine(load_tokenizer(name)) for name in ("tiny", "tiny-k2")}


def test_vllm_recipe_flags_parse(engines):
    """The vLLM K3 recipe's flags, including its fp8 MLA cache."""
    args = parse("tiny", "--host", "127.0.0.1", "--port", "9001", "--served-model-name", "kimi", "k3",
                 "--max-model-len", "4096", "--max-num-seqs", "8", "--max-num-batched-tokens", "2048",
                 "--block-size", "64",
                 "--enable-prefix-caching", "--prefix-cache-retention-interval", "512", "--kv-cache-dtype", "fp8",
                 "--enable-auto-tool-choice", "--tool-call-parser", "kimi_k3", "--reasoning-parser", "kimi_k3",
                 "--api-key", "k", "--seed", "3")
    assert (args.max_model_len, args.max_num_seqs, args.max_num_batched_tokens) == (4096, 8, 2048)
    assert engine_args_from_cli(args)["block_size"] == 64 and "block_size" not in engine_args_from_cli(parse("tiny"))
    assert engine_args_from_cli(parse("tiny", "--mxfp4-byte-order", "checkpoint"))["mxfp4_byte_order"] == "checkpoint"
    assert engine_args_from_cli(parse("tiny", "--gpu-memory-utilization", "0.5"))["gpu_memory_utilization"] == 0.5
    assert "gpu_memory_utilization" not in engine_args_from_cli(parse("tiny"))
    for bad in ("0", "1.5", "-0.1"):
        with pytest.raises(SystemExit):
            parse("tiny", "--gpu-memory-utilization", bad)
    assert args.enable_prefix_caching and args.prefix_cache_retention_interval == 512 and args.seed == 3
    config = server_config_from_args(args, engines["tiny"])
    assert config.served_model_names == ("kimi", "k3") and config.model_name == "kimi"
    assert (config.chat_format, config.api_key, config.enable_auto_tool_choice) == ("k3", "k", True)
    assert config.split_reasoning and not server_config_from_args(parse("tiny"), engines["tiny"]).split_reasoning


def test_chat_format_inference(engines):
    assert server_config_from_args(parse("tiny"), engines["tiny"]).chat_format == "k3"
    assert server_config_from_args(parse("tiny-k2"), engines["tiny-k2"]).chat_format == "k2"
    assert server_config_from_args(parse("x", "--reasoning-parser", "kimi_k2"), engines["tiny"]).chat_format == "k2"
    assert server_config_from_args(parse("x"), engines["tiny"]).served_model_names == ("x",)


@pytest.mark.parametrize("argv", [["--enable-auto-tool-choice"],
                                  ["--tool-call-parser", "kimi_k3", "--reasoning-parser", "kimi_k2"],
                                  ["--chat-format", "k2", "--tool-call-parser", "kimi_k3"]])
def test_inconsistent_flags_are_refused(engines, argv):
    with pytest.raises(ValueError):
        server_config_from_args(parse("tiny", *argv), engines["tiny"])


def test_built_server_answers_until_told_to_exit(engines):
    port = free_port()
    server = build_server(parse("tiny", "--host", "127.0.0.1", "--port", str(port), "--uvicorn-log-level",
                                "warning"), engines["tiny"])
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not come up"
        time.sleep(0.02)
    url = f"http://127.0.0.1:{port}"
    assert httpx.get(url + "/health").status_code == 200
    answer = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}).json()
    assert answer["model"] == "tiny" and answer["usage"]["completion_tokens"] == 2
    server.should_exit = True
    thread.join(timeout=10)
    assert not thread.is_alive()


def test_speculative_config_flag(capsys):
    """vLLM's --speculative-config JSON reaches the engine arguments; a wrong field stops the command before any
    model loads, naming the field."""
    args = parse("tiny", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5}')
    spec = engine_args_from_cli(args)["speculative_config"]
    assert (spec.method, spec.num_speculative_tokens, spec.prompt_lookup_max) == ("ngram", 3, 5)
    assert "speculative_config" not in engine_args_from_cli(parse("tiny"))
    for bad, named in (('{"method": "ngram", "num_speculative_token": 3}', "num_speculative_token"),
                       ('{"method": "eagle", "num_speculative_tokens": 3}', "method"), ("{not json", "JSON")):
        with pytest.raises(SystemExit):
            parse("tiny", "--speculative-config", bad)
        assert named in capsys.readouterr().err


def test_bucket_and_xla_option_flags():
    """--token-buckets / --seq-buckets / --page-buckets reach EngineConfig as tuples (absent: platform defaults);
    a size below 1 stops the command; --xla-option collects NAME=VALUE strings."""
    args = parse("tiny", "--token-buckets", "64", "4096", "--seq-buckets", "1", "16", "128", "--page-buckets", "128",
                 "--xla-option", "xla_gpu_enable_triton_gemm=false", "--xla-option", "xla_gpu_autotune_level=2")
    fields = engine_args_from_cli(args)
    assert (fields["token_buckets"], fields["seq_buckets"], fields["page_buckets"]) == ((64, 4096), (1, 16, 128),
                                                                                        (128,))
    assert args.xla_option == ["xla_gpu_enable_triton_gemm=false", "xla_gpu_autotune_level=2"]
    assert not {"token_buckets", "seq_buckets", "page_buckets"} & set(engine_args_from_cli(parse("tiny")))
    for bad in ("0", "-4", "x"):
        with pytest.raises(SystemExit):
            parse("tiny", "--page-buckets", bad)
