"""Train a ViT preset on a local dataset.

    python -m vit.train --model vit_digits --dataset digits --epochs 60
    python -m vit.train --model vit_cifar10_small --dataset cifar10 --data-path ~/data/cifar-10-batches-py
    python -m vit.train --resume runs/vit_digits-digits/checkpoint            # continue, exactly
    torchrun --nproc_per_node 2 -m vit.train --distributed ddp ...            # or fsdp

AdamW with linear warm-up then cosine decay, label smoothing, random-shift (and, where labels allow,
flip) augmentation, bf16 autocast on CUDA. Writes metrics.csv / metrics.json and atomic safetensors
checkpoints under --out (every --checkpoint-every, at a new best, at the end, on SIGTERM/SIGINT),
and ends by printing one JSON line with the results.

Every step is a function of (seed, epoch, step): the epoch's shuffle, the step's augmentation and,
through the saved RNG state, dropout. So a run resumed from any of its checkpoints ends with the
weights an uninterrupted run reaches.
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import hashlib
import io
import json
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

import vit_kernels as vk
from vit_kernels._files import write_atomically
from vit import checkpoint, cli, distributed, options
from vit.cli import UsageError
from vit.data import ImageData, augment, check_labels, load_dataset, resize
from vit.model import ViT, ViTConfig, get_config

DESCRIPTION = __doc__.split("\n\n")[0]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    return options.parse(argv, DESCRIPTION)


def learning_rate(step: int, total_steps: int, warmup_steps: int, peak: float, floor: float) -> float:
    """Linear warm-up from 0 to ``peak`` over ``warmup_steps``, then cosine down to ``floor``."""
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    return floor + 0.5 * (peak - floor) * (1.0 + math.cos(math.pi * min(1.0, progress)))


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit(f"--device {name}: CUDA is not available on this machine")
    return device


def autocast_for(device: torch.device, amp: str) -> torch.autocast:
    dtype = torch.float16 if amp == "fp16" else torch.bfloat16
    enabled = amp in ("bf16", "fp16") or (amp == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=dtype, enabled=enabled)


def epoch_order(size: int, seed: int, epoch: int) -> torch.Tensor:
    """The training set's order in ``epoch``: a permutation (size,) fixed by (seed, epoch)."""
    return torch.randperm(size, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))


def step_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """The generator of step ``index`` of ``epoch``'s augmentation, fixed by (seed, epoch, index)."""
    return torch.Generator().manual_seed((seed * 1_000_003 + epoch) * 1_000_003 + index + 1)


@dataclass
class Evaluation:
    loss: float
    accuracy: float


@torch.no_grad()
def evaluate(
    model: torch.nn.Module, data: ImageData, device: torch.device, amp: str, batch_size: int = 512
) -> Evaluation:
    """Mean cross-entropy and accuracy of ``model`` over ``data``."""
    was_training = model.training
    model.eval()
    total_loss, correct = 0.0, 0
    for start in range(0, len(data), batch_size):
        images = data.images[start : start + batch_size].to(device, non_blocking=True)
        labels = data.labels[start : start + batch_size].to(device, non_blocking=True)
        with autocast_for(device, amp):
            logits = model(images)
        total_loss += F.cross_entropy(logits.float(), labels, reduction="sum").item()
        correct += (logits.argmax(dim=1) == labels).sum().item()
    model.train(was_training)
    return Evaluation(total_loss / len(data), correct / len(data))


class MetricsLog:
    """One row per evaluated epoch, rewritten (atomically) to metrics.csv and metrics.json as it grows."""

    def __init__(self, folder: Path, rows: Optional[list[dict]] = None, enabled: bool = True) -> None:
        self.folder, self.rows, self.enabled = folder, list(rows or []), enabled

    def append(self, row: dict) -> None:
        self.rows.append(row)
        if not self.enabled:
            return
        write_atomically(self.folder / "metrics.json", json.dumps(self.rows, indent=2))
        table = io.StringIO()
        writer = csv.DictWriter(table, fieldnames=list(self.rows[-1]))
        writer.writeheader()
        writer.writerows(self.rows)
        write_atomically(self.folder / "metrics.csv", table.getvalue())


