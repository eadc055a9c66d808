"""vLLM in the training process, and the transformers classes the two share.

A model vLLM has no implementation of (SmolLM3 in vLLM 0.32) runs through vLLM's Transformers backend, which decorates
the transformers model class itself for torch.compile: its ``__init__`` and ``__call__`` are replaced for the whole
process. vLLM runs in-process here (the hybrid rollout, the pooling reward model), next to training engines whose
modules are instances of the same class: those built before vLLM then fail at their next forward (no
``do_not_compile`` attribute), and those built after would be built as vLLM modules. So each vLLM engine is built
between `snapshot_model_classes` and `restore_model_classes`: the classes get their own methods back, and the modules
vLLM built of them move to a subclass that keeps vLLM's, so vLLM runs as it would alone.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["CPU_SLEEP_MODE", "restore_model_classes", "snapshot_model_classes"]

# the rollout's and the start-up checks' one message for veRL's free_cache_engine=true with vLLM on CPUs
CPU_SLEEP_MODE = ("actor_rollout_ref.rollout.free_cache_engine=true asks vLLM for its sleep mode (weights offloaded "
                  "and the KV cache freed between generations), which vLLM runs on GPUs only; on CPU set "
                  "free_cache_engine=false or remove the key")

_DECORATED = ("__init__", "__call__")  # what vLLM's support_torch_compile replaces on a class


def _model_classes(model_path: str) -> list[type]:
    """The transformers classes (imported here) that vLLM's Transformers backend may decorate for `model_path`."""
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return []
    classes = []
    for auto in (AutoModel, AutoModelForCausalLM, AutoModelForSequenceClassification):
        try:
            classes.append(auto._model_mapping[type(config)])
        except (KeyError, ValueError):
            continue
    return classes


def _methods(cls: type) -> dict[str, Any]:
    return {name: cls.__dict__.get(name) for name in _DECORATED}


def snapshot_model_classes(model_path: str) -> dict[type, dict[str, Any]]:
    """Before building a vLLM engine for `model_path`: its transformers classes' own ``__init__`` / ``__call__``."""
    return {cls: _methods(cls) for cls in _model_classes(model_path)}


def restore_model_classes(llm: Any, snapshot: dict[type, dict[str, Any]]) -> None:
    """After building `llm` (a ``vllm.LLM``): each class of `snapshot` whose methods vLLM replaced gets its own back,
    and the modules vLLM built of it move to a subclass that keeps vLLM's."""
    subclasses = {}
    for cls, methods in snapshot.items():
        decorated = _methods(cls)
        if decorated == methods:
            continue
        subclasses[cls] = type(cls.__name__, (cls,), {name: m for name, m in decorated.items() if m is not None})
        for name, method in methods.items():
            if method is None:
                delattr(cls, name)
            else:
                setattr(cls, name, method)
        logger.info("vLLM decorated transformers' %s for its own modules; the class is restored for the training "
                    "engine's", cls.__name__)
    if subclasses:
        llm.collective_rpc(_move_to_subclasses, kwargs={"subclasses": subclasses})


def _move_to_subclasses(worker: Any, subclasses: dict[type, type]) -> None:
    """(Runs on vLLM's worker, in this process.) Its model's modules of each class -> that class's subclass."""
    for module in worker.get_model().modules():
        if type(module) in subclasses:
            module.__class__ = subclasses[type(module)]
