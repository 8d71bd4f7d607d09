"""Attention maps of a trained checkpoint: where the class token looks, block by block.

    python -m vit.plots runs/demo/checkpoint --index 3 --out attention.png       # a test image
    python -m vit.plots runs/demo/checkpoint --image my_digit.png --out attention.png

Draws the image, then for every block the class token's attention over the patch grid (averaged
over heads), from ``vk.attention(..., return_probs=True)``, which the fused paths of SDPA cannot give.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional

import torch

from vit import checkpoint, cli, options
from vit.data import load_dataset, normalise_with, read_image
from vit.model import ViT


def class_token_maps(model: ViT, images: torch.Tensor) -> torch.Tensor:
    """images (N, C, H, W) -> (N, depth, grid, grid): class token -> patch attention, head-averaged."""
    if not model.config.class_token:
        raise ValueError("class-token attention maps need a model with a class token")
    grid = model.config.img_size // model.config.patch_size
    with torch.no_grad():
        maps = model.attention_maps(images)  # depth x (N, heads, T, T)
    return torch.stack([m[:, :, 0, 1:].mean(dim=1) for m in maps], dim=1).reshape(
        images.shape[0], -1, grid, grid
    )


def plot_attention(image: torch.Tensor, maps: torch.Tensor, out: str | Path, title: str = "") -> Path:
    """image (C, H, W) in [0, 1], maps (depth, grid, grid) -> a PNG with the image and one panel per block."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    depth = maps.shape[0]
    fig, axes = plt.subplots(1, depth + 1, figsize=(2.2 * (depth + 1), 2.4))
    shown = image[0] if image.shape[0] == 1 else image.permute(1, 2, 0)
    axes[0].imshow(shown.float().clamp(0, 1).numpy(), cmap="gray" if image.shape[0] == 1 else None)
    axes[0].set_title(title or "image")
    for block in range(depth):
        axes[block + 1].imshow(maps[block].float().numpy(), cmap="viridis")
        axes[block + 1].set_title(f"block {block + 1}")
    for axis in axes:
        axis.axis("off")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def main(argv: Optional[list[str]] = None) -> None:
    parser = options.checkpoint_parser("python -m vit.plots", __doc__.split("\n\n")[0])
    parser.add_argument(
        "--image",
        type=options.existing_path,
        default=None,
        help="an image file; default: a test image of the checkpoint's dataset",
    )
    parser.add_argument("--index", type=int, default=0, help="which test image")
    parser.add_argument(
        "--data-path",
        type=options.existing_path,
        default=None,
        help="the data set's folder (default: the one it was trained on)",
    )
    parser.add_argument("--out", type=_png_path, default="attention.png", help="the PNG to write")
    parser.add_argument(
        "--debug", action="store_true", help="full tracebacks for data-set and checkpoint errors"
    )
    cli.add_threads_option(parser)
    args = parser.parse_args(argv)
    cli.set_threads(args.threads)
    result = cli.run("python -m vit.plots", lambda: _plot(parser, args), args.debug)
    print(json.dumps(result), flush=True)


def _png_path(text: str) -> str:
    path = Path(text).expanduser()
    if path.suffix.lower() != ".png":
        raise argparse.ArgumentTypeError(f"expected a .png file name, got {text!r}")
    if not path.parent.expanduser().resolve().is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: the folder {str(path.parent)!r} does not exist")
    return str(path)


def _plot(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict:
    model, meta = checkpoint.load_model(args.checkpoint)
    model.eval()
    config, stats = model.config, meta["dataset"]
    if args.image is not None:
        pixels = (
            torch.from_numpy(read_image(args.image, config.img_size, config.in_chans)).float()[None] / 255.0
        )
        images = normalise_with(pixels, stats["mean"], stats["std"])
        title = Path(args.image).name
    else:
        _, test = load_dataset(
            stats["name"],
            args.data_path or stats.get("path"),
            img_size=config.img_size,
            in_chans=config.in_chans,
            num_classes=config.num_classes,
        )
        if not 0 <= args.index < len(test):
            parser.error(f"--index must be in [0, {len(test)}), got {args.index}")
        images = test.images[args.index : args.index + 1]
        title = f"label {stats['classes'][int(test.labels[args.index])]}"
    shown = images[0] * torch.tensor(stats["std"]).view(-1, 1, 1) + torch.tensor(stats["mean"]).view(-1, 1, 1)
    maps = class_token_maps(model, images)[0]
    path = plot_attention(shown, maps, args.out, title)
    return {"plot": str(path), "blocks": maps.shape[0], "grid": list(maps.shape[1:])}


if __name__ == "__main__":
    main()