class StopSignal:
    """Turns the first SIGTERM / SIGINT into a request to checkpoint and stop at the next step
    boundary; a second one acts as usual (checkpoints are atomic, so that is safe too)."""

    def __init__(self) -> None:
        self.received: Optional[int] = None
        self._previous: dict[int, object] = {}

    def __enter__(self) -> "StopSignal":
        for number in (signal.SIGTERM, signal.SIGINT):
            self._previous[number] = signal.signal(number, self._handle)
        return self

    def _handle(self, number: int, frame) -> None:
        self.received = number
        signal.signal(number, self._previous[number])

    def __exit__(self, *exc) -> None:
        for number, handler in self._previous.items():
            signal.signal(number, handler)


def _progress_bar(total: int, initial: int, disable: bool):
    from tqdm import tqdm

    return tqdm(
        total=total,
        initial=initial,
        disable=disable,
        unit="step",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=1.0,
    )


def _log(message: str, context: distributed.Context) -> None:
    if context.is_main:
        print(f"vit.train: {message}", file=sys.stderr, flush=True)


def split_fingerprint(data: ImageData) -> str:
    """sha256 of a split's labels, in order, and its images' shape: test accuracies compare only on
    the same split. Not of the pixels: they are normalised with float32 statistics whose last bits
    depend on the thread count and the CPU's vector width."""
    digest = hashlib.sha256(repr(tuple(data.images.shape)).encode())
    digest.update(data.labels.contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()[:16]


def _first_non_finite(bad_step: torch.Tensor, context: distributed.Context, device: torch.device) -> None:
    """Stop (exit 2 through UsageError) once any process saw a non-finite training loss; ``bad_step``
    holds the first such step (or -1). Nothing is saved after it, so every link keeps pointing at
    a checkpoint with finite metrics."""
    first = int(bad_step.item())
    if distributed.any_true(first >= 0, context, device):
        at = f"step {first}" if first >= 0 else "a step of another process"
        raise UsageError(
            f"the training loss is not finite at {at}; nothing after it was saved "
            "(lower --lr, use --amp bf16 or off, and --resume from the last checkpoint)"
        )


def _model_config(args: argparse.Namespace, meta: Optional[dict], train_classes: int) -> ViTConfig:
    if meta is not None:
        return ViTConfig(**meta["config"])
    overrides = {"num_classes": args.num_classes or train_classes}
    if args.img_size is not None:
        overrides["img_size"] = args.img_size
    try:
        return get_config(args.model, **overrides)
    except ValueError as error:
        raise UsageError(f"--model {args.model} with {overrides}: {error}") from error


def _load_data(args: argparse.Namespace, meta: Optional[dict]) -> tuple[ImageData, ImageData, ViTConfig]:
    preset = ViTConfig(**meta["config"]) if meta else get_config(args.model)
    img_size = args.img_size or preset.img_size
    train_data, test_data = load_dataset(
        args.dataset,
        args.data_path,
        img_size=img_size,
        in_chans=preset.in_chans,
        num_classes=args.num_classes or preset.num_classes,
        seed=args.seed,
    )
    config = _model_config(args, meta, train_data.num_classes)
    if args.img_size is not None or meta is not None and meta["progress"]["args"].get("img_size") is not None:
        train_data, test_data = resize(train_data, config.img_size), resize(test_data, config.img_size)
    shape = tuple(train_data.images.shape[1:])
    if shape != (config.in_chans, config.img_size, config.img_size):
        raise UsageError(
            f"dataset {args.dataset!r} gives images {shape}, but model {args.model!r} expects "
            f"({config.in_chans}, {config.img_size}, {config.img_size}); --img-size {shape[-1]} resizes the model's input"
        )
    if not 0 <= args.shift < config.img_size:
        raise UsageError(f"--shift {args.shift} must be below the image size {config.img_size}")
    for data in (train_data, test_data):
        check_labels(data, config.num_classes)
    return train_data, test_data, config


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on biases, norms, class token and position embedding (as timm does)."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        is_matrix = param.ndim >= 2 and "pos_embed" not in name and "cls_token" not in name
        (decay if is_matrix else no_decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _rng_state(device: torch.device) -> dict[str, torch.Tensor]:
    state = {"rng.cpu": torch.get_rng_state()}
    if device.type == "cuda":
        state["rng.cuda"] = torch.cuda.get_rng_state(device)
    return state


def _set_rng_state(state: dict[str, torch.Tensor], device: torch.device) -> None:
    torch.set_rng_state(state["rng.cpu"])
    if device.type == "cuda" and "rng.cuda" in state:
        torch.cuda.set_rng_state(state["rng.cuda"], device)


def train(args: argparse.Namespace) -> dict:
    """Run the training described by ``args``; returns the summary printed as the final JSON line."""
    context, device = distributed.setup(args.distributed, args.device, args.dist_timeout)
    try:
        return _train(args, context, device)
    except RuntimeError as error:
        if distributed.is_peer_failure(error, context):  # e.g. raised in DDP's gradient all-reduce
            raise distributed.PeerLost(str(error).splitlines()[0]) from error
        raise
    finally:
        distributed.teardown(context)


def _train(args: argparse.Namespace, context: distributed.Context, device: torch.device) -> dict:
    torch.manual_seed(args.seed)
    vk.set_backend(args.backend)
    out = options.run_folder(args)
    meta = checkpoint.read_meta(args.resume) if args.resume else None
    train_data, test_data, config = _load_data(args, meta)
    test_split = split_fingerprint(test_data)
    recorded_split = meta["dataset"].get("test_split") if meta else None
    if recorded_split not in (None, test_split):
        raise UsageError(
            f"the test split of --dataset {args.dataset} differs from the one {args.resume} was evaluated "
            "on (other files behind --data-path?): its accuracies would not compare"
        )
    model = ViT(config).to(device)
    progress = meta["progress"] if meta else {"step": 0, "history": [], "best_accuracy": None}

    steps_per_epoch = math.ceil(len(train_data) / args.batch_size)
    total_steps = args.epochs * steps_per_epoch
    start_step = progress["step"]
    if meta and start_step > total_steps:
        raise UsageError(
            f"--epochs {args.epochs} is fewer than the {start_step / steps_per_epoch:g} epochs the checkpoint "
            f"{args.resume} has done; pass --epochs {math.ceil(start_step / steps_per_epoch)} or more"
        )
    if (
        meta
        and start_step % steps_per_epoch
        and meta["progress"].get("steps_per_epoch") not in (None, steps_per_epoch)
    ):
        raise UsageError(f"the data set behind {args.resume} changed size: it cannot resume mid-epoch")

    trained = distributed.wrap(model, context, device)
    optimizer = torch.optim.AdamW(_param_groups(model, args.weight_decay), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")
    if meta:
        folder = meta["folder"]
        distributed.load_full_state(
            trained,
            optimizer,
            checkpoint.load_tensors(folder, checkpoint.MODEL_FILE),
            checkpoint.load_optimizer_state(folder, meta),
            context,
        )
        _set_rng_state(checkpoint.load_tensors(folder, checkpoint.STATE_FILE), device)
        if progress.get("scaler"):
            scaler.load_state_dict(progress["scaler"])
        _log(f"resuming {folder} at epoch {start_step // steps_per_epoch}, step {start_step}", context)

    store = checkpoint.RunFolder(out, keep=args.keep)
    if context.is_main:
        out.mkdir(parents=True, exist_ok=True)
        store.clean_leftovers()
        if args.overwrite and not args.resume:
            store.erase()
    distributed.barrier(context)
    warmup_steps = int(args.warmup_epochs * steps_per_epoch)
    train_images, train_labels = train_data.images.to(device), train_data.labels.to(device)
    log = MetricsLog(out, progress["history"], enabled=context.is_main)
    shift = 0 if args.no_augment else args.shift
    flip = train_data.flip_ok and not args.no_augment
    every = {unit: count for count, unit in args.checkpoint_every}
    dataset_info = {
        "name": args.dataset,
        "path": args.data_path,
        "classes": train_data.classes,
        "mean": train_data.mean,
        "std": train_data.std,
        "test_split": test_split,
    }
    saved_args = {k: v for k, v in vars(args).items() if k not in ("resume", "stop_at_step")}
    best_accuracy = progress.get("best_accuracy")
    partial = progress.get("partial_epoch") or {"loss_sum": 0.0, "correct": 0.0, "seconds": 0.0}
    last_saved = start_step if meta else -1
    bad_step = torch.full((), -1, dtype=torch.int64, device=device)  # the first step with a non-finite loss
    check_every_step = (
        device.type == "cpu" and not context.active
    )  # elsewhere a read costs a sync or a collective

    def save(
        step: int, sums: torch.Tensor, seconds: float, best: bool, evaluation: Optional[Evaluation] = None
    ) -> None:
        nonlocal last_saved
        _first_non_finite(bad_step, context, device)
        model_state, optimizer_state = distributed.full_state(trained, optimizer, context)
        sums = distributed.all_sum(sums, context)
        if context.is_main:
            state = {
                "step": step,
                "epoch": step / steps_per_epoch,
                "steps_per_epoch": steps_per_epoch,
                "history": log.rows,
                "best_accuracy": best_accuracy,
                "args": saved_args,
                "scaler": scaler.state_dict() if scaler.is_enabled() else None,
                "partial_epoch": {"loss_sum": sums[0].item(), "correct": sums[1].item(), "seconds": seconds},
            }
            meta = {
                "model": args.model,
                "config": dataclasses.asdict(config),
                "dataset": dataset_info,
                "progress": state,
            }
            if evaluation is not None:
                meta["evaluation"] = {
                    "test_accuracy": evaluation.accuracy,
                    "test_loss": evaluation.loss,
                    "split": test_split,
                }
            written = store.save(
                epoch=step // steps_per_epoch,
                step=step,
                best=best,
                final=step == total_steps,
                model_state=model_state,
                optimizer_state=optimizer_state,
                state_tensors=_rng_state(device),
                meta=meta,
            )
            _log(f"checkpoint saved: {written} (epoch {step / steps_per_epoch:g}, step {step})", context)
        distributed.barrier(context)
        last_saved = step

    train_seconds, images_seen, step = 0.0, 0, start_step
    bar = _progress_bar(total_steps, start_step, args.no_progress or not context.is_main)
    trained.train()
    with StopSignal() as stop_signal:
        for epoch in range(start_step // steps_per_epoch, args.epochs):
            order = epoch_order(len(train_data), args.seed, epoch).to(device)
            first = step - epoch * steps_per_epoch
            # loss sum and correct count over this process's images of the epoch (carried over a mid-epoch resume)
            sums = (
                torch.tensor([partial["loss_sum"], partial["correct"]], dtype=torch.float64, device=device)
                if context.is_main
                else torch.zeros(2, dtype=torch.float64, device=device)
            )
            epoch_seconds, partial = partial["seconds"], {"loss_sum": 0.0, "correct": 0.0, "seconds": 0.0}
            clock = time.perf_counter()
            for index in range(first, steps_per_epoch):
                for group in optimizer.param_groups:
                    group["lr"] = learning_rate(step, total_steps, warmup_steps, args.lr, args.min_lr)
                batch = order[index * args.batch_size : (index + 1) * args.batch_size]
                images = augment(train_images[batch], step_generator(args.seed, epoch, index), shift, flip)
                images, labels = (
                    distributed.shard(images, context),
                    distributed.shard(train_labels[batch], context),
                )
                with autocast_for(device, args.amp):
                    logits = trained(images)
                    loss_sum = F.cross_entropy(
                        logits.float(), labels, label_smoothing=args.label_smoothing, reduction="sum"
                    )
                # DDP and FSDP average gradients over processes: scaled so the step is the global batch's mean
                loss = loss_sum * (context.world / batch.shape[0])
                optimizer.zero_grad(set_to_none=True)
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
                sums += torch.stack(
                    [loss_sum.detach().double(), (logits.argmax(dim=1) == labels).sum().double()]
                )
                bad_step.masked_fill_(
                    (bad_step < 0) & ~torch.isfinite(loss_sum.detach()), step + 1
                )  # steps counted from 1
                if check_every_step:
                    _first_non_finite(bad_step, context, device)
                step += 1
                bar.update(1)
                stopping = distributed.any_true(
                    stop_signal.received is not None or step == args.stop_at_step, context, device
                )
                if stopping or ("steps" in every and step % every["steps"] == 0):
                    if device.type == "cuda":
                        torch.cuda.synchronize(device)
                    if step != last_saved and step < (epoch + 1) * steps_per_epoch:
                        save(step, sums, epoch_seconds + time.perf_counter() - clock, best=False)
                if stopping and step < (epoch + 1) * steps_per_epoch:
                    return _stopped(bar, stop_signal, step, store, context)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            seconds = time.perf_counter() - clock
            train_seconds += seconds
            epoch_seconds += seconds
            images_seen += (steps_per_epoch - first) * args.batch_size
            _first_non_finite(bad_step, context, device)
            sums = distributed.all_sum(sums, context)
            train_loss, train_acc = sums[0].item() / len(train_data), sums[1].item() / len(train_data)
            bar.set_postfix(
                epoch=epoch + 1,
                loss=f"{train_loss:.3f}",
                acc=f"{train_acc:.3f}",
                img_s=f"{len(train_data) / epoch_seconds:.0f}",
            )
            last = epoch + 1 == args.epochs
            best, test = False, None
            if last or (epoch + 1) % args.eval_every == 0:
                test = evaluate(trained, test_data, device, args.amp)
                if not math.isfinite(test.loss):
                    raise UsageError(
                        f"the test loss is not finite after epoch {epoch + 1} (step {step}); nothing after "
                        "it was saved (lower --lr, use --amp bf16 or off, and --resume from the last checkpoint)"
                    )
                best = best_accuracy is None or test.accuracy > best_accuracy
                best_accuracy = max(test.accuracy, best_accuracy or 0.0)
                log.append(
                    {
                        "epoch": epoch + 1,
                        "lr": optimizer.param_groups[0]["lr"],
                        "train_loss": train_loss,
                        "train_accuracy": train_acc,
                        "test_loss": test.loss,
                        "test_accuracy": test.accuracy,
                        "epoch_seconds": epoch_seconds,
                        "images_per_second": len(train_data) / epoch_seconds,
                    }
                )
            due = last or best or stopping or ("epochs" in every and (epoch + 1) % every["epochs"] == 0)
            if due and step != last_saved:
                save(
                    step, torch.zeros(2, dtype=torch.float64, device=device), 0.0, best=best, evaluation=test
                )
            if stopping and not last:
                return _stopped(bar, stop_signal, step, store, context)
    bar.close()

    final = evaluate(trained, test_data, device, args.amp)
    latest = store.linked(checkpoint.LATEST_LINK)
    return {
        "model": args.model,
        "dataset": args.dataset,
        "device": str(device),
        "backend": args.backend,
        "distributed": args.distributed,
        "processes": context.world,
        "epochs": args.epochs,
        "parameters": sum(p.numel() for p in model.parameters()),
        "test_accuracy": final.accuracy,
        "test_loss": final.loss,
        "train_seconds": round(train_seconds, 3),
        "images_per_second": round(images_seen / train_seconds, 1) if train_seconds > 0 else None,
        "checkpoint": str(out / checkpoint.LATEST_LINK),
        "checkpoint_folder": str(latest) if latest else None,
    }


def _stopped(
    bar, stop_signal: StopSignal, step: int, store: checkpoint.RunFolder, context: distributed.Context
) -> dict:
    bar.close()
    reason = signal.Signals(stop_signal.received).name if stop_signal.received else "--stop-at-step"
    _log(
        f"stopped by {reason} after step {step}; continue with --resume {store.root / checkpoint.LATEST_LINK}",
        context,
    )
    if stop_signal.received:
        raise SystemExit(128 + stop_signal.received)
    return {"stopped_at_step": step, "checkpoint": str(store.root / checkpoint.LATEST_LINK)}


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    cli.set_threads(args.threads)
    try:
        summary = cli.run("python -m vit.train", lambda: train(args), args.debug)
    except distributed.PeerLost as error:
        if args.debug:
            traceback.print_exc()
        print(
            f"python -m vit.train: error: rank {os.environ.get('RANK', '?')} lost contact with the other processes "
            f"({error}); the job stops. Continue from the last checkpoint with --resume.",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(1) from None
    if args.distributed == "none" or os.environ.get("RANK", "0") == "0":
        print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
