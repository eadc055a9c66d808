"""A custom reward function run inside the sandbox (``reward_model.sandbox=true``).

Without it, ``custom_reward_function.path`` is imported into the scoring processes and runs with the driver's full
rights: it can read any file the driver can (``/etc/shadow`` when run as root), open sockets, and see every
environment variable (tokens, keys). With it, each call runs the file in ``run_python_sandboxed`` (see sandbox.py):
a fresh process with a wall-time and memory limit, no network, no subprocesses or ctypes, privileges dropped to
``nobody`` when started as root, a scratch directory as HOME and a minimal environment (no secrets).

The price: one short-lived process per sample (tens of milliseconds), and the file runs under ``python -I`` with the
sandbox's interpreter, so it should import only the standard library (plus what that interpreter has installed).
The file is never imported by the driver: its signature is checked from its source (ast).
"""

from __future__ import annotations

import ast
import json
import os
from typing import Any

from hybridflow.rewards.custom import SAMPLE_PARAMS
from hybridflow.rewards.registry import RewardConfigError
from hybridflow.rewards.sandbox import run_python_sandboxed

__all__ = ["SandboxedRewardFunction", "load_sandboxed_reward_fn"]

_MARK = "@@hybridflow-reward@@"

# Appended to the user's file: read one sample as JSON from stdin, call the function, print the value as JSON.
_HARNESS = """

def _hybridflow_reward_main():
    import json, sys
    task = json.loads(sys.stdin.read())
    value = {name}(**task)
    def plain(v):
        return v.item() if hasattr(v, "item") else repr(v)
    sys.stdout.write("\\n{mark}" + json.dumps(value, default=plain) + "\\n")

_hybridflow_reward_main()
"""


def _check_source(path: str, source: str, name: str) -> None:
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        raise RewardConfigError(f"custom reward file {path!r} does not parse: {e}") from e
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    fn = defs.get(name)
    if fn is None:
        raise RewardConfigError(
            f"custom reward file {path!r} defines no top-level function {name!r} (reward_model.sandbox=true reads the "
            f"source without importing it); functions defined there: {sorted(defs)}"
        )
    a = fn.args
    if a.kwarg is not None:
        return
    names = [p.arg for p in a.posonlyargs + a.args + a.kwonlyargs]
    missing = [p for p in SAMPLE_PARAMS if p not in names]
    if missing:
        raise RewardConfigError(
            f"custom reward function {path}:{name} must accept (data_source, solution_str, ground_truth, "
            f"extra_info=None); missing {missing}"
        )


class SandboxedRewardFunction:
    """``fn`` of the file at ``path``, each call boxed in its own sandboxed process. Picklable (plain fields)."""

    def __init__(self, path: str, name: str, *, time_limit_s: float, memory_limit_mb: int = 512) -> None:
        self.path, self.name = path, name
        self.time_limit_s, self.memory_limit_mb = time_limit_s, memory_limit_mb
        with open(path, encoding="utf-8") as f:
            source = f.read()
        _check_source(path, source, name)
        self.code = source + _HARNESS.format(name=name, mark=_MARK)

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
        task = {"data_source": data_source, "solution_str": solution_str, "ground_truth": ground_truth,
                "extra_info": extra_info}
        res = run_python_sandboxed(self.code, json.dumps(task, default=repr), time_limit_s=self.time_limit_s,
                                   memory_limit_mb=self.memory_limit_mb)
        if res.timed_out:
            raise TimeoutError(f"sandboxed {self.path}:{self.name} ran past its {self.time_limit_s:g} s limit")
        marked = [ln for ln in res.stdout.splitlines() if ln.startswith(_MARK)]
        if not res.ok or not marked:
            tail = (res.stderr.strip().splitlines() or ["(no output)"])[-1]
            what = " (memory limit)" if res.memory_exceeded else ""
            raise RuntimeError(f"sandboxed {self.path}:{self.name} failed{what}: {tail}")
        return json.loads(marked[-1][len(_MARK):])  # judged by the pool like any reward value (NaN, None: invalid)

    def __repr__(self) -> str:
        return f"SandboxedRewardFunction({self.path}:{self.name})"


def load_sandboxed_reward_fn(path: str, name: str, *, time_limit_s: float) -> SandboxedRewardFunction:
    """Check ``path``'s source for ``name`` (without importing it) and return the boxed callable."""
    path = os.path.abspath(os.path.expanduser(path))
    if not os.path.isfile(path):
        raise RewardConfigError(
            f"custom reward file {path!r} does not exist; give the path to a .py file as custom_reward_function.path"
        )
    return SandboxedRewardFunction(path, name, time_limit_s=time_limit_s)
