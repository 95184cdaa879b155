"""Runs llama.cpp's own convert_hf_to_gguf.py on a model folder, with one fallback.

    python benchmarks/gguf_from_hf.py LLAMA_CPP_DIR MODEL_DIR --outtype f32 --outfile OUT.gguf

The converter names a BPE tokenizer's pre-tokenizer by hashing what it makes of a test string, and
stops on a hash it has no entry for. Tandem's random models (`tandem make-model`) have a byte-level
BPE of their own, so their hash is in no list; their tokenizer.json declares exactly GPT-2's
pre-tokenizer (ByteLevel with the GPT-2 split regex, no normalizer), which llama.cpp calls "gpt-2".
Only for such a tokenizer, and only when the converter finds no name, "gpt-2" is used; any other
unknown tokenizer still fails as the converter would. Real models (SmolLM2) convert unchanged.
"""

from __future__ import annotations

import json
import logging
import runpy
import sys
from pathlib import Path

GPT2_PRE = "gpt-2"


def declares_gpt2_pre_tokenizer(model_dir: Path) -> bool:
    path = model_dir / "tokenizer.json"
    if not path.exists():
        return False
    tok = json.loads(path.read_text())
    pre = tok.get("pre_tokenizer") or {}
    return (tok.get("normalizer") is None and tok.get("model", {}).get("type") == "BPE"
            and pre.get("type") == "ByteLevel" and pre.get("use_regex", True))  # fmt: skip


def main() -> None:
    llama_cpp, model_dir, *rest = sys.argv[1:]
    sys.path.insert(0, llama_cpp)
    from conversion import base  # the converter's own package, from the llama.cpp tree

    known = base.TextModel.get_vocab_base_pre
    fallback = declares_gpt2_pre_tokenizer(Path(model_dir))

    def get_vocab_base_pre(self, tokenizer) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:
            if not fallback:
                raise
            logging.getLogger("gguf_from_hf").warning("pre-tokenizer hash unknown; tokenizer.json declares GPT-2's: %r", GPT2_PRE)
            return GPT2_PRE

    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
    script = str(Path(llama_cpp) / "convert_hf_to_gguf.py")
    sys.argv = [script, model_dir, *rest]
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
