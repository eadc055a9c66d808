"""Writes a checkpoint in veRL's FSDP layout, the way veRL's FSDPCheckpointManager.save_checkpoint lays it out:
``fsdp_config.json``, ``model_world_size_W_rank_R.pt`` (each rank's ``model.state_dict()``) and ``huggingface/``.

    python write_verl_checkpoint.py MODEL_DIR OUT_DIR --world-size 2 [--mesh fsdp|ddp,fsdp]

Ranks are real processes (gloo); the model is FSDP2-``fully_shard``-ed, so the saved values are DTensors with
``Shard(0)`` placements, as veRL's FSDP2 workers save them.
"""

from __future__ import annotations

import argparse
import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, args: argparse.Namespace, port: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=args.world_size)
    names = tuple(args.mesh.split(","))
    shape = (args.world_size,) if len(names) == 1 else (2, args.world_size // 2)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = AutoModelForCausalLM.from_pretrained(args.model_dir, dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    os.makedirs(args.out_dir, exist_ok=True)
    torch.save(model.state_dict(), os.path.join(args.out_dir, f"model_world_size_{args.world_size}_rank_{rank}.pt"))
    if rank == 0:
        hf = os.path.join(args.out_dir, "huggingface")
        model.config.save_pretrained(hf)
        AutoTokenizer.from_pretrained(args.model_dir).save_pretrained(hf)
        with open(os.path.join(args.out_dir, "fsdp_config.json"), "w") as f:
            json.dump({"FSDP_version": 2, "world_size": args.world_size}, f, indent=4)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--mesh", default="fsdp")
    parser.add_argument("--port", type=int, default=29611)
    args = parser.parse_args()
    import transformers  # noqa: F401 - imported once here; the forked ranks share it (a 2-core machine)

    mp.start_processes(_rank, args=(args, args.port), nprocs=args.world_size, join=True, start_method="fork")


if __name__ == "__main__":
    main()
