"""Hints name real keys (issue 23, item 7): every dotted config key in a message the package can print -- an error,
a warning, a hint constant -- must exist in the config schema, so following the hint never fails."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from omegaconf import OmegaConf

import hybridflow
from hybridflow.trainer.config import HybridFlowConfig, _all_keys

SECTIONS = [f.name for f in HybridFlowConfig.__dataclass_fields__.values()]
# A top-level section, or a section people (and old messages) get wrong: "reward.timeout_s", "actor.optim.lr".
_PREFIXES = [*SECTIONS, "reward", "actor", "rollout", "ref", "optim"]
_KEY = re.compile(r"(?<![\w./-])((?:" + "|".join(_PREFIXES) + r")(?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
_FILE_SUFFIXES = {"py", "json", "jsonl", "parquet", "yaml", "yml", "txt", "safetensors", "pt", "html", "md"}
# Dotted names that are not config keys: a field of the veRL data schema (the row's reward_model dict).
_DATA_FIELDS = {"reward_model.ground_truth", "reward_model.style"}
# Messages of the training engine name keys of its own EngineConfig ("optim.lr" = EngineConfig.optim.lr).
_ENGINE_DIRS = ("engines/",)
# The table of veRL's own key names (those hybridflow renames or refuses): by design not hybridflow keys.
_VERL_NAME_TABLES = ("trainer/verl_keys.py", "trainer/verl_micro_batch.py")


def _engine_optim_keys() -> set[str]:
    from dataclasses import fields

    from hybridflow.engines.optim import OptimConfig

    return {f"optim.{f.name}" for f in fields(OptimConfig)}


# Files of `hybridflow sft` name keys of its own schema.
_SFT_FILES = ("trainer/sft_trainer.py", "trainer/make_base_model.py", "trainer/make_agent_base.py", "data/sft_dataset.py",
              "workers/sft.py")


def _known_keys(schema: type = HybridFlowConfig) -> tuple[set[str], tuple[str, ...]]:
    base = OmegaConf.structured(schema)
    known = set(_all_keys(base))
    free = tuple(k + "." for k in known
                 if OmegaConf.is_dict(v := OmegaConf.select(base, k)) and OmegaConf.get_type(v) is dict)
    return known, free


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _message_strings(path: Path):
    """(line, text) of every string constant in `path` except docstrings (f-strings: their literal parts joined,
    with '{}' where a value goes)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    skip = _docstrings(tree)
    inside_fstring = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            parts = []
            for v in node.values:
                inside_fstring.add(id(v))
                parts.append(v.value if isinstance(v, ast.Constant) and isinstance(v.value, str) else "{}")
            yield node.lineno, "".join(parts)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
                and id(node) not in inside_fstring):
            yield node.lineno, node.value


def test_every_dotted_key_in_a_message_exists():
    from hybridflow.trainer.sft_trainer import SFTConfig

    schemas = {"rl": _known_keys(), "sft": _known_keys(SFTConfig)}
    engine_keys = _engine_optim_keys()
    root = Path(hybridflow.__file__).parent
    bad = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        known, free = schemas["sft" if rel in _SFT_FILES else "rl"]
        for line, text in _message_strings(path):
            for key in _KEY.findall(text):
                key = key.rstrip(".")
                if key.rsplit(".", 1)[-1] in _FILE_SUFFIXES or key in known or key.startswith(free):
                    continue
                if key in _DATA_FIELDS or rel in _VERL_NAME_TABLES:
                    continue
                if rel.startswith(_ENGINE_DIRS) and key in engine_keys:
                    continue
                bad.append(f"{rel}:{line}: {key}")
    assert not bad, "messages name keys that do not exist:\n" + "\n".join(bad)


def test_the_check_catches_a_wrong_key():
    known, _ = _known_keys()
    found = _KEY.findall("set reward.timeout_s=30 or trainer.call_timeout_s=60, see hybridflow.rewards.sandbox")
    assert found == ["reward.timeout_s", "trainer.call_timeout_s"]
    assert "reward.timeout_s" not in known and "trainer.call_timeout_s" in known
