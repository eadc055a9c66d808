"""`hybridflow` command line: train | sft | export | report | make-tiny-model."""

from __future__ import annotations

import argparse
import sys

from hybridflow import __version__


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from hybridflow.engines.tiny import write_tiny_model

    path = write_tiny_model(args.path, spec=args.size, seed=args.seed)
    print(f"wrote a random-init {args.size} model and character tokenizer to {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hybridflow",
        description="RL post-training for language models: one driver process, SPMD worker groups on Ray.",
    )
    parser.add_argument("--version", action="version", version=f"hybridflow {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    tiny = sub.add_parser("make-tiny-model", help="write a small random-init model + character tokenizer to a folder")
    tiny.add_argument("path")
    tiny.add_argument("--size", default="tiny", help="unit | tiny | small | mid")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_cmd_make_tiny_model)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
