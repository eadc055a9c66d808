"""The training engine's RMSNorm, rotary embedding and SwiGLU on CPU, in fp32 and bf16, as one call each way.

Why: transformers writes these as chains of small torch ops (the norm: pow, mean, add, rsqrt, two products; the
rotation: two products, a negation, a concatenation and a sum per tensor, on transposed views; the MLP's gate:
silu, then a product), and autograd runs a backward op for each, so a training step spends much of its non-matmul
time passing the same activations through memory again and again (docs/benchmarks-history.md, fourteenth session). Here:

    RMSNorm   forward   the native rollout's fp32 norm kernel (cpu_step_ops.c: torch's bits, one pass)
              backward  rms_norm_backward_f32 (cpu_train_ops.c): dx and the weight's gradient in one pass
    rotary    forward   the native rollout's rotation kernel on the rows in place (transformers' bits)
              backward  the same kernel with the sine table rolled by half the rotary width (the rotation's
                        transpose), so the gradient is written in the projection's own layout
    SwiGLU    forward   torch's ``silu(gate) * up`` (its bits; silu's output is not kept)
              backward  silu_mul_backward_f32 / _bf16 (cpu_train_ops.c): both gradients in one pass, written
                        straight into a fused gate/up projection's gradient (Phi-3)

bf16: the engine's bf16 mode keeps fp32 parameters and computes under bf16 autocast. There the residual stream, and
so every norm's input, stays fp32 (the fp32 kernels apply as they are); the projections give bf16 q/k, which
transformers' products with the fp32 rotary tables promote to fp32 (the rotation of ``q.float()`` is the same
arithmetic); the SwiGLU's gate/up are bf16, its forward torch's bf16 ops and its backward the bf16 kernel (fp32
arithmetic, each gradient rounded to bf16 once where torch's ops round after each). A sharded bf16 engine's bf16
parameters give bf16 norm inputs and bf16 tables: those calls keep transformers' ops.

Forwards are bit for bit transformers', so log-probs, the rollout-vs-training mismatch and the batch-invariant mode
do not move; gradients differ by rounding only (fp32 sums in another order; in bf16 fewer roundings).

`use_fused_ops(model)` installs them on the model's modules in place (a norm or MLP module's class is swapped for a
subclass with the fused forward; parameters and state dict are unchanged, so checkpoints, FSDP2, PEFT and export
are too), and the rotary function of the model's transformers module is wrapped: the wrapper takes the fused path for
plain CPU tensors of the dtypes above and calls transformers' function for anything else (bf16 tables, another
device, a DTensor, torch.compile). Architectures: the RMSNorm of Qwen2/3, Qwen3-MoE, Llama, Mistral, Phi-3, SmolLM3
and Gemma 2/3 (1 + w), the SiLU-gated MLP of Qwen2/3, Qwen3-MoE's shared/dense MLP, Llama, Mistral, Phi-3 and
SmolLM3, and transformers' rotary function of any of them. `fused_ops_here` says whether the kernels build and the
engine wants them (EngineConfig.fused_cpu_ops).
"""

from __future__ import annotations

import contextvars
import ctypes
import functools
import logging
import sys
import weakref
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hybridflow.engines.rollout import cpu_step_ops
from hybridflow.engines.rollout.c_kernels import load_library

__all__ = ["FusedOpsKernel", "fused_ops_here", "load", "use_fused_ops"]

logger = logging.getLogger(__name__)

_SOURCE = Path(__file__).with_name("cpu_train_ops.c")

# transformers' norm classes whose fp32 forward is x * rsqrt(mean(x^2) + eps) * w, or * (1 + w) (Gemma)
_NORMS = {"Qwen2RMSNorm": False, "Qwen3RMSNorm": False, "Qwen3MoeRMSNorm": False, "LlamaRMSNorm": False,
          "MistralRMSNorm": False, "Phi3RMSNorm": False, "SmolLM3RMSNorm": False, "Gemma2RMSNorm": True,
          "Gemma3RMSNorm": True}
