"""The training engine's device mesh when it splits one model over several ranks: ``(dp, sp, tp)``.

* ``tp`` (tensor parallel, tensor_parallel_train.py): every TP rank holds a column or row slice of the attention and
  MLP projections; the ranks of a TP group compute the same rows together.
* ``sp`` (Ulysses sequence parallel, ulysses.py): the ranks of an SP group each hold a contiguous piece of every
  sequence and exchange heads for sequence around attention.
* ``dp`` (data parallel): groups that see different rows. FSDP2 shards the parameters over the ranks of ``dp`` and
  ``sp`` together (flattened into ``fsdp``); an SP rank's gradient is the share of its sequence piece, so FSDP's sum
  over those ranks is the whole gradient.

Ranks are laid out row-major, ``rank = (d * sp + s) * tp + t``: one *model group* (the ``sp x tp`` ranks that compute
the same rows) is a contiguous block of ranks, so on GPUs a TP group stays inside a node.

The worker's dispatch still gives every rank its own chunk of a batch. `gather_rows` pools the chunks of a model group
(each rank then computes the group's rows), and `own_rows` picks a rank's own rows back out of the group's results,
so nothing above the engine knows about the mesh.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hybridflow.protocol import DataProto

__all__ = ["TrainMesh", "build_train_mesh", "check_mesh_sizes", "clip_grads_", "total_grad_norm"]


def check_mesh_sizes(world_size: int, tp: int, sp: int, fsdp_size: int = -1, where: str = "") -> None:
    """Start-up check: every size positive and ``tp * sp`` divides the world. ValueError naming the numbers."""
    at = f"{where}: " if where else ""
    for name, value in (("tensor_model_parallel_size", tp), ("ulysses_sequence_parallel_size", sp)):
        if value < 1:
            raise ValueError(f"{at}{name}={value} must be >= 1")
    if world_size % (tp * sp):
        raise ValueError(
            f"{at}the training world of {world_size} ranks is not divisible by tensor_model_parallel_size ({tp}) x "
            f"ulysses_sequence_parallel_size ({sp}) = {tp * sp}; choose sizes whose product divides {world_size} "
            "(trainer.n_gpus_per_node x trainer.nnodes)"
        )
    if (tp > 1 or sp > 1) and fsdp_size not in (-1, world_size // tp):
        raise ValueError(
            f"{at}fsdp_size={fsdp_size} (hybrid sharding) cannot be combined with tensor/sequence parallelism "
            f"(tp={tp}, sp={sp}); leave fsdp_size at -1"
        )


@dataclass
class TrainMesh:
    """The ``(dp, sp, tp)`` mesh of one engine and the process groups it needs (see the module docstring)."""

    mesh: object  # torch.distributed.device_mesh.DeviceMesh, dims ("dp", "sp", "tp")
    dp_size: int
    sp_size: int
    tp_size: int
    rank: int
    fsdp_backend: str | None = None  # the flattened dp x sp group's backend (None: the default's)

    @property
    def tp_mesh(self):
        return self.mesh["tp"]

    @property
    def fsdp_mesh(self):
        """The 1-D mesh FSDP2 shards over: ``dp`` and ``sp`` flattened (``dp`` alone when sp is 1)."""
        if self.sp_size == 1:
            return self.mesh["dp"]
        return self.mesh["dp", "sp"]._flatten("fsdp", backend_override=self.fsdp_backend)

    @property
    def fsdp_size(self) -> int:
        return self.dp_size * self.sp_size

    @property
    def sp_group(self):
        return self.mesh.get_group("sp")

    @property
    def sp_rank(self) -> int:
        return self.mesh.get_local_rank("sp")

    @property
    def group_size(self) -> int:
        """Ranks that compute the same rows (one model group)."""
        return self.sp_size * self.tp_size

    def gather_rows(self, data: DataProto) -> tuple[DataProto, slice]:
        """Pool the model group's chunks (in rank order) -> ``(group rows, slice of this rank's rows in them)``."""
        if self.group_size == 1:
            return data, slice(0, len(data))
        group = self._model_group()
        chunks: list[DataProto | None] = [None] * self.group_size
        dist.all_gather_object(chunks, data.to("cpu"), group=group)
        me = self.rank % self.group_size
        start = sum(len(c) for c in chunks[:me])
        return DataProto.concat(chunks), slice(start, start + len(data))

    def _model_group(self):
        if not hasattr(self, "_group"):
            self._group = self.mesh["sp", "tp"]._flatten("model").get_group()
        return self._group


def build_train_mesh(device_type: str, world_size: int, rank: int, tp: int, sp: int) -> TrainMesh:
    """The ``(dp, sp, tp)`` mesh over the default process group; every rank calls it (collective)."""
    from torch.distributed.device_mesh import init_device_mesh

    from hybridflow.engines.shm_process_group import shm_backend_override

    check_mesh_sizes(world_size, tp, sp)
    dp = world_size // (tp * sp)
    # on one host's CPUs the dp and tp groups' collectives (FSDP's gathers and reductions, DTensor's all-reduces) go
    # through shared memory (shm_process_group.py), else gloo/nccl; Ulysses' all-to-alls on "sp" stay gloo's
    override = shm_backend_override(device_type, {"dp": dp, "tp": tp, "fsdp": dp * sp if sp > 1 else 1})
    fsdp_backend = (override or {}).pop("fsdp", None)
    mesh = init_device_mesh(device_type, (dp, sp, tp), mesh_dim_names=("dp", "sp", "tp"),
                            backend_override=override or None)
    return TrainMesh(mesh=mesh, dp_size=dp, sp_size=sp, tp_size=tp, rank=rank, fsdp_backend=fsdp_backend)


def total_grad_norm(params: list[torch.Tensor], device: torch.device) -> float:
    """L2 norm of all gradients, exact over any mix of DTensor meshes and placements, with one all-reduce.

    torch's clip_grad_norm_ cannot stack norms of DTensors that live on different meshes (FSDP-only parameters on the
    ``fsdp`` mesh, FSDP x TP ones on a 2-D mesh). Here each rank adds the squared norm of its local shard divided by
    the number of ranks that hold the same values (Replicate mesh dims, and the ranks outside the parameter's mesh),
    so the world sum counts every value once.
    """
    world = dist.get_world_size()
    local = torch.zeros((), dtype=torch.float64, device=device)
    for p in params:
        g = p.grad
        copies = world
        if hasattr(g, "to_local"):
            # replicated mesh dims hold copies, every other placement (Shard, FSDP's _StridedShard) splits values
            replicated = math.prod(g.device_mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())
            copies = world // g.device_mesh.size() * replicated
            g = g.to_local()
        local = local + g.detach().double().pow(2).sum().to(device) / copies
    dist.all_reduce(local)
    return float(local.sqrt())


def clip_grads_(params: list[torch.Tensor], max_norm: float, device: torch.device) -> float:
    """Scale gradients in place so their total norm is at most `max_norm`; returns the norm before clipping."""
    norm = total_grad_norm(params, device)
    if math.isfinite(norm) and norm > max_norm:
        coef = max_norm / (norm + 1e-6)
        for p in params:
            p.grad.mul_(coef)
    return norm
