"""Code rewards run on a SandboxFusion service (veRL's ``reward_model.sandbox_fusion.url``) instead of the local box.

SandboxFusion (bytedance/SandboxFusion) serves ``POST <url>`` = ``.../run_code`` with a JSON body ``{"code",
"language", "stdin", "run_timeout", "compile_timeout", "memory_limit_MB", "files", "fetch_files"}`` and answers
``{"status": "Success" | "Failed" | "SandboxError", "run_result": {"status", "return_code", "stdout", "stderr",
"execution_time"}, "compile_result", "files"}``. `RemoteRunner` sends one test case per request and returns the same
`SandboxResult` the local box (sandbox.py) does, so the code scorer (scorers/code.py) compares outputs the same way.

`RemoteCodeScorer` is what the reward manager's scorer table holds for the code data sources when the url is set:
picklable (reward worker processes get a copy). Requests in flight: each reward worker process scores one sample at
a time, its cases one after another, and the driver caps the workers at ``max_concurrent`` (trainer/main.py
``reward_spec``); within a process a semaphore of ``max_concurrent`` slots guards callers that use threads. A request that fails (no connection, HTTP error, a ``SandboxError`` answer) raises: the reward
manager counts it as a failed sample and stops the run past ``reward_model.max_failure_fraction`` with the message,
rather than score every sample 0 because the service is down.
"""

from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from typing import Any

from hybridflow.rewards.sandbox import SandboxResult

__all__ = ["RemoteCodeScorer", "RemoteRunner", "SandboxFusionError"]

_SEMAPHORES: dict[tuple[str, int], threading.BoundedSemaphore] = {}  # per process: (url, max_concurrent) -> slots
_LOCK = threading.Lock()


class SandboxFusionError(RuntimeError):
    """The service could not run a case (unreachable, an HTTP error, or its own SandboxError)."""


class RemoteRunner:
    """``runner(code, stdin, time_limit_s=, memory_limit_mb=) -> SandboxResult`` over one SandboxFusion url."""

    def __init__(self, url: str, max_concurrent: int = 64, memory_limit_mb: int = 1024, language: str = "python",
                 request_timeout_s: float = 60.0):
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"reward_model.sandbox_fusion.url={url!r}: give the run_code endpoint as an http(s) url")
        if max_concurrent < 1:
            raise ValueError(f"reward_model.sandbox_fusion.max_concurrent={max_concurrent} must be >= 1")
        self.url, self.max_concurrent, self.memory_limit_mb = url, max_concurrent, memory_limit_mb
        self.language, self.request_timeout_s = language, request_timeout_s

    def _slots(self) -> threading.BoundedSemaphore:
        with _LOCK:
            return _SEMAPHORES.setdefault((self.url, self.max_concurrent), threading.BoundedSemaphore(self.max_concurrent))

    def __call__(self, code: str, stdin: str = "", *, time_limit_s: float = 5.0,
                 memory_limit_mb: int | None = None) -> SandboxResult:
        body = json.dumps({
            "code": code, "language": self.language, "stdin": stdin, "run_timeout": time_limit_s,
            "compile_timeout": time_limit_s, "memory_limit_MB": memory_limit_mb or self.memory_limit_mb,
            "files": {}, "fetch_files": [],
        }).encode()
        request = urllib.request.Request(self.url, data=body, headers={"Content-Type": "application/json"})
        with self._slots():
            try:
                with urllib.request.urlopen(request, timeout=self.request_timeout_s + time_limit_s) as response:
                    answer = json.loads(response.read().decode())
            except (urllib.error.URLError, OSError, ValueError) as err:
                raise SandboxFusionError(f"SandboxFusion at {self.url}: {err}") from err
        status = answer.get("status")
        if status == "SandboxError" or (not isinstance(answer.get("run_result"), dict) and status != "Failed"):
            raise SandboxFusionError(f"SandboxFusion at {self.url} answered {str(answer)[:300]}")
        run = answer.get("run_result") or {}
        run_status = run.get("status")
        timed_out = run_status == "TimeLimitExceeded"
        returncode = run.get("return_code")
        return SandboxResult(
            ok=status == "Success" and run_status == "Finished" and returncode == 0,
            stdout=run.get("stdout") or "", stderr=run.get("stderr") or "",
            returncode=None if timed_out else returncode, timed_out=timed_out,
            memory_exceeded="MemoryError" in (run.get("stderr") or ""), output_truncated=False,
            duration_s=float(run.get("execution_time") or 0.0), network_isolation="remote",
        )


class RemoteCodeScorer:
    """The code scorer (custom-reward signature) with every test case run by `runner`."""

    def __init__(self, runner: RemoteRunner):
        self.runner = runner

    def __call__(self, data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> Any:
        from hybridflow.rewards.scorers import code

        return code.compute_score(solution_str, ground_truth, memory_limit_mb=self.runner.memory_limit_mb,
                                  runner=self.runner)
