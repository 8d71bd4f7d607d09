"""Options of ``python -m vit.train``: each checked by argparse (finite, in range, an existing or
creatable path, an available device), so a bad value ends with one line and exit code 2.

``--resume PATH`` alone continues a run: every training option comes from the checkpoint; given
again, an option that would change the run's course (model, data, schedule, seed, ...) must match
it, while those that do not (``--epochs`` up, ``--out``, ``--device``, checkpointing, ...) may change.

A run folder that holds a run is never trained into afresh: that needs ``--resume`` (continue it),
``--overwrite`` (replace it, on purpose) or another ``--out``. The backend is checked here too, so
that every mistake ends before any work is done.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys
from pathlib import Path
from typing import Callable, Optional

import torch

import vit_kernels as vk
from vit import cli, distributed
from vit.data import DATASETS
from vit.model import list_models

# Options a resumed run may change; every other one is part of the run's course.
CHANGEABLE_ON_RESUME = {
    "epochs",
    "out",
    "resume",
    "device",
    "backend",
    "no_progress",
    "debug",
    "checkpoint_every",
    "keep",
    "stop_at_step",
    "eval_every",
    "distributed",
    "dist_timeout",
    "data_path",
    "threads",
    "overwrite",
    "resume_fallback",
}
# Options that describe this launch, not the run: never taken from the checkpoint.
LAUNCH_OPTIONS = {
    "resume",
    "stop_at_step",
    "out",
    "device",
    "distributed",
    "debug",
    "no_progress",
    "threads",
    "overwrite",
    "resume_fallback",
}
_INTERVAL = re.compile(r"^(\d+)\s*(steps?|epochs?)?$")


def _number(kind: type, low: float, high: float, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite ``kind`` in [low, high] ((low, high] if ``low_open``)."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected {'an integer' if kind is int else 'a number'}, got {text!r}"
            ) from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be finite, got {text!r}")
        if value < low or value > high or (low_open and value == low):
            raise argparse.ArgumentTypeError(
                f"must be in {'(' if low_open else '['}{low:g}, {high:g}], got {text!r}"
            )
        return value

    return parse


def interval(text: str) -> tuple[int, str]:
    """``N``, ``Nepochs`` or ``Nsteps`` -> (N, "epochs" | "steps")."""
    match = _INTERVAL.match(text.strip().lower())
    if not match or int(match.group(1)) <= 0:
        raise argparse.ArgumentTypeError(
            f"expected a positive count of epochs or steps such as 2, 2epochs or 500steps, got {text!r}"
        )
    unit = "steps" if (match.group(2) or "").startswith("step") else "epochs"
    return int(match.group(1)), unit


def device(text: str) -> str:
    if text == "auto":
        return text
    try:
        parsed = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}") from None
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise argparse.ArgumentTypeError(f"{text!r}: CUDA is not available on this machine")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise argparse.ArgumentTypeError(
                f"{text!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif parsed.type != "cpu":
        raise argparse.ArgumentTypeError(f"expected auto, cpu, cuda or cuda:N, got {text!r}")
    return text


def existing_path(text: str) -> str:
    if not Path(text).expanduser().exists():
        raise argparse.ArgumentTypeError(f"{text!r} does not exist")
    return str(Path(text).expanduser().resolve())


def creatable_folder(text: str) -> str:
    path = Path(text).expanduser()
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} exists and is not a folder")
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(
            f"{text!r} cannot be created: {str(parent)!r} is not a writable folder"
        )
    return str(path)


def checkpoint_path(text: str) -> str:
    from vit.checkpoint import CheckpointError, resolve

    try:
        return str(resolve(Path(text).expanduser()))
    except CheckpointError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def checkpoint_parser(prog: str, description: str) -> argparse.ArgumentParser:
    """A parser for ``prog`` (one error line, exit code 2) that takes a checkpoint folder written by
    ``python -m vit.train`` (or its run folder) as its first argument, resolved by checkpoint_path."""
    parser = cli.OneLineErrors(prog=prog, description=description)
    parser.add_argument(
        "checkpoint",
        type=checkpoint_path,
        help="checkpoint folder written by python -m vit.train (or its run folder)",
    )
    return parser


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = cli.OneLineErrors(prog="python -m vit.train", description=description)
    add = parser.add_argument
    add("--model", default="vit_digits", choices=list_models(), help="preset name")
    add(
        "--num-classes",
        type=_number(int, 1, 1_000_000),
        default=None,
        help="classifier size (default: the dataset's class count)",
    )
    add(
        "--img-size",
        type=_number(int, 1, 8192),
        default=None,
        help="the model's image side (default: the preset's); the data set's images are resized to it",
    )
    add("--dataset", default="digits", choices=DATASETS, help="where the images come from")
    add(
        "--data-path", type=existing_path, default=None, help="folder of the dataset (mnist, cifar10, folder)"
    )
    add("--epochs", type=_number(int, 1, 1_000_000), default=60, help="passes over the training split")
    add("--batch-size", type=_number(int, 1, 1 << 24), default=64, help="global batch (split over processes)")
    add("--lr", type=_number(float, 0.0, 10.0, low_open=True), default=2e-3, help="peak learning rate")
    add(
        "--min-lr",
        type=_number(float, 0.0, 10.0),
        default=1e-5,
        help="learning rate at the end of the cosine (<= --lr)",
    )
    add(
        "--weight-decay",
        type=_number(float, 0.0, 10.0),
        default=0.05,
        help="AdamW decay of the weight matrices",
    )
    add("--warmup-epochs", type=_number(float, 0.0, 1_000_000.0), default=3.0, help="linear warm-up")
    add("--label-smoothing", type=_number(float, 0.0, 0.999), default=0.1)
    add(
        "--shift",
        type=_number(int, 0, 8192),
        default=1,
        help="random translation in pixels, below the image size (0 disables)",
    )
    add("--no-augment", action="store_true", help="no shift and no flip")
    add(
        "--amp",
        choices=("auto", "bf16", "fp16", "off"),
        default="auto",
        help="auto = bf16 on CUDA only; fp16 uses a gradient scaler",
    )
    add("--device", type=device, default="auto", help="auto | cpu | cuda | cuda:N")
    add("--backend", default="auto", choices=vk.backend.CHOICES, help="vit_kernels backend for every op")
    add(
        "--seed",
        type=_number(int, 0, 2**62),
        default=0,
        help="fixes initialisation, order, augmentation and dropout",
    )
    add(
        "--out",
        type=creatable_folder,
        default=None,
        help="run folder for metrics and checkpoints (default runs/<model>-<dataset>)",
    )
    add(
        "--resume",
        type=checkpoint_path,
        default=None,
        help="checkpoint (or run folder) to continue from; its options are the defaults",
    )
    add(
        "--resume-fallback",
        action="store_true",
        help="with --resume of a run folder whose latest checkpoint is damaged: continue from its newest intact one",
    )
    add(
        "--overwrite",
        action="store_true",
        help="replace the run --out already holds (its checkpoints and metrics)",
    )
    add(
        "--eval-every",
        type=_number(int, 1, 1_000_000),
        default=1,
        help="evaluate every N epochs (and after the last)",
    )
    add(
        "--checkpoint-every",
        type=interval,
        action="append",
        default=None,
        metavar="N[epochs|steps]",
        help="save a checkpoint every N epochs and/or steps (repeat for both; default 1epochs); also at the end, "
        "at a new best test accuracy and on SIGTERM/SIGINT",
    )
    add(
        "--keep",
        type=_number(int, 1, 1_000_000),
        default=2,
        help="how many latest checkpoints to keep (plus the best)",
    )
    add(
        "--stop-at-step",
        type=_number(int, 1, 1 << 62),
        default=None,
        help="save and stop once this global step is done",
    )
    add(
        "--distributed",
        choices=distributed.MODES,
        default="none",
        help="ddp or fsdp, under torchrun --nproc_per_node N",
    )
    add(
        "--dist-timeout",
        type=_number(float, 1.0, 86_400.0),
        default=300.0,
        help="seconds before a stalled collective fails",
    )
    add("--no-progress", action="store_true", help="no progress bar")
    add("--debug", action="store_true", help="full tracebacks for data-set and checkpoint errors")
    cli.add_threads_option(parser)
    return parser


def run_folder(args: argparse.Namespace) -> Path:
    """Where the run's metrics and checkpoints go: --out, else the resumed checkpoint's run folder,
    else runs/<model>-<dataset>."""
    if args.out:
        return Path(args.out)
    if args.resume:
        from vit.checkpoint import run_folder_of

        return run_folder_of(args.resume)
    return Path(f"runs/{args.model}-{args.dataset}")


def _resumable(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    """The metadata of the checkpoint to resume (its files verified); with --resume-fallback, that of
    the newest intact checkpoint of its run when the one named is damaged."""
    from vit.checkpoint import CheckpointError, RunFolder, read_meta, run_folder_of

    try:
        return read_meta(args.resume)
    except CheckpointError as error:
        if not args.resume_fallback:
            parser.error(
                f"--resume {args.resume}: {error}; --resume-fallback continues from the newest intact "
                "checkpoint of its run instead (or name an older checkpoint folder)"
            )
        intact = RunFolder(run_folder_of(args.resume)).newest_intact(at_most=args.resume)
        if intact is None:
            parser.error(
                f"--resume {args.resume}: {error}, and its run holds no intact checkpoint to fall back to"
            )
        print(f"python -m vit.train: {error}; falling back to {intact}", file=sys.stderr, flush=True)
        args.resume = str(intact)
        return read_meta(intact)


def backend_problem(args: argparse.Namespace) -> Optional[str]:
    if args.backend == "auto":
        return None
    reason = vk.backend.backend_unavailable_reason(args.backend)
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if reason is None and args.backend == "triton" and on_cpu and not vk.backend.TRITON_INTERPRET:
        reason = "Triton kernels run on CUDA devices (or on the CPU under TRITON_INTERPRET=1); the device is the CPU"
    return None if reason is None else f"--backend {args.backend} cannot run here: {reason}"


def _explicit(parser: argparse.ArgumentParser, argv: Optional[list[str]]) -> set[str]:
    """The options given on the command line (not defaulted)."""
    unset = object()
    # an append action extends its default, so it is told apart by being non-empty instead
    probe = argparse.Namespace(
        **{dest: unset for dest in vars(parser.parse_args([])) if dest != "checkpoint_every"}
    )
    parsed = vars(parser.parse_args(argv, probe))
    return {
        dest for dest, value in parsed.items() if value is not unset and (dest != "checkpoint_every" or value)
    }


def parse(argv: Optional[list[str]], description: str) -> argparse.Namespace:
    """Parse and validate; with ``--resume``, the checkpoint's options fill in what is not given."""
    parser = build_parser(description)
    args = parser.parse_args(argv)
    if args.resume_fallback and not args.resume:
        parser.error("--resume-fallback goes with --resume")
    if args.overwrite and args.resume:
        parser.error("--overwrite replaces a run and --resume continues one: give one of them")
    if args.resume:
        try:
            saved = _resumable(parser, args)["progress"]["args"]
        except (KeyError, TypeError) as error:
            parser.error(f"--resume {args.resume}: the checkpoint records no training options ({error})")
        explicit = _explicit(parser, argv)
        for name in sorted(explicit - CHANGEABLE_ON_RESUME):
            if name in saved and getattr(args, name) != saved[name]:
                parser.error(
                    f"--{name.replace('_', '-')} {getattr(args, name)} differs from the resumed run's {saved[name]}; "
                    "a resumed run keeps its course (start a new run to change it)"
                )
        for name, value in saved.items():
            if name not in explicit and name in vars(args) and name not in LAUNCH_OPTIONS:
                setattr(args, name, value)
    args.checkpoint_every = [tuple(item) for item in args.checkpoint_every or [(1, "epochs")]]
    if args.min_lr > args.lr:
        parser.error(f"--min-lr {args.min_lr} must not exceed --lr {args.lr}")
    if args.dataset in ("mnist", "cifar10", "folder") and args.data_path is None:
        parser.error(f"--dataset {args.dataset} needs --data-path")
    if args.distributed == "fsdp" and args.amp == "fp16":
        parser.error("--amp fp16 is not supported with --distributed fsdp (use bf16)")
    problem = backend_problem(args)  # after --resume filled in the run's own backend
    if problem:
        parser.error(problem)
    _refuse_to_replace_a_run(parser, args)
    return args


def _refuse_to_replace_a_run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    from vit.checkpoint import RunFolder, run_folder_of

    out = run_folder(args)
    if args.overwrite or not RunFolder(out).holds_run():
        return
    if args.resume:
        if run_folder_of(args.resume).resolve() == out.resolve():
            return
        parser.error(
            f"--out {out} already holds another run; resuming {args.resume} there would mix the two runs "
            "(choose a new --out)"
        )
    parser.error(
        f"{out} already holds a run; continue it with --resume {out}, replace it with --overwrite, "
        "or choose a new --out"
    )
