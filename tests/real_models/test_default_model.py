"""The README's first command ends with a server that answers a question sensibly: `make up` fetches
SmolLM2-135M-Instruct and runs `tandem up` on it; the same command line, on free ports, answers
"What is the capital of France?" with transformers' greedy answer. A `.gguf` file works as
`--model` directly (converted once into the cache)."""

from __future__ import annotations

import json
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
from pathlib import Path

import openai

from common.models.model_fetch import cache_dir
from tests.real_models.real_model_helpers import SMOLLM2

ROOT = Path(__file__).resolve().parents[2]
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
ANSWER = "The capital of France is Paris."  # transformers' greedy answer on these weights


def _make_up_commands(model_dir: Path) -> list[list[str]]:
    """What `make up` runs (make -n -B: every step printed, none run), minus the install steps."""
    shown = subprocess.run(["make", "-n", "-B", "up", f"MODEL_DIR={model_dir}", "UP_ARGS=--port 0 --grpc-port 0"],
                           cwd=ROOT, capture_output=True, text=True, check=True)  # fmt: skip
    return [shlex.split(line) for line in shown.stdout.splitlines() if "tandem" in line and "pip" not in line]


def test_make_up_fetches_and_serves_smollm2(smollm2_model, tmp_path) -> None:
    commands = _make_up_commands(smollm2_model)
    fetch = next(c for c in commands if "fetch-model" in c)
    assert fetch[fetch.index("fetch-model") + 1] == SMOLLM2  # the default MODEL
    up = next(c for c in commands if "up" in c[1:2])
    argv = [sys.executable, "-m", "services.cli", *up[1:], "--run-dir", str(tmp_path)]
    assert argv[argv.index("--model") + 1] == str(smollm2_model)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "REDIS_URL": ""}, cwd=ROOT)  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True).start()  # type: ignore[union-attr]
    try:
        seen = ""
        while "Press Ctrl-C" not in seen:  # tandem up's own startup timeout bounds this wait
            assert proc.poll() is None, f"tandem up exited {proc.returncode}:\n{seen}"
            try:
                seen += lines.get(timeout=1)
            except queue.Empty:
                pass
        base = re.search(r"OpenAI REST\s+(http://\S+/v1)", seen).group(1)
        client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
        reply = client.chat.completions.create(model=SMOLLM2, messages=FRANCE, temperature=0, max_tokens=32)
        assert reply.choices[0].message.content == ANSWER
        assert reply.choices[0].finish_reason == "stop"
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_a_gguf_file_is_a_model(smollm2_model, tmp_path) -> None:
    gguf = cache_dir() / "gguf" / f"{SMOLLM2}.gguf"
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(str(smollm2_model)).apply_chat_template(
        FRANCE, add_generation_prompt=True, tokenize=True, return_dict=False)
    prompt = {"prompt_token_ids": list(ids), "max_tokens": 32, "temperature": 0}
    (tmp_path / "in.jsonl").write_text(json.dumps(prompt) + "\n")
    env = {**os.environ, "TANDEM_CACHE_DIR": str(tmp_path / "cache")}  # convert into a cache of its own
    for _ in range(2):  # the second run finds the converted folder
        subprocess.run([sys.executable, "-m", "services.cli", "generate", "--model", str(gguf), "--input",
                        str(tmp_path / "in.jsonl"), "--output", str(tmp_path / "out.jsonl"), "--no-progress"],
                       env=env, check=True, capture_output=True, text=True)  # fmt: skip
        out = json.loads((tmp_path / "out.jsonl").read_text())
        assert (out["text"], out["finish_reason"]) == (ANSWER, "stop")
    converted = list((tmp_path / "cache" / "converted").iterdir())
    assert len(converted) == 1 and (converted[0] / "config.json").is_file()
