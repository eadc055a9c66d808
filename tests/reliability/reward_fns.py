"""Reward functions for the bad-input tests, loaded with load_custom_reward_fn as a user's file would be.

The ground truth says how to misbehave, so one batch can mix good and bad samples.
"""

import math
import time


def misbehaving(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "raise":
        raise ZeroDivisionError("division by zero in the user's scorer")
    if ground_truth == "hang":
        time.sleep(3600)
    if ground_truth == "none":
        return None
    if ground_truth == "nan":
        return math.nan
    if ground_truth == "inf":
        return math.inf
    if ground_truth == "string":
        return "0.75"
    if ground_truth == "two_values":
        return [1.0, 0.0]
    return 1.0