# MLP classes computing down(act(gate(x)) * up(x)), and Phi-3's with one gate_up projection split in two
_GATED_MLPS = {"Qwen2MLP", "Qwen3MLP", "Qwen3MoeMLP", "LlamaMLP", "MistralMLP", "SmolLM3MLP"}
_FUSED_GATE_UP_MLPS = {"Phi3MLP"}
_SILU = {"silu", "swish"}


class FusedOpsKernel:
    """The two backward kernels of cpu_train_ops.c, and the rollout's forward kernels (cpu_step_ops.StepOpsKernel)."""

    def __init__(self, lib: ctypes.CDLL, step_ops: cpu_step_ops.StepOpsKernel):
        i, long, f, ptr = ctypes.c_int, ctypes.c_long, ctypes.c_float, ctypes.c_void_p
        self.step_ops = step_ops
        self._norm_backward = lib.rms_norm_backward_f32
        # R, n, x, sx, g, w, eps, dx, dw, partial, threads
        self._norm_backward.argtypes = [long, long, ptr, long, ptr, ptr, f, ptr, ptr, ptr, i]
        self._norm_backward.restype = None
        self._silu_mul_backward = lib.silu_mul_backward_f32
        # R, C, a, sa, b, sb, gy, da, sda, db, sdb, threads
        self._silu_mul_backward.argtypes = [long, long, ptr, long, ptr, long, ptr, ptr, long, ptr, long, i]
        self._silu_mul_backward.restype = None
        self._silu_mul_backward_bf16 = lib.silu_mul_backward_bf16
        self._silu_mul_backward_bf16.argtypes = self._silu_mul_backward.argtypes
        self._silu_mul_backward_bf16.restype = None

    def rms_norm_backward(self, x: torch.Tensor, grad: torch.Tensor, weight: torch.Tensor, eps: float,
                          weight_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [R, n] (last dimension contiguous), grad [R, n] contiguous, weight [n] (the effective one) ->
        (dx [R, n], dw [n] or None)."""
        R, n = x.shape
        threads = torch.get_num_threads()
        dx = torch.empty(R, n)
        dw = torch.empty(n) if weight_grad else None
        partial = torch.empty(threads * n) if weight_grad else None
        self._norm_backward(R, n, x.data_ptr(), x.stride(0), grad.data_ptr(), weight.data_ptr(), eps, dx.data_ptr(),
                            0 if dw is None else dw.data_ptr(), 0 if partial is None else partial.data_ptr(), threads)
        return dx, dw

    def silu_mul_backward(self, a: torch.Tensor, b: torch.Tensor, grad: torch.Tensor, da: torch.Tensor,
                          db: torch.Tensor) -> None:
        """a, b, da, db [R, C] (last dimension contiguous; da and db may be halves of one buffer), grad [R, C]
        contiguous, all fp32 or all bf16: da, db = the gradients of silu(a) * b."""
        R, C = a.shape
        function = self._silu_mul_backward_bf16 if a.dtype == torch.bfloat16 else self._silu_mul_backward
        function(R, C, a.data_ptr(), a.stride(0), b.data_ptr(), b.stride(0), grad.data_ptr(), da.data_ptr(),
                 da.stride(0), db.data_ptr(), db.stride(0), torch.get_num_threads())


@functools.cache
def load() -> FusedOpsKernel | None:
    """The kernels, built on first use (c_kernels.py); None where they (or the rollout's fp32 norm) do not run here."""
    step_ops = cpu_step_ops.load()
    if step_ops is None or step_ops.f32_lanes is None:
        return None
    lib = load_library(_SOURCE, "train_ops", "training norm/SwiGLU backward",
                       "the training engine keeps transformers' norm, rotary and MLP ops")
    return None if lib is None else FusedOpsKernel(lib, step_ops)


def fused_ops_here(device: torch.device, compute_dtype: torch.dtype, setting: bool | None = None) -> bool:
    """Whether the engine fuses its norm, rotary and SwiGLU ops: `setting` when given (True where the kernels cannot
    run is an error), else on CPU in fp32 or bf16 where they build."""
    # bf16: the engine computes under autocast; the ops take the fused path where their operands are fp32 (see
    # _fused) and transformers' elsewhere (bf16 parameters of a sharded bf16 engine)
    possible = torch.device(device).type == "cpu" and compute_dtype in (torch.float32, torch.bfloat16)
    if setting is None:
        return possible and load() is not None
    if setting and not (possible and load() is not None):
        raise ValueError(f"fused_cpu_ops=True needs fp32 or bf16 on a CPU where the C kernels build (device "
                         f"{device}, dtype {compute_dtype}; see the log for the build's error); leave it unset (None) "
                         "to choose")
    return bool(setting)


def _plain_fp32_cpu(*tensors: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 and t.device.type == "cpu" and type(t.data) is torch.Tensor
               and t.stride(-1) == 1 for t in tensors)


def _fused(*tensors: torch.Tensor) -> bool:
    # Under bf16 autocast too: the fused ops are not autocast ops, so where their operands are fp32 (the norms of
    # a model kept in fp32, whose residual stream stays fp32) transformers' ops compute in fp32 as well.
    return not torch.compiler.is_compiling() and _plain_fp32_cpu(*tensors)


# --- RMSNorm -------------------------------------------------------------------------------------------------------

class _RMSNormFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, offset):
        kernel = load()
        w = weight + 1.0 if offset else weight  # Gemma: transformers computes 1.0 + weight.float()
        rows = x.reshape(-1, x.shape[-1])
        ctx.save_for_backward(rows, w)
        ctx.eps, ctx.shape = eps, x.shape
        return kernel.step_ops.rms_norm(rows, w, eps, offset).view(x.shape)

    @staticmethod
    def backward(ctx, grad):
        rows, w = ctx.saved_tensors
        grad = grad.reshape(rows.shape).contiguous()
        dx, dw = load().rms_norm_backward(rows, grad, w, ctx.eps, ctx.needs_input_grad[1])
        return dx.view(ctx.shape), dw, None, None


class _FusedRMSNorm(nn.Module):
    """Mixed into a transformers RMSNorm class by `use_fused_ops`: the fused fp32 path, else the class's own."""

    _offset = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        eps = getattr(self, "variance_epsilon", getattr(self, "eps", None))
        if eps is None or not _fused(x, self.weight) or x.shape[-1] >= cpu_step_ops._TORCH_GRAIN:
            return super().forward(x)
        return _RMSNormFn.apply(x, self.weight, float(eps), self._offset)


# --- SwiGLU --------------------------------------------------------------------------------------------------------

def _fused_swiglu(*tensors: torch.Tensor) -> bool:
    """fp32 operands (as `_fused`), or bf16 ones: the gate/up projections' outputs under bf16 autocast, whose
    forward stays torch's bf16 ops and whose backward is the bf16 kernel."""
    if all(t.dtype == torch.bfloat16 for t in tensors):
        return not torch.compiler.is_compiling() and all(
            t.device.type == "cpu" and type(t.data) is torch.Tensor and t.stride(-1) == 1 for t in tensors)
    return _fused(*tensors)


def _rows2d(t: torch.Tensor) -> torch.Tensor:
    """t [..., C] as rows [R, C] (a view where the strides allow, else a copy), last dimension contiguous."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class _SiluMulFn(torch.autograd.Function):
    """silu(a) * b; a and b may be the two halves of one tensor, whose gradient is then written as one buffer."""

    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return F.silu(a).mul_(b)

    @staticmethod
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        grad = grad.reshape(-1, grad.shape[-1]).to(a.dtype).contiguous()
        da, db = torch.empty(a.shape, dtype=a.dtype), torch.empty(b.shape, dtype=b.dtype)
        load().silu_mul_backward(_rows2d(a), _rows2d(b), grad, da.view(-1, a.shape[-1]), db.view(-1, b.shape[-1]))
        return da, db


class _SiluMulPackedFn(torch.autograd.Function):
    """silu(gu[..., :C]) * gu[..., C:] for a fused gate/up output gu [..., 2C]; its gradient is one [..., 2C]."""

    @staticmethod
    def forward(ctx, gu):
        gate, up = gu.chunk(2, dim=-1)
        ctx.save_for_backward(gu)
        return up * F.silu(gate)  # Phi-3's order (the product is commutative: the same bits either way)

    @staticmethod
    def backward(ctx, grad):
        (gu,) = ctx.saved_tensors
        C = gu.shape[-1] // 2
        grad = grad.reshape(-1, C).to(gu.dtype).contiguous()
        rows = _rows2d(gu)
        d = torch.empty(rows.shape, dtype=gu.dtype)
        load().silu_mul_backward(rows[:, :C], rows[:, C:], grad, d[:, :C], d[:, C:])
        return d.view(gu.shape)


class _FusedGatedMLP(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_proj(x), self.up_proj(x)
        if not _fused_swiglu(gate, up):
            return self.down_proj(self.act_fn(gate) * up)
        return self.down_proj(_SiluMulFn.apply(gate, up))


class _FusedGateUpMLP(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up_proj(x)
        if not _fused_swiglu(gu) or gu.shape[-1] % 2:
            gate, up = gu.chunk(2, dim=-1)
            return self.down_proj(up * self.activation_fn(gate))
        return self.down_proj(_SiluMulPackedFn.apply(gu))


# --- rotary embedding ----------------------------------------------------------------------------------------------

def _head_rows(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] (transformers' layout: usually a transposed view of [B, T, H, D]) as rows [B * T, H, D]."""
    B, H, T, D = x.shape
    rows = x.transpose(1, 2).reshape(B * T, H, D)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


class _RotaryFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cos, signed_sin, back_sin, positions):
        B, H, T, D = x.shape
        ctx.save_for_backward(cos, back_sin, positions)
        out = load().step_ops.rotate(_head_rows(x), cos, signed_sin, positions)
        return out.view(B, T, H, D).transpose(1, 2)

    @staticmethod
    def backward(ctx, grad):
        cos, back_sin, positions = ctx.saved_tensors
        B, H, T, D = grad.shape
        d = load().step_ops.rotate(_head_rows(grad), cos, back_sin, positions)
        return d.view(B, T, H, D).transpose(1, 2), None, None, None, None


