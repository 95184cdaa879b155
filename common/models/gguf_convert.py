"""GGUF file -> HF model folder that Tandem's loader and `transformers` both load.

transformers reads GGUF itself (tensor names, llama.cpp's Q/K row permutation, dequantization,
the tokenizer and its chat template), so we let it and write what it read:

    config.json, generation_config.json (eos ids: the GGUF's + the catalogue's end-of-turn tokens),
    model.safetensors (dequantized, float32 or bfloat16; a tied head is not stored twice),
    tokenizer.json, tokenizer_config.json, chat_template.jinja

`resolve_model_path` lets every command take `--model file.gguf` too: the file is converted once
into the cache (keyed by its path, size and mtime) and the folder is used from then on.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

_DTYPES = ("float32", "bfloat16")


def convert_gguf(gguf: str | Path, out: str | Path, eos_tokens: Sequence[str] = (), dtype: str = "float32") -> Path:
    """Writes the HF folder for `gguf` at `out` atomically (a half-written folder never appears)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
    gguf, out = Path(gguf), Path(out)
    folder, name = str(gguf.parent), gguf.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    config = model.config
    architecture = type(model).__name__  # GGUF configs leave `architectures` unset
    tied = bool(getattr(config, "tie_word_embeddings", False))
    state = {k: v.to(getattr(torch, dtype)).contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}  # fmt: skip
    del model

    tmp = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del state
        raw = config.to_dict()
        raw.pop("quantization_config", None)  # the weights we write are plain tensors
        raw["dtype"] = dtype
        raw["architectures"] = [architecture]
        for key in ("_name_or_path", "_model_name_or_path"):  # paths of the conversion, not of the model
            raw.pop(key, None)
        (tmp / "config.json").write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n")
        tokenizer.save_pretrained(str(tmp))
        (tmp / "generation_config.json").write_text(
            json.dumps(_generation_config(config, tokenizer, eos_tokens), indent=2) + "\n")
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            tmp.rename(out)
        except OSError:
            if not (out / "config.json").is_file():
                raise
            shutil.rmtree(tmp)  # another process converted the same file first: keep its folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _generation_config(config, tokenizer, eos_tokens: Sequence[str]) -> dict[str, object]:
    """eos: the GGUF's id plus every end-of-turn token the catalogue names (Qwen ends a turn with
    <|im_end|> but its GGUF's eos may be <|endoftext|>): generation must stop on either."""
    eos: list[int] = []
    for value in (config.eos_token_id, *(tokenizer.convert_tokens_to_ids(t) for t in eos_tokens)):
        for token_id in value if isinstance(value, list) else [value]:
            if token_id is not None and token_id != tokenizer.unk_token_id and token_id not in eos:
                eos.append(int(token_id))
    generation: dict[str, object] = {"eos_token_id": eos[0] if len(eos) == 1 else eos}
    for key in ("bos_token_id", "pad_token_id"):
        if getattr(config, key, None) is not None:
            generation[key] = int(getattr(config, key))
    return generation


def resolve_model_path(model: str | Path) -> str:
    """A model folder as given; a `.gguf` file as its converted folder in the cache."""
    path = Path(model)
    if path.suffix.lower() != ".gguf":
        return str(model)
    if not path.is_file():
        raise FileNotFoundError(f"no GGUF file at {path}")
    from common.models.model_fetch import cache_dir

    stat = path.stat()
    key = hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    out = cache_dir() / "converted" / f"{path.stem}-{key}"
    if not (out / "config.json").is_file():
        convert_gguf(path, out)
    return str(out)
