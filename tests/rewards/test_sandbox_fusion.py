"""veRL's reward_model.sandbox_fusion.url: code rewards' test cases sent to a SandboxFusion service.

The service here is a loopback HTTP server that speaks SandboxFusion's run_code API (the request and answer
fields of its documentation) and runs each case in hybridflow's local box, so the client's request, its reading of
the answer and the scorer's verdict are all exercised over a real socket.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import ClassVar

import pytest

from hybridflow.rewards.sandbox import run_python_sandboxed
from hybridflow.rewards.sandbox_fusion import RemoteCodeScorer, RemoteRunner, SandboxFusionError
from hybridflow.trainer.config import ConfigError, load_config

GROUND_TRUTH = {"inputs": ["2 3\n", "10 -4\n"], "outputs": ["5\n", "6\n"]}
RIGHT = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
WRONG = "```python\na, b = map(int, input().split())\nprint(a * b)\n```"


class _RunCode(BaseHTTPRequestHandler):
    requests: ClassVar[list[dict]] = []
    answer_override: ClassVar[dict | None] = None

    def do_POST(self):  # http.server's name for it
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append(body)
        if type(self).answer_override is not None:
            answer = type(self).answer_override
        else:
            r = run_python_sandboxed(body["code"], body["stdin"], time_limit_s=body["run_timeout"],
                                     memory_limit_mb=body["memory_limit_MB"])
            answer = {"status": "Success" if r.ok else "Failed", "compile_result": None, "files": {},
                      "run_result": {"status": "TimeLimitExceeded" if r.timed_out else "Finished",
                                     "return_code": r.returncode, "stdout": r.stdout, "stderr": r.stderr,
                                     "execution_time": r.duration_s}}
        data = json.dumps(answer).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture
def service():
    _RunCode.requests, _RunCode.answer_override = [], None
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RunCode)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/run_code"
    server.shutdown()
    server.server_close()


def test_the_cases_run_on_the_service_and_score_like_the_local_box(service):
    scorer = RemoteCodeScorer(RemoteRunner(service, max_concurrent=2, memory_limit_mb=256))
    assert scorer("code", RIGHT, json.dumps(GROUND_TRUTH)) == {"score": 1.0, "pass_rate": 1.0}
    assert scorer("code", WRONG, GROUND_TRUTH) == {"score": 0.0, "pass_rate": 0.0}
    assert len(_RunCode.requests) == 4  # two cases per response, each its own request
    sent = _RunCode.requests[0]
    assert sent["language"] == "python" and sent["stdin"] == "2 3\n" and sent["memory_limit_MB"] == 256
    assert "print(a + b)" in sent["code"] and "```" not in sent["code"]  # the fenced block, as the local scorer runs


def test_a_service_error_or_no_service_raises_naming_the_url(service):
    scorer = RemoteCodeScorer(RemoteRunner(service))
    _RunCode.answer_override = {"status": "SandboxError", "message": "worker pool exhausted"}
    with pytest.raises(SandboxFusionError, match=r"SandboxFusion at http://127\.0\.0\.1:\d+/run_code answered"):
        scorer("code", RIGHT, GROUND_TRUTH)
    down = RemoteCodeScorer(RemoteRunner("http://127.0.0.1:9/run_code", request_timeout_s=2.0))
    with pytest.raises(SandboxFusionError, match=r"SandboxFusion at http://127\.0\.0\.1:9/run_code"):
        down("code", RIGHT, GROUND_TRUTH)


def test_verls_keys_route_the_code_data_sources_to_the_service(service):
    from hybridflow.rewards.managers import build_reward_manager
    from hybridflow.trainer.main import reward_spec

    cfg = load_config([f"reward_model.sandbox_fusion.url={service}", "reward_model.sandbox_fusion.max_concurrent=1",
                       "reward_model.sandbox_fusion.memory_limit_mb=300", "reward_model.num_workers=2"])
    spec = reward_spec(cfg)
    assert spec.options["num_workers"] == 1  # capped at max_concurrent: one request in flight per worker
    manager = build_reward_manager("naive", None, spec)
    try:
        assert manager.compute_score("apps", RIGHT, GROUND_TRUTH)["score"] == 1.0
        assert manager.compute_score("openai/gsm8k", "#### 4", "4") == 1.0  # other data sources: their own scorers
    finally:
        manager.close()
    assert len(_RunCode.requests) == 2 and _RunCode.requests[0]["memory_limit_MB"] == 300
    without = build_reward_manager("naive", None, reward_spec(load_config([])))
    try:
        assert without.compute_score("apps", RIGHT, GROUND_TRUTH)["score"] == 1.0  # the local box
    finally:
        without.close()
    assert len(_RunCode.requests) == 2


@pytest.mark.parametrize("override, match", [
    ("reward_model.sandbox_fusion.url=ftp://host/run_code", r"sandbox_fusion\.url='ftp://host/run_code': give"),
    ("reward_model.sandbox_fusion.max_concurrent=0", r"max_concurrent and memory_limit_mb must be >= 1"),
])
def test_bad_sandbox_fusion_settings_are_config_errors(override, match):
    with pytest.raises(ConfigError, match=match):
        load_config([override])
