"""Tensor-parallel training (Megatron-style column/row splits) with torch's own API, before FSDP2 shards over dp.

Per decoder layer, `torch.distributed.tensor.parallel.parallelize_module` turns
  * ``self_attn.q_proj / k_proj / v_proj`` and ``mlp.gate_proj / up_proj`` into ColwiseParallel (each TP rank owns
    ``heads / tp`` query heads, ``kv_heads / tp`` KV heads and ``intermediate / tp`` MLP columns; weight ``[out/tp,
    in]``, bias split alike), and
  * ``self_attn.o_proj`` and ``mlp.down_proj`` into RowwiseParallel (weight ``[out, in/tp]``; the partial outputs
    are summed by one all-reduce per block),
so attention runs on the local heads untouched (transformers reshapes with ``-1`` heads). Norms and the embedding
stay replicated over TP (FSDP still shards them over dp); the per-head q/k norms of Qwen3 and Gemma 3 become
replicated DTensors over an input sharded on the heads dim, so their gradient is summed over the TP ranks' heads. An untied output head is split over the vocabulary
(ColwiseParallel) and its logits gathered (``output_layouts=Replicate()``), so log-softmax and entropy see the whole
vocabulary; a tied head stays whole with its embedding, as one tensor.

Weight sync and export gather ``full_tensor()``; a checkpoint keeps each rank's local slices with the global indices
they hold (``checkpoint_io.shard_index_runs``), which `hybridflow export` puts back together offline.
"""

from __future__ import annotations

from torch import nn

__all__ = ["TP_ARCHITECTURES", "apply_tensor_parallel", "check_tensor_parallel"]

# transformers model_type -> the decoder layer's projection names are the Llama ones (q/k/v/o, gate/up/down)
TP_ARCHITECTURES = ("llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "smollm3")

_COLWISE = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
_ROWWISE = ("self_attn.o_proj", "mlp.down_proj")


def check_tensor_parallel(hf_config, tp: int, where: str = "tensor_model_parallel_size") -> None:
    """Start-up check that `tp` splits this model evenly; ValueError naming the numbers and what to change."""
    if tp == 1:
        return
    model_type = getattr(hf_config, "model_type", "?")
    if model_type not in TP_ARCHITECTURES:
        raise ValueError(
            f"{where}={tp}: tensor-parallel training supports model types {list(TP_ARCHITECTURES)}, this model is "
            f"{model_type!r} (fused or expert projections); use {where}=1"
        )
    sizes = {
        "num_attention_heads": hf_config.num_attention_heads,
        "num_key_value_heads": getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        "intermediate_size": hf_config.intermediate_size,
    }
    for name, value in sizes.items():
        if value % tp:
            divisors = [d for d in range(1, value + 1) if all(v % d == 0 for v in sizes.values())]
            raise ValueError(
                f"{where}={tp} does not divide the model's {name}={value} "
                f"(heads {sizes['num_attention_heads']}, KV heads {sizes['num_key_value_heads']}, intermediate "
                f"{sizes['intermediate_size']}); choose a size that divides all three: {divisors}"
            )


def apply_tensor_parallel(hf_model: nn.Module, tp_mesh) -> None:
    """Split `hf_model`'s projections over `tp_mesh` in place (see the module docstring); call before fully_shard."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = {name: ColwiseParallel() for name in _COLWISE}
    plan.update({name: RowwiseParallel() for name in _ROWWISE})
    backbone = getattr(hf_model, hf_model.base_model_prefix)
    for layer in backbone.layers:
        layer_plan = dict(plan)
        for norm in ("q_norm", "k_norm"):  # Qwen3 / Gemma 3: RMSNorm over head_dim of [b, L, heads/tp, d]
            if hasattr(layer.self_attn, norm):
                # each rank sees only its heads, so the shared weight's gradient is a partial sum: as a DTensor
                # over an input sharded on the heads dim, its gradient is all-reduced over TP by DTensor itself
                layer_plan[f"self_attn.{norm}"] = SequenceParallel(sequence_dim=2, use_local_output=True)
        parallelize_module(layer, tp_mesh, layer_plan)
    head = hf_model.get_output_embeddings()
    tied = head is not None and head.weight is backbone.get_input_embeddings().weight
    if head is not None and not tied:
        # vocab-parallel head, logits gathered: the log-softmax over the vocabulary needs every column
        name = next(n for n, m in hf_model.named_children() if m is head)
        parallelize_module(hf_model, tp_mesh, {name: ColwiseParallel(output_layouts=Replicate())})
