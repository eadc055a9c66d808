"""Models and tokenizers from a local path, and the head-on-selected-positions module the training engine shards.

Actor and reference load ``AutoModelForCausalLM``. The critic loads ``AutoModelForTokenClassification`` with one
label from the same path: the backbone weights come from the causal-LM checkpoint and the scalar value head
(``score``) is freshly initialised (or loaded, when the path is a saved critic). Both are wrapped in `HeadOnPositions`,
whose forward runs the backbone on ``[b, L]`` tokens and applies the head only at the N positions that predict response
tokens, so neither the LM head nor the log-softmax is spent on prompt or padding positions.
"""

from __future__ import annotations

import functools

import torch
import torch.utils.checkpoint
from torch import nn

from hybridflow.engines.batch_invariant import pad_rows

__all__ = [
    "HF_PREFIX",
    "HeadOnPositions",
    "drop_hub_kernels",
    "entropy_from_logits",
    "from_pretrained",
    "hf_name",
    "load_model",
    "load_tokenizer",
    "log_prob_kernel_applies",
    "log_probs_and_entropy",
    "log_probs_from_logits",
]

# HeadOnPositions keeps the transformers model under this attribute; parameter names carry it as a prefix.
HF_PREFIX = "hf."


def hf_name(name: str) -> str:
    """Parameter name inside `HeadOnPositions` (FSDP2 keeps names) -> the transformers state_dict name."""
    return name[len(HF_PREFIX) :] if name.startswith(HF_PREFIX) else name


def load_tokenizer(path: str):
    """AutoTokenizer from a local directory; a tokenizer without a pad token pads with eos."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def from_pretrained(auto_class, path: str, attn_implementation: str = "sdpa", **kwargs) -> nn.Module:
    """``auto_class.from_pretrained`` with ``attn_implementation``; falls back to "eager" for a model whose
    transformers class has no SDPA path (Gemma 2: SDPA cannot soft-cap attention scores)."""
    try:
        return auto_class.from_pretrained(path, attn_implementation=attn_implementation, **kwargs)
    except ValueError as err:
        if attn_implementation != "sdpa" or "scaled_dot_product_attention" not in str(err):
            raise
        return auto_class.from_pretrained(path, attn_implementation="eager", **kwargs)


def drop_hub_kernels(model: nn.Module) -> None:
    """Turn off transformers' hub-kernel layer swaps (the `kernels` package, on by default in transformers 5) on a
    model that runs on CPU. Its kernel mapping has none for CPU, so there it changes no
    forward, yet every train()/eval() switch kernelizes the model again (a walk of the module tree and a mapping
    registration, several times the switch itself): the engines' passes switch the actor and the critic between
    the two modes every step. Torch's forward stays everywhere, as with the kernels installed."""
    if getattr(model, "use_kernels", False):
        model.use_kernels = False  # transformers' setter: kernelize with an empty mapping once, then never again


def store_frozen_projections_in(hf_model: nn.Module, dtype: torch.dtype) -> None:
    """An engine computing in `dtype` under autocast over fp32 weights: its frozen linear layers (all of a reference
    engine's, the base layers under a LoRA adapter) stored in `dtype` once, instead of autocast casting each of them
    again in every forward (it caches casts of trainable weights only; the casts were a fifth of a bf16 reference pass
    on CPU, docs/benchmarks.md), and in half the memory. The same bits: autocast rounds an fp32 weight to `dtype` for
    the linear exactly as this does, and leaves a weight already in `dtype` as it is. Embeddings, norms, routers and
    expert tensors keep their dtype (they are not autocast's linears), and so does an output head that shares the input
    embedding's weight. Sharded (FSDP2), the shards are kept in `dtype`: FSDP2 would cast them to it for every
    all-gather (the same rounding), and gathers a frozen bf16 shard as it is."""
    if dtype == torch.float32:
        return
    inputs = hf_model.get_input_embeddings()
    tied = inputs.weight if inputs is not None else None
    with torch.no_grad():
        for module in hf_model.modules():
            if not isinstance(module, nn.Linear):
                continue
            for name in ("weight", "bias"):
                param = getattr(module, name)
                if (param is not None and not param.requires_grad and param is not tied
                        and param.dtype == torch.float32):
                    setattr(module, name, nn.Parameter(param.to(dtype), requires_grad=False))