def _rotary_operands(q: torch.Tensor, k: torch.Tensor) -> bool:
    """q and k the fused rotation takes with fp32 tables: fp32, or bf16/fp16 (under autocast the projections give
    bf16; transformers' ``q * cos`` then promotes to fp32, which the rotation of ``q.float()`` reproduces)."""
    if q.dtype != k.dtype or q.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        return False
    return all(t.device.type == "cpu" and type(t.data) is torch.Tensor and t.stride(-1) == 1 for t in (q, k))


# The tables of the last (cos, sin) pair: transformers computes them once per forward and passes the same tensors to
# every layer, so the layers after the first reuse the first one's (weak references: the memo keeps nothing alive)
_last_tables: list = [None]


def _rotary_tables(cos: torch.Tensor, sin: torch.Tensor, batch: int) -> tuple[torch.Tensor, ...]:
    """(cos rows [B T, dim], the signed sine, its transpose's, each q row's table row [batch T]) for cos and sin
    [B, T, dim] (B 1 or `batch`)."""
    key = (*(None if t.is_inference() else t._version for t in (cos, sin)), batch)  # inference tensors: no versions
    last = _last_tables[0]
    if last is not None and last[0]() is cos and last[1]() is sin and last[2] == key:
        return last[3]
    B, T, dim = cos.shape
    half = dim // 2
    cos_rows = cos.reshape(B * T, dim).contiguous()
    sin_rows = sin.reshape(B * T, dim)
    # the rotation folds rotate_half's sign into the table; its transpose reads the table rolled by half
    signed_sin = torch.cat((-sin_rows[:, :half], sin_rows[:, half:]), dim=-1)
    back_sin = torch.cat((sin_rows[:, half:], -sin_rows[:, :half]), dim=-1)
    # row (b, t) of q reads table row b * T + t, or t where one table serves the whole batch
    positions = torch.arange(B * T) if batch == B else torch.arange(T).repeat(batch)
    tables = (cos_rows, signed_sin, back_sin, positions)
    _last_tables[0] = (weakref.ref(cos), weakref.ref(sin), key, tables)
    return tables


