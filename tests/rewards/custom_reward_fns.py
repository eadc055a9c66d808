"""Reward functions used by the reward tests, loaded with load_custom_reward_fn (as a user's file would be)."""

import math
import os
import time

NOT_A_FUNCTION = 3


def exact(data_source, solution_str, ground_truth, extra_info=None):
    return float(solution_str.strip() == str(ground_truth))


def misbehaving(data_source, solution_str, ground_truth, extra_info=None):
    """Behaves as the ground truth says, so one batch can mix good and bad samples."""
    if ground_truth == "raise":
        raise KeyError("boom")
    if ground_truth == "hang":
        time.sleep(3600)
    if ground_truth == "none":
        return None
    if ground_truth == "nan":
        return math.nan
    if ground_truth == "inf":
        return -math.inf
    if ground_truth == "string":
        return "1.0"
    if ground_truth == "tuple":
        return (1.0, 0.5)
    if ground_truth == "dict_without_score":
        return {"acc": 1.0}
    if ground_truth == "dict":
        return {"score": 0.5, "acc": 1.0, "pred": solution_str[:3]}
    if ground_truth == "exit":
        os._exit(3)
    return 1.0


def wrong_signature(solution_str, ground_truth):
    return 0.0


def kwargs_only(**kwargs):
    return float(kwargs["solution_str"] == kwargs["ground_truth"])


def batch_exact(data_sources, solution_strs, ground_truths, extra_infos, bonus=0.0, scale=1.0, **kwargs):
    """veRL's batch signature: one call for the whole batch; reports the batch size it saw and its kwargs."""
    return [
        {"score": scale * float(s.strip() == str(g)) + bonus, "batch_size": len(solution_strs), "ds": d}
        for d, s, g in zip(data_sources, solution_strs, ground_truths)
    ]


def batch_wrong_length(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    return [1.0] * (len(solution_strs) - 1)


def with_tuple(data_source, solution_str, ground_truth, extra_info=None):
    """prime-style: (score, details)."""
    return (float(solution_str.strip() == str(ground_truth)), {"details": "x"})


def needs_kwarg(data_source, solution_str, ground_truth, extra_info=None, *, threshold):
    return float(len(solution_str) >= threshold)


def length_manager(tokenizer, spec):
    """A reward-manager plugin named by import path: every response scores its length in characters."""
    from hybridflow.rewards import RewardManager

    return RewardManager(tokenizer, length_score, **spec.options)


def length_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(len(solution_str))
