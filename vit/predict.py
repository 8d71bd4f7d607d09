"""Use a trained checkpoint: accuracy on a dataset, or the predicted class of one image file.

    python -m vit.predict runs/demo/checkpoint                       # accuracy on its dataset's test split
    python -m vit.predict runs/demo/checkpoint --dataset digits
    python -m vit.predict runs/demo/checkpoint --image my_digit.png

Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
from typing import Optional

import torch

import vit_kernels as vk
from vit import checkpoint, cli, options
from vit.data import DATASETS, check_labels, load_dataset, normalise_with, read_image, resize
from vit.train import evaluate, pick_device


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = options.checkpoint_parser("python -m vit.predict", __doc__.split("\n\n")[0])
    parser.add_argument(
        "--dataset", default=None, choices=DATASETS, help="default: the one it was trained on"
    )
    parser.add_argument(
        "--data-path",
        type=options.existing_path,
        default=None,
        help="the data set's folder (default: the one it was trained on)",
    )
    parser.add_argument(
        "--image", type=options.existing_path, default=None, help="classify this image file instead"
    )
    parser.add_argument("--device", type=options.device, default="auto", help="auto | cpu | cuda | cuda:N")
    parser.add_argument(
        "--backend", default="auto", choices=vk.backend.CHOICES, help="vit_kernels backend for every op"
    )
    parser.add_argument(
        "--debug", action="store_true", help="full tracebacks for data-set and checkpoint errors"
    )
    cli.add_threads_option(parser)
    args = parser.parse_args(argv)
    problem = options.backend_problem(args)
    if problem:
        parser.error(problem)
    return args


@torch.no_grad()
def classify_image(model: torch.nn.Module, meta: dict, path: str, device: torch.device) -> dict:
    """Class index, label and probabilities for one image file."""
    config = model.config
    pixels = torch.from_numpy(read_image(path, config.img_size, config.in_chans)).float()[None] / 255.0
    images = normalise_with(pixels, meta["dataset"]["mean"], meta["dataset"]["std"]).to(device)
    probabilities = torch.softmax(model(images).float(), dim=-1)[0]
    index = int(probabilities.argmax())
    classes = meta["dataset"].get("classes") or []
    label = classes[index] if index < len(classes) else str(index)
    return {
        "image": path,
        "class": index,
        "label": label,
        "probabilities": [round(p, 6) for p in probabilities.tolist()],
    }


def predict(args: argparse.Namespace) -> dict:
    vk.set_backend(args.backend)
    device = pick_device(args.device)
    model, meta = checkpoint.load_model(args.checkpoint, device)
    model.eval()
    if args.image is not None:
        return classify_image(model, meta, args.image, device)
    name = args.dataset or meta["dataset"]["name"]
    if name in ("mnist", "cifar10", "folder") and args.data_path is None and name != meta["dataset"]["name"]:
        raise cli.UsageError(f"--dataset {name} needs --data-path")
    path = args.data_path or (meta["dataset"].get("path") if name == meta["dataset"]["name"] else None)
    config = model.config
    _, test = load_dataset(
        name,
        path,
        img_size=config.img_size,
        in_chans=config.in_chans,
        num_classes=config.num_classes,
        seed=meta["progress"]["args"].get("seed", 0),
    )
    test = resize(test, config.img_size)
    shape, expected = tuple(test.images.shape[1:]), (config.in_chans, config.img_size, config.img_size)
    if shape != expected:
        raise cli.UsageError(f"--dataset {name} gives images {shape}, but the model expects {expected}")
    check_labels(test, config.num_classes)
    result = evaluate(model, test, device, "auto")
    return {
        "checkpoint": args.checkpoint,
        "dataset": name,
        "images": len(test),
        "accuracy": result.accuracy,
        "loss": result.loss,
    }


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    cli.set_threads(args.threads)
    print(json.dumps(cli.run("python -m vit.predict", lambda: predict(args), args.debug)), flush=True)


if __name__ == "__main__":
    main()
