"""Reward functions for the sandbox tests (never imported by the tests: the sandbox runs this file's source)."""

import os
import socket


def exact(data_source, solution_str, ground_truth, extra_info=None):
    return {"score": float(solution_str.strip() == ground_truth), "length": len(solution_str)}


def snoop(data_source, solution_str, ground_truth, extra_info=None):
    """Tries what a hostile or careless reward function might: secrets, other files, the network."""
    if ground_truth == "env":
        return float("HYBRIDFLOW_TEST_SECRET" in os.environ)
    if ground_truth == "home":
        return float(os.path.exists(os.path.join(os.environ.get("HOME", "/"), "planted.txt")))
    if ground_truth == "socket":
        socket.create_connection(("127.0.0.1", int(solution_str)), timeout=2).close()
        return 1.0
    if ground_truth == "hang":
        while True:
            pass
    return 0.5