def _fused_rotary(original):
    """transformers' apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1), fused where `_fused` holds."""

    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        unsqueeze_dim = args[0] if args else kwargs.get("unsqueeze_dim", 1)
        # torch.compile first: dynamo cannot trace ContextVar.get (vLLM compiles transformers' model code in-process)
        if (torch.compiler.is_compiling() or not _IN_FUSED_ATTENTION.get()
                or unsqueeze_dim != 1 or len(args) > 1 or set(kwargs) - {"unsqueeze_dim"}
                or q.dim() != 4 or k.dim() != 4
                or cos.dim() != 3 or cos.shape != sin.shape or cos.requires_grad or sin.requires_grad
                or cos.shape[0] not in (1, q.shape[0]) or cos.shape[1] != q.shape[2] or k.shape[2] != q.shape[2]
                or cos.shape[-1] % 2 or cos.shape[-1] > min(q.shape[-1], k.shape[-1])
                or not _fused(cos, sin) or not _rotary_operands(q, k)):
            return original(q, k, cos, sin, *args, **kwargs)
        if q.dtype != torch.float32:  # bf16 q/k under autocast, fp32 tables: transformers' products promote to fp32
            q, k = q.float(), k.float()
        tables = _rotary_tables(cos, sin, q.shape[0])
        return _RotaryFn.apply(q, *tables), _RotaryFn.apply(k, *tables)

    apply_rotary_pos_emb.hybridflow_fused = True
    return apply_rotary_pos_emb


