"""Start-up checks for veRL features honoured by their own modules (one line per problem, naming the key).

  algorithm.use_pf_ppo / algorithm.pf_ppo.*          algorithms/pf_ppo.py, trainer/batch_reweight.py
  actor_rollout_ref.ref.strategy                     fsdp / fsdp2: the reference runs on the actor's FSDP2 engine
  actor_rollout_ref.rollout.max_model_len            every engine's context length
  actor_rollout_ref.model.lora_adapter_path          engines/lora_adapter.py
  actor_rollout_ref.model.use_shm                    trainer/shm_model.py
  trainer.dump_high_diff_tokens / dump_high_diff_dir trainer/high_diff_tokens.py
  data.custom_cls.path / name                        data/custom_dataset.py
(rollout.quantization / enable_prefix_caching are vLLM switches: engines/rollout/base.py refuses them elsewhere.)
"""

from __future__ import annotations

import math
import os
from typing import Any


def feature_errors(cfg: Any) -> list[str]:
    """What in these keys cannot run, before any worker starts."""
    from hybridflow.algorithms.pf_ppo import PF_PPO_WEIGHTS
    from hybridflow.workers.engine_config import STRATEGIES

    arr, alg, t, d = cfg.actor_rollout_ref, cfg.algorithm, cfg.trainer, cfg.data
    errors: list[str] = []
    if alg.use_pf_ppo:
        if problem := PF_PPO_WEIGHTS.check(alg.pf_ppo.reweight_method):
            errors.append(f"algorithm.pf_ppo.reweight_method: {problem}")
        if not math.isfinite(alg.pf_ppo.weight_pow):
            errors.append(f"algorithm.pf_ppo.weight_pow={alg.pf_ppo.weight_pow} must be a finite number (e.g. 2.0)")
    if arr.ref.strategy not in STRATEGIES:
        why = ("Megatron-LM is not supported" if "megatron" in str(arr.ref.strategy).lower()
               else "hybridflow has no such engine")
        errors.append(f"actor_rollout_ref.ref.strategy={arr.ref.strategy!r}: {why}; the reference runs on the "
                      f"actor's FSDP2 engine ({' / '.join(STRATEGIES)}): remove the key or set it to fsdp2")
    need = d.max_prompt_length + d.max_response_length
    if arr.rollout.max_model_len is not None and arr.rollout.max_model_len < need:
        errors.append(f"actor_rollout_ref.rollout.max_model_len={arr.rollout.max_model_len} is shorter than "
                      f"data.max_prompt_length + data.max_response_length = {need}; raise it or leave it unset")
    if arr.model.lora_adapter_path:
        from hybridflow.engines.lora_adapter import adapter_config_errors

        errors += adapter_config_errors(arr.model.lora_adapter_path, int(arr.model.lora_rank), arr.model.lora_alpha)
    if arr.model.use_shm:
        from hybridflow.trainer.shm_model import shm_config_errors

        errors += shm_config_errors(cfg)
    cls = d.custom_cls
    if cls.name and not cls.path:
        errors.append(f"data.custom_cls.name={cls.name!r} is read with data.custom_cls.path=<the Python file>; set it")
    if cls.path and not os.path.isfile(os.path.expanduser(cls.path)):
        errors.append(f"data.custom_cls.path={cls.path!r} is not a file; give the Python file of the dataset class")
    if cls.path and not cls.name:
        errors.append(f"data.custom_cls.path={cls.path!r} needs data.custom_cls.name=<the class in that file>")
    if t.dump_high_diff_tokens:
        if not arr.rollout.calculate_log_probs:
            errors.append("trainer.dump_high_diff_tokens=true compares the rollout's log-probs with the actor's, but "
                          "actor_rollout_ref.rollout.calculate_log_probs=false keeps none; set it to true")
        if alg.rollout_correction.bypass_mode:
            errors.append("trainer.dump_high_diff_tokens=true needs the actor's own log-probs of the sampled tokens, "
                          "which algorithm.rollout_correction.bypass_mode=true never computes; turn one of them off")
    return errors
