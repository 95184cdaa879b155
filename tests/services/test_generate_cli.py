"""`tandem generate` end to end through the console entry point."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.engine.engine_helpers import hf_greedy


def test_generate_jsonl(tmp_path, tiny_model):
    reqs = [
        {"prompt_token_ids": [11, 12, 13, 14, 15], "max_tokens": 6, "temperature": 0, "ignore_eos": True},
        {"prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0, "logprobs": 2, "ignore_eos": True},
        {"prompt_token_ids": [20, 21, 22], "max_tokens": 3, "temperature": 0.8, "seed": 3, "n": 2},
    ]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("\n".join(json.dumps(r) for r in reqs) + "\n")
    cmd = [sys.executable, "-m", "services.cli", "generate", "--model", str(tiny_model), "--input", str(inp),
           "--output", str(out), "--num-kv-blocks", "128", "--block-size", "4", "--max-num-batched-tokens", "8"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert [line["index"] for line in lines] == [0, 1, 2]
    assert lines[0]["token_ids"] == hf_greedy(tiny_model, [reqs[0]["prompt_token_ids"]], 6)[0]
    assert lines[0]["finish_reason"] == "length" and "logprobs" not in lines[0]
    assert len(lines[1]["logprobs"]) == 4 and len(lines[1]["logprobs"][0]["top_logprobs"]) == 2
    assert isinstance(lines[1]["text"], str) and lines[1]["num_cached_tokens"] == 0
    assert [c["index"] for c in lines[2]["choices"]] == [0, 1]


def test_generate_bad_line_is_a_clear_error(tmp_path, tiny_model):
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text('{"prompt": "hi", "temperature": -1}\n')
    cmd = [sys.executable, "-m", "services.cli", "generate", "--model", str(tiny_model), "--input", str(inp),
           "--output", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "temperature" in proc.stderr and "Traceback" not in proc.stderr


def test_generate_bad_engine_flag_names_it(tmp_path, tiny_model):
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "hi"}\n')
    cmd = [sys.executable, "-m", "services.cli", "generate", "--model", str(tiny_model), "--input", str(inp),
           "--output", str(tmp_path / "out.jsonl"), "--block-size", "0"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert "--block-size" in proc.stderr and "Traceback" not in proc.stderr
