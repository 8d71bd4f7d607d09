"""Train a ViT preset on a local dataset.

    python -m vit.train --model vit_digits --dataset digits --epochs 60
    python -m vit.train --model vit_cifar10_small --dataset cifar10 --data-path ~/data/cifar-10-batches-py

AdamW with linear warm-up then cosine decay, label smoothing, random-shift (and, where labels allow,
flip) augmentation, bf16 autocast on CUDA. Writes metrics.csv / metrics.json and a safetensors
checkpoint under --out, and ends by printing one JSON line with the results.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F

import vit_kernels as vk
from vit import checkpoint
from vit.data import DATASETS, ImageData, augment, load_dataset
from vit.model import ViT, create_model, list_models


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m vit.train", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="vit_digits", choices=list_models(), help="preset name")
    parser.add_argument("--dataset", default="digits", choices=DATASETS)
    parser.add_argument("--data-path", default=None, help="folder of the dataset (mnist, cifar10, folder)")
    parser.add_argument("--epochs", type=int, default=60)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    parser.add_argument("--min-lr", type=float, default=1e-5, help="learning rate at the end of the cosine")
    parser.add_argument("--weight-decay", type=float, default=0.05)
    parser.add_argument("--warmup-epochs", type=float, default=3.0)
    parser.add_argument("--label-smoothing", type=float, default=0.1)
    parser.add_argument("--shift", type=int, default=1, help="random translation in pixels (0 disables)")
    parser.add_argument("--no-augment", action="store_true", help="no shift and no flip")
    parser.add_argument("--amp", choices=("auto", "bf16", "off"), default="auto", help="auto = bf16 on CUDA only")
    parser.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument("--backend", default="auto", choices=vk.backend.CHOICES)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="run folder for metrics and checkpoints (default runs/<model>-<dataset>)")
    parser.add_argument("--resume", default=None, help="checkpoint folder to continue from")
    parser.add_argument("--eval-every", type=int, default=1, help="evaluate every N epochs (and after the last)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(argv)
    for name in ("epochs", "batch_size", "eval_every"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0.0 <= args.label_smoothing < 1.0:
        parser.error(f"--label-smoothing must be in [0, 1), got {args.label_smoothing}")
    if args.lr <= 0 or args.min_lr < 0 or args.warmup_epochs < 0 or args.shift < 0:
        parser.error("--lr must be positive; --min-lr, --warmup-epochs and --shift non-negative")
    return args


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
    enabled = amp == "bf16" or (amp == "auto" and device.type == "cuda")
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=enabled)


@dataclass
class Evaluation:
    loss: float
    accuracy: float


@torch.no_grad()
def evaluate(model: ViT, data: ImageData, device: torch.device, amp: str, batch_size: int = 512) -> Evaluation:
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
    """One row per evaluated epoch, rewritten to metrics.csv and metrics.json as it grows."""

    def __init__(self, folder: Path, rows: Optional[list[dict]] = None) -> None:
        self.folder, self.rows = folder, list(rows or [])

    def append(self, row: dict) -> None:
        self.rows.append(row)
        self.folder.mkdir(parents=True, exist_ok=True)
        (self.folder / "metrics.json").write_text(json.dumps(self.rows, indent=2))
        with open(self.folder / "metrics.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=list(self.rows[-1]))
            writer.writeheader()
            writer.writerows(self.rows)


def _progress_bar(total: int, initial: int, disable: bool):
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, disable=disable, unit="step", file=sys.stderr, dynamic_ncols=True, mininterval=1.0)


def train(args: argparse.Namespace) -> dict:
    """Run the training described by ``args``; returns the summary printed as the final JSON line."""
    torch.manual_seed(args.seed)
    vk.set_backend(args.backend)
    device = pick_device(args.device)
    out = Path(args.out or f"runs/{args.model}-{args.dataset}")

    if args.resume:
        model, meta = checkpoint.load_model(args.resume, device)
        model_name, start_epoch = meta["model"], meta["progress"]["epoch"]
        history = meta["progress"].get("history", [])
    else:
        model = create_model(args.model).to(device)
        model_name, start_epoch, history = args.model, 0, []
    config = model.config
    train_data, test_data = load_dataset(
        args.dataset, args.data_path, img_size=config.img_size, in_chans=config.in_chans,
        num_classes=config.num_classes, seed=args.seed,
    )
    shape = tuple(train_data.images.shape[1:])
    if shape != (config.in_chans, config.img_size, config.img_size) or train_data.num_classes > config.num_classes:
        raise SystemExit(
            f"dataset {args.dataset!r} gives images {shape} and {train_data.num_classes} classes, but model "
            f"{model_name!r} expects ({config.in_chans}, {config.img_size}, {config.img_size}) and at most "
            f"{config.num_classes} classes"
        )

    # No weight decay on biases, norms, class token and position embedding (as timm does).
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        is_matrix = param.ndim >= 2 and "pos_embed" not in name and "cls_token" not in name
        (decay if is_matrix else no_decay).append(param)
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}], lr=args.lr
    )
    if args.resume:
        checkpoint.load_optimizer_state(args.resume, optimizer, meta)

    steps_per_epoch = math.ceil(len(train_data) / args.batch_size)
    total_steps = args.epochs * steps_per_epoch
    warmup_steps = int(args.warmup_epochs * steps_per_epoch)
    train_images, train_labels = train_data.images.to(device), train_data.labels.to(device)
    log = MetricsLog(out, history)
    shift = 0 if args.no_augment else args.shift
    flip = train_data.flip_ok and not args.no_augment

    train_seconds, images_seen = 0.0, 0
    bar = _progress_bar(total_steps, start_epoch * steps_per_epoch, args.no_progress)
    model.train()
    for epoch in range(start_epoch, args.epochs):
        # A generator per epoch makes shuffling and augmentation reproducible across --resume.
        generator = torch.Generator().manual_seed(args.seed * 100_003 + epoch)
        order = torch.randperm(len(train_data), generator=generator).to(device)
        epoch_start, epoch_loss, epoch_correct = time.perf_counter(), torch.zeros((), device=device), torch.zeros((), device=device)
        for index in range(steps_per_epoch):
            step = epoch * steps_per_epoch + index
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(step, total_steps, warmup_steps, args.lr, args.min_lr)
            batch = order[index * args.batch_size : (index + 1) * args.batch_size]
            images = augment(train_images[batch], generator, shift, flip)
            labels = train_labels[batch]
            with autocast_for(device, args.amp):
                logits = model(images)
                loss = F.cross_entropy(logits.float(), labels, label_smoothing=args.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            epoch_loss += loss.detach() * labels.shape[0]
            epoch_correct += (logits.argmax(dim=1) == labels).sum()
            bar.update(1)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds = time.perf_counter() - epoch_start
        train_seconds += seconds
        images_seen += len(train_data)
        train_loss, train_acc = epoch_loss.item() / len(train_data), epoch_correct.item() / len(train_data)
        bar.set_postfix(epoch=epoch + 1, loss=f"{train_loss:.3f}", acc=f"{train_acc:.3f}", img_s=f"{len(train_data) / seconds:.0f}")
        last = epoch + 1 == args.epochs
        if last or (epoch + 1) % args.eval_every == 0:
            test = evaluate(model, test_data, device, args.amp)
            log.append({
                "epoch": epoch + 1, "lr": optimizer.param_groups[0]["lr"], "train_loss": train_loss,
                "train_accuracy": train_acc, "test_loss": test.loss, "test_accuracy": test.accuracy,
                "epoch_seconds": seconds, "images_per_second": len(train_data) / seconds,
            })
    bar.close()

    final = evaluate(model, test_data, device, args.amp)
    dataset_info = {
        "name": args.dataset, "path": args.data_path, "classes": train_data.classes,
        "mean": train_data.mean, "std": train_data.std,
    }
    saved = checkpoint.save_checkpoint(
        out / "checkpoint", model, model_name=model_name, dataset=dataset_info,
        progress={"epoch": args.epochs, "history": log.rows, "args": vars(args)}, optimizer=optimizer,
    )
    return {
        "model": model_name,
        "dataset": args.dataset,
        "device": str(device),
        "backend": args.backend,
        "epochs": args.epochs,
        "parameters": sum(p.numel() for p in model.parameters()),
        "test_accuracy": final.accuracy,
        "test_loss": final.loss,
        "train_seconds": round(train_seconds, 3),
        "images_per_second": round(images_seen / train_seconds, 1) if train_seconds > 0 else None,
        "checkpoint": str(saved),
    }


def main(argv: Optional[list[str]] = None) -> None:
    summary = train(parse_args(argv))
    print(json.dumps(summary), flush=True)


if __name__ == "__main__":
    main()
