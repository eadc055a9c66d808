"""Name -> rollout engine class, resolved lazily so that an optional backend (vllm) costs nothing until it is asked for.

Every engine class takes ``(model_path, *, dtype, seed, max_model_len, **engine_kwargs)``.
"""

from __future__ import annotations

import importlib

from hybridflow.engines.rollout.base import RolloutEngine

__all__ = ["available_rollout_engines", "create_rollout_engine", "register_rollout_engine"]

_ENGINES: dict[str, str | type[RolloutEngine]] = {
    "hf": "hybridflow.engines.rollout.hf_rollout:HFRollout",
    "native": "hybridflow.engines.rollout.native_rollout:NativeRollout",
    "vllm": "hybridflow.engines.rollout.vllm_rollout:VLLMRollout",
}
# Backends that need packages outside the default install, and how to get them.
_INSTALL_HINTS = {
    "vllm": "install it with `pip install 'hybridflow[vllm]'` (or `make vllm-env` for the separate .venv-vllm)",
}


def register_rollout_engine(name: str, engine: str | type[RolloutEngine]) -> None:
    """Add a backend: a RolloutEngine subclass or a 'package.module:ClassName' import path (imported on first use)."""
    _ENGINES[name] = engine


def available_rollout_engines() -> list[str]:
    """Registered names (a registered backend may still fail to import; see create_rollout_engine)."""
    return sorted(_ENGINES)


def _resolve(name: str) -> type[RolloutEngine]:
    if name not in _ENGINES:
        raise ValueError(f"unknown rollout engine {name!r}; registered engines: {available_rollout_engines()}")
    target = _ENGINES[name]
    if not isinstance(target, str):
        return target
    module_name, _, class_name = target.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        hint = _INSTALL_HINTS.get(name, "check that its package is installed")
        raise ImportError(f"rollout engine {name!r} could not be imported ({err}); {hint}") from err
    engine = getattr(module, class_name, None)
    if engine is None:
        raise ImportError(f"rollout engine {name!r}: {module_name} has no class {class_name!r}")
    return engine


def create_rollout_engine(
    name: str,
    model_path: str,
    *,
    dtype: str = "fp32",
    seed: int = 0,
    max_model_len: int | None = None,
    **engine_kwargs,
) -> RolloutEngine:
    """Build the rollout engine registered as `name` for the checkpoint at `model_path`."""
    engine = _resolve(name)
    return engine(model_path, dtype=dtype, seed=seed, max_model_len=max_model_len, **engine_kwargs)
