"""Small end-to-end RL runs: the built-in arithmetic task and a unit-size random model."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def arithmetic_files(tmp_path_factory) -> tuple[str, str]:
    from hybridflow.data.tasks.arithmetic import generate_arithmetic_task

    return generate_arithmetic_task(tmp_path_factory.mktemp("arith"), num_train=128, num_val=16, seed=0,
                                    max_operands=2)
