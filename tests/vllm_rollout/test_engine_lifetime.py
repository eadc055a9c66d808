"""vLLM's parallel groups are process-global: an engine that goes away must not take them from the engines still live.

The failure this pins: a trainer that ended without shutting its vLLM rollout down left the engine to the garbage
collector, whose vLLM finalizer tore the process-global groups down, and the next call of any other engine in the
process failed with "pipeline model parallel group is not initialized".
"""

from __future__ import annotations

import gc

from test_update_weights import TEXTS, greedy
from vllm_test_utils import KV_CACHE_GIB, MAX_MODEL_LEN, hf_greedy, hf_model

from hybridflow.engines.rollout import vllm_rollout
from hybridflow.engines.rollout.vllm_rollout import VLLMRollout


def test_an_engine_dropped_without_shutdown_leaves_the_other_engines_working(fp32_engine, model_path):
    expected = hf_greedy(hf_model(model_path), TEXTS, 12)
    assert greedy(fp32_engine) == expected
    live = vllm_rollout._live_engines
    second = VLLMRollout(model_path, dtype="fp32", seed=1, max_model_len=MAX_MODEL_LEN, kv_cache_space_gib=KV_CACHE_GIB)
    assert vllm_rollout._live_engines == live + 1
    assert greedy(second) == expected
    del second  # no shutdown(): the finalizer has to release it
    gc.collect()
    assert vllm_rollout._live_engines == live
    assert greedy(fp32_engine) == expected  # the session engine still runs
