"""Layers import downward only (docs/architecture.md), checked over every import in the package, including the ones
inside functions: a module may import its own package and packages of a lower layer, nothing else."""

from __future__ import annotations

import ast
from pathlib import Path

import hybridflow

ROOT = Path(hybridflow.__file__).parent
# layer of each top-level module/package of hybridflow; same layer, other package: not allowed either
LAYER = {
    "protocol": 0, "plugins": 0, "device": 0, "assets": 0, "config": 0,
    "common": 0.5,  # pure helpers; may use device.py
    "algorithms": 1, "single_controller": 1,
    "data": 2, "rewards": 2, "engines": 2,
    "agents": 3,
    "workers": 4,
    "trainer": 5,
    "cli": 6, "__main__": 7, "__init__": 7,
}


def imported_top_levels(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            parts = node.module.split(".")
            if parts[0] == "hybridflow":
                if len(parts) > 1:
                    out.add(parts[1])
                else:  # from hybridflow import device, ...
                    out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == "hybridflow" and len(parts) > 1:
                    out.add(parts[1])
    return out


def test_every_import_points_down():
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        own = path.relative_to(ROOT).parts[0].removesuffix(".py")
        assert own in LAYER, f"{path}: add its package to LAYER (and to docs/architecture.md)"
        for target in imported_top_levels(path):
            if target == own or target == "__version__":
                continue
            if LAYER.get(target, 99) >= LAYER[own]:
                wrong.append(f"{path.relative_to(ROOT)} imports hybridflow.{target}")
    assert not wrong, "upward or sideways imports:\n  " + "\n  ".join(wrong)


def test_the_check_sees_function_level_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from hybridflow.trainer.config import ConfigError\n")
    assert imported_top_levels(module) == {"trainer"}
