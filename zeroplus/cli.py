"""The ``zeroplus`` command: ``run`` (launch ranks), ``train`` (the main job), ``convert`` (export),
``estimate`` (each rank's predicted memory before launching)."""
from __future__ import annotations

import argparse
import os
import sys

from .budget.command import main as estimate_main
from .engine.checkpoints.dcp_export import export_dcp
from .engine.checkpoints.deepspeed_import import convert_deepspeed
from .engine.checkpoints.export import load_fp32_state_dict, write_state_dict
from .engine.checkpoints.hf_export import export_checkpoint
from .launcher import run, torchrun_command
from .train_job import main as train_main


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, train = _parser()
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    command, rest = argv[0], argv[1:]
    if command == "run":
        try:
            return run(rest)
        except ValueError as err:
            print(f"zeroplus run: {err}", file=sys.stderr)
            return 2
    if command == "estimate":
        return estimate_main(rest)
    if command == "convert":
        return _convert(parser.parse_args(argv))
    if command == "train":
        return _train(train, rest)
    parser.error(f"unknown command {command!r}; use run, train, convert or estimate")
    return 2


def _parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    """The command line's parser, and its ``train`` subcommand's (which passes what it does not know on)."""
    parser = argparse.ArgumentParser(prog="zeroplus", description="memory-first ZeRO training for PyTorch")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("run", help="launch N local ranks of a script through torchrun: zeroplus run -n N script.py",
                   add_help=False)
    train = sub.add_parser("train", help="train the built-in byte-level GPT (the main job)", add_help=False)
    convert = sub.add_parser("convert", help="checkpoint -> one fp32 state dict (.safetensors or .pt), or a Hugging "
                                             "Face model directory (--format hf)")
    convert.add_argument("checkpoint_dir")
    convert.add_argument("out", help="output file: .safetensors, .pt, .pth or .bin (with --format hf or "
                                     "--from-deepspeed: a directory)")
    convert.add_argument("--format", choices=["state-dict", "hf", "dcp"], default="state-dict",
                         help="hf: sharded safetensors + model.safetensors.index.json + config.json, what "
                              "from_pretrained reads; dcp: a torch.distributed.checkpoint with the model and "
                              "AdamW states as FSDP2's get_state_dict names them")
    convert.add_argument("--dtype", choices=["fp32", "bf16", "fp16"], default="fp32", help="--format hf: values in")
    convert.add_argument("--max-shard-size", default="5GB", help="--format hf: bytes per file (5GB, 500MB, ...)")
    convert.add_argument("--from-deepspeed", action="store_true",
                         help="CHECKPOINT_DIR is a DeepSpeed ZeRO-1/2/3 checkpoint: write a zeroplus checkpoint to OUT")
    convert.add_argument("--tag", default=None, help="checkpoint tag (default: the one in CHECKPOINT_DIR/latest)")
    sub.add_parser("estimate", help="each rank's predicted memory for a model, config and world size (no launch)",
                   add_help=False)
    train.add_argument("-n", "--nproc", type=int, default=2)
    return parser, train


def _convert(args: argparse.Namespace) -> int:
    """``zeroplus convert``: a checkpoint into one state dict, a Hugging Face directory, a DCP checkpoint, or a
    DeepSpeed checkpoint into a zeroplus one; 2 with the error on stderr when it cannot."""
    if args.from_deepspeed:
        try:
            path = convert_deepspeed(args.checkpoint_dir, args.out, args.tag)
        except (FileNotFoundError, ValueError, NotImplementedError) as err:
            print(f"zeroplus convert: {err}", file=sys.stderr)
            return 2
        print(f"wrote zeroplus checkpoint {path}")
        return 0
    if args.format == "dcp":
        try:
            count = export_dcp(args.checkpoint_dir, args.out, args.tag)
        except (FileNotFoundError, ValueError) as err:
            print(f"zeroplus convert: {err}", file=sys.stderr)
            return 2
        print(f"wrote {args.out}: a torch.distributed.checkpoint of {count} model tensors and their optimizer "
              f"states")
        return 0
    if args.format == "hf":
        try:
            names, peak = export_checkpoint(args.checkpoint_dir, args.out, args.tag, args.dtype,
                                            args.max_shard_size)
        except (FileNotFoundError, ValueError) as err:
            print(f"zeroplus convert: {err}", file=sys.stderr)
            return 2
        print(f"wrote {args.out}: {len(names)} file(s) ({args.dtype}), at most {peak:,} tensor bytes held")
        return 0
    try:
        state = load_fp32_state_dict(args.checkpoint_dir, args.tag)
        write_state_dict(state, args.out)
    except (FileNotFoundError, ValueError) as err:
        print(f"zeroplus convert: {err}", file=sys.stderr)
        return 2
    total = sum(t.numel() for t in state.values())
    print(f"wrote {args.out}: {len(state)} tensors, {total:,} elements (fp32)")
    return 0


def _train(train: argparse.ArgumentParser, rest: list[str]) -> int:
    """``zeroplus train``: the main job, on every rank of a torchrun it starts (or here, under a launcher)."""
    known, passthrough = train.parse_known_args(rest)
    if "RANK" in os.environ:  # already under a launcher
        train_main(passthrough)
        return 0
    cmd = torchrun_command(known.nproc, [], ["-m", "zeroplus.train_job", *passthrough])
    # torchrun's -m runs a module; it must come before the module name, not as a flag value.
    cmd = cmd[:cmd.index("-m", 3)] + ["--module", "zeroplus.train_job"] + passthrough
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // known.nproc)))
    import subprocess
    return subprocess.call(cmd, env=env)


if __name__ == "__main__":
    sys.exit(main())
