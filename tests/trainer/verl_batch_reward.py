"""A user's reward file in veRL's batch shape (reward_model.reward_manager=batch), as a veRL user writes it."""

import json


def compute_score(data_sources, solution_strs, ground_truths, extra_infos, offset=0.0, log_path=None, **kwargs):
    """Exact match plus `offset`; appends the batch size of each call to `log_path` (one JSON line per call)."""
    if log_path:
        with open(log_path, "a") as f:
            f.write(json.dumps({"rows": len(solution_strs), "sources": sorted(set(data_sources))}) + "\n")
    return [
        {"score": float(s.strip().split("=")[-1].strip() == str(g)) + offset, "acc": float(s.strip() == str(g))}
        for s, g in zip(solution_strs, ground_truths)
    ]
