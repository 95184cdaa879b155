"""A draft model cut from its target: the target's first N decoder layers plus its embeddings,
final norm and LM head, saved as a Hugging Face folder (same tokenizer, same vocabulary).

Random-weight models rarely agree with a separately seeded draft; a truncated target agrees
more the more layers it keeps, which lets benchmarks and tests dial the acceptance rate.

    make_truncated_draft(target_dir, num_layers=2, out_dir)  ->  out_dir
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def make_truncated_draft(target_dir: str | Path, num_layers: int, out_dir: str | Path) -> Path:
    target_dir, out_dir = Path(target_dir), Path(out_dir)
    config = json.loads((target_dir / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(f"num_layers must be in [1, {config['num_hidden_layers']}], got {num_layers}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for f in target_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name not in ("config.json", "model.safetensors.index.json"):
            shutil.copy2(f, out_dir / f.name)
    config["num_hidden_layers"] = num_layers
    if isinstance(config.get("layer_types"), list):
        config["layer_types"] = config["layer_types"][:num_layers]
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    kept = {}
    for shard in sorted(target_dir.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            m = _LAYER.match(name)
            if m is None or int(m.group(1)) < num_layers:
                kept[name] = tensor.contiguous()
    save_file(kept, out_dir / "model.safetensors", metadata={"format": "pt"})
    return out_dir
