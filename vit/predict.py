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
from vit import checkpoint
from vit.data import DATASETS, check_labels, load_dataset, normalise_with, read_image, resize
from vit.train import evaluate, pick_device


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m vit.predict", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="checkpoint folder written by python -m vit.train (or its run folder)")
    parser.add_argument("--dataset", default=None, choices=DATASETS, help="default: the one it was trained on")
    parser.add_argument("--data-path", default=None)
    parser.add_argument("--image", default=None, help="classify this image file instead")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--backend", default="auto", choices=vk.backend.CHOICES)
    return parser.parse_args(argv)


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
    return {"image": path, "class": index, "label": label, "probabilities": [round(p, 6) for p in probabilities.tolist()]}


def predict(args: argparse.Namespace) -> dict:
    vk.set_backend(args.backend)
    device = pick_device(args.device)
    model, meta = checkpoint.load_model(args.checkpoint, device)
    model.eval()
    if args.image is not None:
        return classify_image(model, meta, args.image, device)
    name = args.dataset or meta["dataset"]["name"]
    path = args.data_path or (meta["dataset"].get("path") if name == meta["dataset"]["name"] else None)
    config = model.config
    _, test = load_dataset(
        name, path, img_size=config.img_size, in_chans=config.in_chans, num_classes=config.num_classes,
        seed=meta["progress"]["args"].get("seed", 0),
    )
    test = resize(test, config.img_size)
    check_labels(test, config.num_classes)
    result = evaluate(model, test, device, "auto")
    return {"checkpoint": args.checkpoint, "dataset": name, "images": len(test), "accuracy": result.accuracy, "loss": result.loss}


def main(argv: Optional[list[str]] = None) -> None:
    print(json.dumps(predict(parse_args(argv))), flush=True)


if __name__ == "__main__":
    main()
