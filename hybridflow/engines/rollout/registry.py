"""Name -> rollout engine class, on the project's one plugin mechanism (hybridflow/plugins.py).

Built-in engines are registered lazily, so an optional backend (vllm) costs nothing until it is asked for; a user's
engine is either registered in code (``register_rollout_engine("mine", MyRollout)``) or named in the config by import
path (``actor_rollout_ref.rollout.name=my_pkg.rollout:MyRollout``), which every worker process imports itself.

Every engine class takes ``(model_path, *, dtype, seed, max_model_len, **engine_kwargs)`` and declares what it
reads from the config itself (``RolloutEngine.DTYPES``, ``options_from_config``, ``config_errors``), so config
validation asks the engine instead of a hand-kept list.
"""

from __future__ import annotations

from typing import Any

from hybridflow.engines.rollout.base import RolloutEngine
from hybridflow.plugins import PluginError, Registry

__all__ = [
    "ROLLOUT_ENGINES",
    "available_rollout_engines",
    "create_rollout_engine",
    "get_rollout_engine",
    "register_rollout_engine",
    "rollout_config_errors",
    "rollout_engine_kwargs",
    "rollout_weight_update_error",
]


def _as_engine(name: str, obj: Any) -> type[RolloutEngine]:
    if not (isinstance(obj, type) and issubclass(obj, RolloutEngine)):
        raise PluginError(
            f"rollout engine {name!r} names {obj!r}, which is not a subclass of "
            "hybridflow.engines.rollout.RolloutEngine"
        )
    return obj


ROLLOUT_ENGINES: Registry[type[RolloutEngine]] = Registry(
    "rollout engine",
    "hybridflow.engines.rollout.register_rollout_engine(name, cls)",
    coerce=_as_engine,
    install_hints={
        "vllm": "install it with `pip install 'hybridflow[vllm]'` (or `make vllm-env` for the separate .venv-vllm)"
    },
)
ROLLOUT_ENGINES.add("hf", "hybridflow.engines.rollout.hf_rollout:HFRollout", lazy=True)
ROLLOUT_ENGINES.add("native", "hybridflow.engines.rollout.native_rollout:NativeRollout", lazy=True)
ROLLOUT_ENGINES.add("vllm", "hybridflow.engines.rollout.vllm_rollout:VLLMRollout", lazy=True)


def register_rollout_engine(name: str, engine: str | type[RolloutEngine], *, override: bool = False) -> None:
    """Add a backend: a RolloutEngine subclass or a 'package.module:ClassName' import path (imported on first use)."""
    ROLLOUT_ENGINES.add(name, engine, override=override, lazy=isinstance(engine, str))


def available_rollout_engines() -> list[str]:
    """Registered names (a registered backend may still fail to import; see get_rollout_engine)."""
    return ROLLOUT_ENGINES.names()


def get_rollout_engine(name: str) -> type[RolloutEngine]:
    """The engine class registered as (or importable by) `name`; ImportError saying what to install if it fails."""
    try:
        return ROLLOUT_ENGINES.get(name)
    except PluginError as err:
        if name in ROLLOUT_ENGINES or "could not be imported" in str(err):
            raise ImportError(str(err)) from err
        raise


# veRL namespaces engine options by engine (engine_kwargs.vllm.*, engine_kwargs.sglang.*): these keys are sub-dicts
ENGINE_NAMESPACES = ("vllm", "sglang", "trtllm", "native", "hf")


def rollout_engine_kwargs(rollout: Any) -> dict[str, Any]:
    """The rollout config section as the chosen engine's constructor kwargs: veRL's switches, then
    ``engine_kwargs.<option>``, then ``engine_kwargs.<this engine's name>.<option>`` (veRL's per-engine form; the
    other engines' sub-dicts are theirs and are not passed to this one)."""
    engine = get_rollout_engine(rollout.name)
    kwargs = dict(engine.options_from_config(rollout))
    given = dict(rollout.engine_kwargs)
    own = given.pop(rollout.name, None) or {}
    kwargs.update({k: v for k, v in given.items() if k not in ENGINE_NAMESPACES})
    kwargs.update(dict(own))
    return kwargs


def rollout_config_errors(rollout: Any) -> list[str]:
    """What is wrong with the rollout section for its engine (empty when it can be built); no engine is built."""
    try:
        engine = get_rollout_engine(rollout.name)
    except (PluginError, ImportError) as err:
        return [f"actor_rollout_ref.rollout.name={rollout.name!r}: {err}"]
    return engine.config_errors(rollout)


def rollout_weight_update_error(name: str) -> str | None:
    """None, or why the engine `name` cannot be trained with: it must take new weights (update_weights)."""
    try:
        engine = get_rollout_engine(name)
    except (PluginError, ImportError):
        return None  # rollout_config_errors reports the name
    if not engine.SUPPORTS_WEIGHT_UPDATES:
        return (
            f"actor_rollout_ref.rollout.name={name}: {engine.__name__} cannot load new weights "
            "(SUPPORTS_WEIGHT_UPDATES = False), so it would sample from the initial policy forever; pick an engine "
            "that implements update_weights (native, hf, vllm)"
        )
    return None


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
    engine = get_rollout_engine(name)
    return engine(model_path, dtype=dtype, seed=seed, max_model_len=max_model_len, **engine_kwargs)