def load_model(path: str, role: str, attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32
               ) -> nn.Module:
    """The transformers model for `role` ("actor" | "ref" -> causal LM, "critic" -> one-label token classifier), in
    `dtype` (fp32 unless veRL's fsdp_config.model_dtype / model.torch_dtype asks for bf16 weights).

    fp32 weights are the master copy, with mixed precision applied at compute time by the engine; bf16 weights are
    trained as they are (half the memory, no fp32 copy).
    """
    from transformers import AutoModelForCausalLM, AutoModelForTokenClassification

    kwargs = {"dtype": dtype, "attn_implementation": attn_implementation}
    try:
        if role == "critic":
            model = from_pretrained(AutoModelForTokenClassification, path, num_labels=1, **kwargs)
        else:
            model = from_pretrained(AutoModelForCausalLM, path, **kwargs)
    except OSError as err:
        raise OSError(
            f"could not load a {role} model from {path!r}: {err}. Pass a local save_pretrained directory"
        ) from err
    return model


@functools.cache
def _log_prob_kernel():
    from hybridflow.engines.rollout import cpu_sampling  # the rollout's sampling kernel (built on first use)

    return cpu_sampling.load()


def log_prob_kernel_applies(logits: torch.Tensor) -> bool:
    """Whether `log_probs_from_logits` takes the C path for these (fp32) logits: plain [N, V] CPU tensors with
    contiguous rows, outside torch.compile, where the sampling kernel builds."""
    return (logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2
            and type(logits) is torch.Tensor and logits.stride(-1) == 1 and not torch.compiler.is_compiling()
            and _log_prob_kernel() is not None)


class _KernelLogProbs(torch.autograd.Function):
    """The C call each way: log-probs, and with `entropy` the entropy from the same pass over the exps (its backward
    writes both gradients in one pass). Returns (log_probs, entropy or None)."""

    @staticmethod
    def forward(ctx, logits, target_ids, entropy: bool):
        targets = target_ids.to(torch.int64).contiguous()
        out = _log_prob_kernel().log_probs(logits, targets, entropy=entropy)
        ctx.save_for_backward(logits, targets, out[1], out[3] if entropy else None)
        return out[0], out[2] if entropy else None

    @staticmethod
    def backward(ctx, grad, entropy_grad):
        logits, targets, lse, mean = ctx.saved_tensors
        entropy_grad = entropy_grad if mean is not None else None
        return _log_prob_kernel().log_probs_backward(logits, targets, lse, grad, entropy_grad, mean), None, None


def log_probs_from_logits(logits: torch.Tensor, target_ids: torch.Tensor) -> torch.Tensor:
    """``logits [N, V]`` (already divided by the temperature), ``target_ids [N]`` -> ``log p(target) [N]`` float32.

    On CPU (`log_prob_kernel_applies`) one C call each way (rollout/cpu_sampling.c's last section): the row's max and
    its exps summed in fp64 give ``lse``, and ``logits[target] - lse`` is rounded once, which is the value the native
    rollout's sampling reports for the same logits, bit for bit; the backward is one pass over ``[N, V]`` (torch's
    formula below is about ten, with a zero-filled buffer for the gather's gradient). Elsewhere torch's
    ``logits[target] - logsumexp(logits)`` in fp32.
    """
    logits = logits.float()
    if log_prob_kernel_applies(logits):
        return _KernelLogProbs.apply(logits, target_ids, False)[0]
    return logits.gather(-1, target_ids[:, None]).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """``logits [N, V]`` -> entropy of softmax(logits) ``[N]`` float32, in nats."""
    logits = logits.float()
    log_p = torch.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(dim=-1)