# The wrapped function is the transformers module's, shared by every model of that architecture in the process; it
# takes the fused path only inside the forward (or a gradient checkpoint's recompute) of an attention module that
# use_fused_ops installed, so other models keep transformers' own function.
_IN_FUSED_ATTENTION: contextvars.ContextVar[bool] = contextvars.ContextVar("hybridflow_fused_rotary", default=False)


class _FusedRotaryAttention(nn.Module):
    def forward(self, *args, **kwargs):
        token = _IN_FUSED_ATTENTION.set(True)
        try:
            return super().forward(*args, **kwargs)
        finally:
            _IN_FUSED_ATTENTION.reset(token)


# --- installing ----------------------------------------------------------------------------------------------------

@functools.cache
def _subclass(cls: type, mixin: type, offset: bool | None = None) -> type:
    attrs = {} if offset is None else {"_offset": offset}
    return type(f"Fused{cls.__name__}", (mixin, cls), attrs)


def _silu(module: nn.Module) -> bool:
    act = getattr(module, "config", None)
    name = getattr(act, "hidden_act", None) or getattr(act, "hidden_activation", None)
    return name in _SILU


def _wrap_rotary(space) -> bool:
    """Wrap the transformers module `space`'s apply_rotary_pos_emb (its attention forwards read it from the module's
    globals) once; whether it has one."""
    original = getattr(space, "apply_rotary_pos_emb", None)
    if not callable(original):
        return False
    if not getattr(original, "hybridflow_fused", False):
        space.apply_rotary_pos_emb = _fused_rotary(original)
    return True


def use_fused_ops(model: nn.Module) -> dict[str, int]:
    """Install the fused norm, SwiGLU and rotary paths on `model` in place; returns how many of each. Run it on the
    finished module tree (after PEFT, before FSDP shards), where `fused_ops_here` holds."""
    counts = {"rms_norm": 0, "swiglu": 0, "rotary": 0}
    for module in model.modules():
        name = type(module).__name__
        if name in _NORMS:
            module.__class__ = _subclass(type(module), _FusedRMSNorm, _NORMS[name])
            counts["rms_norm"] += 1
        elif name in _GATED_MLPS and _silu(module):
            module.__class__ = _subclass(type(module), _FusedGatedMLP)
            counts["swiglu"] += 1
        elif name in _FUSED_GATE_UP_MLPS and _silu(module):
            module.__class__ = _subclass(type(module), _FusedGateUpMLP)
            counts["swiglu"] += 1
        elif name.endswith("Attention") and _wrap_rotary(sys.modules.get(type(module).__module__)):
            module.__class__ = _subclass(type(module), _FusedRotaryAttention)
            counts["rotary"] += 1
    logger.debug("fused CPU ops installed: %s", counts)
    return counts
