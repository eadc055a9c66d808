"""Without vLLM, importing the adapter fails with an ImportError that says how to install it."""

from __future__ import annotations

import subprocess
import sys

HIDE_VLLM_AND_IMPORT = """
import sys
sys.modules["vllm"] = None  # what an environment without vLLM looks like to importlib
try:
    import hybridflow.engines.rollout.vllm_rollout
except ImportError as e:
    print("ImportError:", e)
else:
    print("imported")
"""


def test_import_without_vllm_names_the_install_command():
    out = subprocess.run([sys.executable, "-c", HIDE_VLLM_AND_IMPORT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ImportError:" in out.stdout
    assert "bash scripts/setup_vllm_env.sh" in out.stdout and "hybridflow[vllm]" in out.stdout