def log_probs_and_entropy(logits: torch.Tensor, target_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Both at once: ``(log p(target) [N], entropy [N])`` float32, the log-prob bit for bit `log_probs_from_logits`'.

    On CPU one C call each way (the entropy = lse - sum p z summed in fp64 in the log-prob's pass over the exps; only
    the logits are kept for backward); elsewhere one ``[N, V]`` log-softmax shared by the two, where calling
    `log_probs_from_logits` and `entropy_from_logits` separately would run two vocabulary-wide reductions and keep
    two ``[N, V]`` fp32 buffers for backward.
    """
    logits = logits.float()
    if log_prob_kernel_applies(logits):  # log_probs_from_logits' C call, which sums the entropy in the same pass
        return _KernelLogProbs.apply(logits, target_ids, True)
    # z - logsumexp(z), log_probs_from_logits' formula: the log-prob has the same bits with entropy on or off (and
    # as the rollout's sampling.py reports it)
    log_p = logits - torch.logsumexp(logits, dim=-1, keepdim=True)
    return log_p.gather(-1, target_ids[:, None]).squeeze(-1), -(log_p.exp() * log_p).sum(dim=-1)


# Chunks of at most this many logits (32 MB in fp32; rows a multiple of 16, as the batch-invariant mode's row groups
# need), on CPU and under logits_checkpointing. On CPU a chunk's [chunk, V] temporaries then stay below glibc's
# largest mmap threshold and are reused, not faulted in afresh each time (device.keep_freed_host_memory); with
# logits_checkpointing, backward's one chunk of logits, probabilities and their gradient stays small next to the
# decoder's activations. docs/benchmarks-history.md, seventeenth session.
_CHUNK_LOGITS = 1 << 23


class HeadOnPositions(nn.Module):
    """A transformers model whose head runs only at selected positions.

    ``forward(input_ids [b, L], position_ids [b, L], attention_mask [b, L] | None, select_rows [N], select_cols [N],
    target_ids [N], temperature, calculate_entropy, chunk_size, attention_kwargs)`` returns
      * causal LM: ``{"log_probs": [N], "entropy": [N] (if asked)}`` float32, of softmax(logits / temperature);
      * critic: ``{"values": [N]}`` float32.
    ``attention_kwargs`` go to the backbone's attention layers (packing.py's row boundaries of a packed row).
    It is one module so that FSDP2's root hooks gather the embedding, final norm and head around the whole forward.
    """

    # veRL's actor.entropy_checkpointing: in training, each chunk's entropy is recomputed from its logits in backward
    # (torch.utils.checkpoint) instead of keeping the softmax's [chunk, V] activations; the engine sets it
    entropy_checkpointing: bool = False
    # veRL's model.use_fused_kernels: in training, each chunk's logits (and what the log-prob and entropy keep of
    # them) are recomputed from its hidden states in backward, so backward holds one chunk's [chunk, V] at a time
    # instead of every chunk's; the engine sets it
    logits_checkpointing: bool = False
    # batch_invariant.py: the head's matmul gets whole groups of this many rows (zeros appended), so that a token's
    # logits round as in the native rollout's decode step; the engine sets it
    row_multiple: int = 1

    def __init__(self, hf_model: nn.Module, is_critic: bool) -> None:
        super().__init__()
        self.hf = hf_model
        self.is_critic = is_critic

    def _parts(self) -> tuple[nn.Module, nn.Module]:
        backbone = getattr(self.hf, self.hf.base_model_prefix)
        head = self.hf.score if self.is_critic else self.hf.get_output_embeddings()
        return backbone, head

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        select_rows: torch.Tensor,
        select_cols: torch.Tensor,
        target_ids: torch.Tensor | None = None,
        temperature: float = 1.0,
        calculate_entropy: bool = False,
        chunk_size: int = 2048,
        attention_kwargs: dict | None = None,
        calculate_sum_pi_squared: bool = False,
    ) -> dict[str, torch.Tensor]:
        backbone, _ = self._parts()
        hidden = backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False,
            **(attention_kwargs or {}),
        ).last_hidden_state
        # [N, H], gathered by flat row index: its backward is one scatter-add, where indexing by the (row, col) pair
        # takes index_put's accumulating path, several times slower on CPU; the positions are distinct, so either
        # way each gradient row is 0 + its one value: the same bits
        selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, select_rows * hidden.shape[1] + select_cols)
        empty = hidden[:0, 0, 0].float()  # stays on the autograd graph, so an all-empty micro-batch can backward
        return self.head_outputs(selected, target_ids, temperature, calculate_entropy, chunk_size, empty,
                                 calculate_sum_pi_squared)

    def head_outputs(
        self,
        selected: torch.Tensor,
        target_ids: torch.Tensor | None,
        temperature: float,
        calculate_entropy: bool,
        chunk_size: int,
        empty: torch.Tensor,
        calculate_sum_pi_squared: bool = False,
    ) -> dict[str, torch.Tensor]:
        """The head on ``selected [N, H]`` hidden states -> forward()'s outputs, each ``[N]`` float32; with
        calculate_sum_pi_squared also ``sum_pi_squared [N]`` = sum over the vocabulary of softmax(logits / T)^2
        (veRL's diagnostic: 1 for a one-hot policy, 1 / V for a uniform one; no gradient)."""
        _, head = self._parts()
        if self.is_critic:
            # a copy, not squeeze's view of the head's output: FSDP2's hook on a wrapped module's output would be
            # lost by an in-place op on a view, and torch warns about every such output
            return {"values": head(selected).squeeze(-1).float().clone()}
        log_probs, entropies, sum_pi_squared = [], [], []
        # the CausalLM forward we bypass soft-caps its logits (Gemma 2/3): cap * tanh(logits / cap)
        cap = getattr(self.hf.config, "final_logit_softcapping", None)

        def scaled_logits(chunk: torch.Tensor) -> torch.Tensor:
            logits = head(pad_rows(chunk, self.row_multiple))[: chunk.shape[0]]
            if cap:
                logits = torch.tanh(logits / cap) * cap
            # x / 1 is x, bit for bit (and so is its gradient): at temperature 1 the division would only copy [N, V]
            return logits.float() if temperature == 1.0 else logits.float() / temperature

        def chunk_outputs(chunk: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, ...]:
            logits = scaled_logits(chunk)
            if calculate_entropy:
                return log_probs_and_entropy(logits, targets)
            return (log_probs_from_logits(logits, targets),)

        recompute = self.logits_checkpointing and torch.is_grad_enabled()
        if recompute or selected.device.type == "cpu":
            vocab = self.hf.config.get_text_config().vocab_size
            chunk_size = min(chunk_size, max(16, _CHUNK_LOGITS // max(1, vocab) // 16 * 16))
        # Chunks bound the [chunk, V] logits held at once (V is ~150k for real vocabularies).
        for lo in range(0, selected.shape[0], max(1, chunk_size)):
            chunk, targets = selected[lo : lo + chunk_size], target_ids[lo : lo + chunk_size]
            if recompute:  # the same ops run again in backward (the same bits), one chunk's logits at a time
                lp, *ent = torch.utils.checkpoint.checkpoint(chunk_outputs, chunk, targets, use_reentrant=False)
                log_probs.append(lp)
                entropies += ent
            else:
                logits = scaled_logits(chunk)
                if calculate_entropy and self.entropy_checkpointing and torch.is_grad_enabled():
                    # only the logits (which the log-prob keeps anyway) are saved; the entropy's log-softmax and
                    # probabilities [chunk, V] are recomputed in backward
                    log_probs.append(log_probs_from_logits(logits, targets))
                    entropies.append(torch.utils.checkpoint.checkpoint(entropy_from_logits, logits,
                                                                       use_reentrant=False))
                elif calculate_entropy:
                    lp, ent = log_probs_and_entropy(logits, targets)
                    log_probs.append(lp)
                    entropies.append(ent)
                else:
                    log_probs.append(log_probs_from_logits(logits, targets))
            if calculate_sum_pi_squared:  # one more softmax of this chunk only: [chunk, V] at a time, as above
                with torch.no_grad():
                    pi = torch.softmax((scaled_logits(chunk) if recompute else logits).detach(), dim=-1)
                    sum_pi_squared.append(pi.square().sum(dim=-1))
        out = {"log_probs": torch.cat(log_probs) if log_probs else empty}
        if calculate_sum_pi_squared:
            out["sum_pi_squared"] = torch.cat(sum_pi_squared) if sum_pi_squared else empty.detach()
        if calculate_entropy:
            out["entropy"] = torch.cat(entropies) if entropies else empty
        return out
