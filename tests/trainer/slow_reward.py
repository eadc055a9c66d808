"""A reward function that takes its time, so a test can see what overlaps it (loaded by path, as a user's file)."""

import time


def slow_exact(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(0.05)
    return {"score": float(solution_str.strip() == str(ground_truth)), "scored_at": time.monotonic()}
