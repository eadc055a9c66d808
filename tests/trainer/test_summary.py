"""The summary `hybridflow train` prints at the end: held-out means of 0/1 verdicts as accuracies, other rewards as
they are (an environment's return of 1.6 is not "160%")."""

from __future__ import annotations

from types import SimpleNamespace

from hybridflow.trainer.main import _print_summary


def test_held_out_means_print_as_accuracy_only_within_0_and_1(capsys):
    result = SimpleNamespace(
        run_dir="/run", restarts=0, max_restarts=3,
        initial_val={"val/task/mean@4": 0.212, "val/game/mean@1": 1.6386, "val/other": 3.0},
        last_metrics={"val/task/mean@4": 0.559, "val/game/mean@1": 1.5892, "val/new/mean@2": 0.5},
    )
    _print_summary(result)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("held-out")]
    assert lines == [
        "held-out mean score val/game/mean@1: before 1.639 -> after 1.589",
        "held-out accuracy val/new/mean@2: before n/a -> after 50.0%",
        "held-out accuracy val/task/mean@4: before 21.2% -> after 55.9%",
    ]
