"""Services meet only through protos: no service package imports another one's modules (shared
converters and clients live in services/runtime/). Checked from the import statements."""

from __future__ import annotations

import ast
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("gateway", "prefill", "decode", "draft")


def _imported_modules(path: Path) -> set[str]:
    modules = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            modules |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def test_no_service_imports_another_service() -> None:
    crossings = []
    for service in SERVICES:
        for path in sorted((REPO_ROOT / "services" / service).rglob("*.py")):
            for module in _imported_modules(path):
                parts = module.split(".")
                if len(parts) >= 2 and parts[0] == "services" and parts[1] in SERVICES and parts[1] != service:
                    crossings.append(f"{path.relative_to(REPO_ROOT)} imports {module}")
    assert not crossings, crossings
