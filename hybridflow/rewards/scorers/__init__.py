"""Rule scorers, one file per task family. Each exposes ``compute_score(solution_str, ground_truth, ...)``."""
