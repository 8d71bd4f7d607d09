"""Datasets from local files only (never a download): the scikit-learn digits, MNIST IDX files,
CIFAR-10 python batches, an image folder, and synthetic data for benchmarks.

Every loader returns a train and a test ``ImageData``: images held in memory as float32
(N, C, H, W), normalised per channel with the *train* split's mean and std, and int64 labels (N,).
Small ViT datasets fit in memory easily, and batching by index beats a per-item DataLoader on a CPU.
"""

from __future__ import annotations

import dataclasses
import gzip
import pickle
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np
import torch

DATASETS = ("digits", "mnist", "cifar10", "folder", "synthetic")
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm", ".ppm")


@dataclass
class ImageData:
    """images (N, C, H, W) float32, normalised; labels (N,) int64."""

    images: torch.Tensor
    labels: torch.Tensor
    classes: list[str]
    mean: list[float] = field(default_factory=list)
    std: list[float] = field(default_factory=list)
    flip_ok: bool = False  # whether horizontal flips preserve the label (not for digits)
    source: str = ""  # where the labels come from, for error messages

    def __len__(self) -> int:
        return self.labels.shape[0]

    @property
    def num_classes(self) -> int:
        return len(self.classes)


def _normalise(
    train_images: torch.Tensor, test_images: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, list, list]:
    mean = train_images.mean(dim=(0, 2, 3), keepdim=True)
    std = train_images.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    return (
        (train_images - mean) / std,
        (test_images - mean) / std,
        mean.flatten().tolist(),
        std.flatten().tolist(),
    )


def normalise_with(images: torch.Tensor, mean: list[float], std: list[float]) -> torch.Tensor:
    """Apply stored statistics to new images (N, C, H, W) in [0, 1]."""
    shape = (1, -1, 1, 1)
    return (images - torch.tensor(mean).view(shape)) / torch.tensor(std).view(shape)


def _pair(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    classes: list[str],
    flip_ok: bool,
    sources: tuple[str, str] = ("", ""),
) -> tuple[ImageData, ImageData]:
    """uint8 or [0, 1] float arrays (N, C, H, W) -> normalised train and test ImageData."""
    scale = 255.0 if train_x.dtype == np.uint8 else 1.0
    train_t = torch.from_numpy(np.ascontiguousarray(train_x)).float() / scale
    test_t = torch.from_numpy(np.ascontiguousarray(test_x)).float() / scale
    train_t, test_t, mean, std = _normalise(train_t, test_t)
    return (
        ImageData(
            train_t, torch.from_numpy(np.asarray(train_y)).long(), classes, mean, std, flip_ok, sources[0]
        ),
        ImageData(
            test_t, torch.from_numpy(np.asarray(test_y)).long(), classes, mean, std, flip_ok, sources[1]
        ),
    )


def load_digits(test_fraction: float = 0.25, seed: int = 0) -> tuple[ImageData, ImageData]:
    """scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes), a fixed stratified split."""
    from sklearn.datasets import load_digits as sklearn_digits
    from sklearn.model_selection import train_test_split

    bunch = sklearn_digits()
    images = (bunch.images / 16.0).astype(np.float32)[:, None]  # (N, 1, 8, 8) in [0, 1]
    train_x, test_x, train_y, test_y = train_test_split(
        images, bunch.target, test_size=test_fraction, stratify=bunch.target, random_state=seed
    )
    return _pair(
        train_x,
        train_y,
        test_x,
        test_y,
        [str(i) for i in range(10)],
        flip_ok=False,
        sources=("digits (train split)", "digits (test split)"),
    )


MNIST_LAYOUT = (
    "a folder holding train-images-idx3-ubyte, train-labels-idx1-ubyte, t10k-images-idx3-ubyte and "
    "t10k-labels-idx1-ubyte (each optionally .gz), directly or under MNIST/raw/"
)


def _find(folder: Path, stem: str) -> Optional[Path]:
    for candidate in (
        folder / stem,
        folder / f"{stem}.gz",
        folder / "MNIST" / "raw" / stem,
        folder / "MNIST" / "raw" / f"{stem}.gz",
    ):
        if candidate.is_file():
            return candidate
    return None


def read_idx(path: Path) -> np.ndarray:
    """An IDX file (big-endian header: 0, 0, type 0x08 = uint8, ndim; then ndim uint32 sizes)."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as handle:
        raw = handle.read()
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte IDX file (bad magic number {raw[:4].hex()})")
    ndim = raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise ValueError(f"{path} is truncated: the IDX header needs {header} bytes, the file has {len(raw)}")
    shape = struct.unpack(f">{ndim}I", raw[4:header])
    expected = header + int(np.prod(shape))
    if len(raw) != expected:
        raise ValueError(
            f"{path} is malformed: header says shape {shape} ({expected} bytes), file has {len(raw)}"
        )
    return np.frombuffer(bytearray(raw), dtype=np.uint8, offset=header).reshape(shape)


def load_mnist(path: str | Path) -> tuple[ImageData, ImageData]:
    """MNIST (or Fashion-MNIST) from local IDX files."""
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"MNIST path {str(folder)!r} is not a directory; expected {MNIST_LAYOUT}")
    arrays, found_at = {}, {}
    for stem in (
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "t10k-images-idx3-ubyte",
        "t10k-labels-idx1-ubyte",
    ):
        found = _find(folder, stem)
        if found is None:
            raise FileNotFoundError(f"{stem} not found in {str(folder)!r}; expected {MNIST_LAYOUT}")
        arrays[stem], found_at[stem] = read_idx(found), str(found)
    train_x, train_y = arrays["train-images-idx3-ubyte"], arrays["train-labels-idx1-ubyte"]
    test_x, test_y = arrays["t10k-images-idx3-ubyte"], arrays["t10k-labels-idx1-ubyte"]
    for images, labels, split in ((train_x, train_y, "train"), (test_x, test_y, "t10k")):
        if images.ndim != 3 or labels.ndim != 1 or images.shape[0] != labels.shape[0]:
            raise ValueError(
                f"MNIST {split} files in {str(folder)!r} disagree: images {images.shape} (N, H, W), labels {labels.shape} (N,)"
            )
    sources = (found_at["train-labels-idx1-ubyte"], found_at["t10k-labels-idx1-ubyte"])
    return _pair(
        train_x[:, None],
        train_y,
        test_x[:, None],
        test_y,
        [str(i) for i in range(10)],
        flip_ok=False,
        sources=sources,
    )


CIFAR_LAYOUT = (
    "the extracted cifar-10-batches-py folder: data_batch_1 .. data_batch_5 and test_batch (python pickles)"
)


# The only globals a CIFAR-10 python batch refers to: numpy's array and scalar reconstructors (the
# module was renamed numpy._core in numpy 2). Lists, dicts, bytes, str, int need no global.
CIFAR_PICKLE_GLOBALS = {
    (module, name)
    for module in ("numpy.core.multiarray", "numpy._core.multiarray")
    for name in ("_reconstruct", "scalar")
} | {("numpy", "ndarray"), ("numpy", "dtype")}


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles plain containers and numpy arrays only: any other global (a function or class
    that unpickling would call) is refused before anything runs."""

    def find_class(self, module: str, name: str):
        if (module, name) not in CIFAR_PICKLE_GLOBALS:
            raise pickle.UnpicklingError(
                f"refusing to load global {module}.{name}: a CIFAR-10 batch holds only numpy arrays, lists and bytes"
            )
        return super().find_class(module, name)


def read_cifar_pickle(path: Path) -> object:
    """A CIFAR-10 batch or batches.meta file, read with :class:`RestrictedUnpickler`."""
    with open(path, "rb") as handle:
        try:
            return RestrictedUnpickler(handle, encoding="bytes").load()
        except Exception as error:
            raise ValueError(
                f"{path} is not a CIFAR-10 python batch ({error}); expected {CIFAR_LAYOUT}"
            ) from error


def _read_cifar_batch(path: Path) -> tuple[np.ndarray, np.ndarray]:
    batch = read_cifar_pickle(path)
    if not isinstance(batch, dict) or b"data" not in batch or b"labels" not in batch:
        raise ValueError(
            f"{path} lacks the b'data' / b'labels' entries of a CIFAR-10 batch; expected {CIFAR_LAYOUT}"
        )
    data = np.asarray(batch[b"data"], dtype=np.uint8)
    if data.ndim != 2 or data.shape[1] != 3 * 32 * 32:
        raise ValueError(f"{path}: data has shape {data.shape}, expected (N, 3072); expected {CIFAR_LAYOUT}")
    return data.reshape(-1, 3, 32, 32), np.asarray(batch[b"labels"], dtype=np.int64)


def load_cifar10(path: str | Path) -> tuple[ImageData, ImageData]:
    """CIFAR-10 from its local python batches."""
    folder = Path(path)
    if (folder / "cifar-10-batches-py").is_dir():
        folder = folder / "cifar-10-batches-py"
    if not folder.is_dir():
        raise FileNotFoundError(f"CIFAR-10 path {str(folder)!r} is not a directory; expected {CIFAR_LAYOUT}")
    names = [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]
    missing = [name for name in names if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(f"{missing} not found in {str(folder)!r}; expected {CIFAR_LAYOUT}")
    train = [_read_cifar_batch(folder / name) for name in names[:5]]
    test_x, test_y = _read_cifar_batch(folder / "test_batch")
    classes = [str(i) for i in range(10)]
    meta = folder / "batches.meta"
    if meta.is_file():
        contents = read_cifar_pickle(meta)
        names_raw = contents.get(b"label_names") if isinstance(contents, dict) else None
        if names_raw:
            classes = [n.decode() if isinstance(n, bytes) else str(n) for n in names_raw]
    train_x = np.concatenate([x for x, _ in train])
    train_y = np.concatenate([y for _, y in train])
    sources = (f"{folder / 'data_batch_1'} .. data_batch_5", str(folder / "test_batch"))
    return _pair(train_x, train_y, test_x, test_y, classes, flip_ok=True, sources=sources)


FOLDER_LAYOUT = (
    "one subfolder per class holding image files (root/<class>/*.png), or root/train/<class>/ and "
    "root/test/<class>/ (or val/) for a fixed split"
)


def read_image(path: str | Path, img_size: int, in_chans: int) -> np.ndarray:
    """One image file -> (C, img_size, img_size) uint8, converted to grayscale or RGB and resized."""
    from PIL import Image

    try:
        with Image.open(path) as image:
            image = image.convert("L" if in_chans == 1 else "RGB").resize(
                (img_size, img_size), Image.BILINEAR
            )
            array = np.array(image, dtype=np.uint8)
    except (OSError, ValueError) as error:
        raise ValueError(f"cannot read image {str(path)!r}: {error}") from error
    return array[None] if in_chans == 1 else array.transpose(2, 0, 1)


def _scan_classes(root: Path) -> dict[str, list[Path]]:
    classes = {}
    for sub in sorted(p for p in root.iterdir() if p.is_dir()):
        files = sorted(f for f in sub.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES)
        if files:
            classes[sub.name] = files
    return classes


def _read_split(by_class: dict[str, list[Path]], classes: list[str], img_size: int, in_chans: int):
    images, labels = [], []
    for label, name in enumerate(classes):
        for file in by_class.get(name, []):
            images.append(read_image(file, img_size, in_chans))
            labels.append(label)
    return np.stack(images), np.asarray(labels, dtype=np.int64)


def load_image_folder(
    path: str | Path, img_size: int, in_chans: int = 3, test_fraction: float = 0.2, seed: int = 0
) -> tuple[ImageData, ImageData]:
    """Images in per-class subfolders, resized to ``img_size`` and loaded into memory."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"image folder {str(root)!r} is not a directory; expected {FOLDER_LAYOUT}")
    test_dir = next((root / name for name in ("test", "val") if (root / name).is_dir()), None)
    if (root / "train").is_dir() and test_dir is not None:
        train_by_class, test_by_class = _scan_classes(root / "train"), _scan_classes(test_dir)
        classes = sorted(train_by_class)
        if not classes:
            raise ValueError(f"no images found under {str(root / 'train')!r}; expected {FOLDER_LAYOUT}")
        unknown = sorted(set(test_by_class) - set(classes))
        if unknown:
            raise ValueError(
                f"{str(test_dir)!r} has classes {unknown} that train/ lacks; expected {FOLDER_LAYOUT}"
            )
        train_x, train_y = _read_split(train_by_class, classes, img_size, in_chans)
        test_x, test_y = _read_split(test_by_class, classes, img_size, in_chans)
    else:
        by_class = _scan_classes(root)
        classes = sorted(by_class)
        if len(classes) < 2:
            raise ValueError(
                f"{str(root)!r} holds {len(classes)} class folder(s) with images, need 2 or more; expected {FOLDER_LAYOUT}"
            )
        images, labels = _read_split(by_class, classes, img_size, in_chans)
        from sklearn.model_selection import train_test_split

        train_x, test_x, train_y, test_y = train_test_split(
            images, labels, test_size=test_fraction, stratify=labels, random_state=seed
        )
    return _pair(train_x, train_y, test_x, test_y, classes, flip_ok=True, sources=(str(root), str(root)))


def load_synthetic(
    img_size: int, in_chans: int, num_classes: int, train_size: int = 512, test_size: int = 128, seed: int = 0
) -> tuple[ImageData, ImageData]:
    """Random images whose class is a fixed random template plus noise: learnable, for smoke tests
    and throughput benchmarks."""
    generator = torch.Generator().manual_seed(seed)
    templates = torch.rand(num_classes, in_chans, img_size, img_size, generator=generator)

    def draw(n: int) -> tuple[np.ndarray, np.ndarray]:
        labels = torch.randint(num_classes, (n,), generator=generator)
        noise = 0.3 * torch.rand(n, in_chans, img_size, img_size, generator=generator)
        return (0.7 * templates[labels] + noise).numpy(), labels.numpy()

    train_x, train_y = draw(train_size)
    test_x, test_y = draw(test_size)
    return _pair(
        train_x,
        train_y,
        test_x,
        test_y,
        [str(i) for i in range(num_classes)],
        flip_ok=True,
        sources=("synthetic", "synthetic"),
    )


def load_dataset(
    name: str,
    path: Optional[str | Path] = None,
    *,
    img_size: int = 32,
    in_chans: int = 3,
    num_classes: int = 10,
    seed: int = 0,
) -> tuple[ImageData, ImageData]:
    """(train, test) for ``name`` in DATASETS; ``path`` for mnist, cifar10 and folder.
    ``img_size``/``in_chans`` shape folder and synthetic images; ``num_classes`` and ``seed`` the
    synthetic data. Train/test splits of the other datasets are fixed."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; valid names: {', '.join(DATASETS)}")
    if name in ("mnist", "cifar10", "folder") and path is None:
        raise ValueError(f"dataset {name!r} needs a path (--data-path)")
    if name == "digits":
        return load_digits()
    if name == "mnist":
        return load_mnist(path)
    if name == "cifar10":
        return load_cifar10(path)
    if name == "folder":
        return load_image_folder(path, img_size, in_chans)
    return load_synthetic(img_size, in_chans, num_classes, seed=seed)


def check_labels(data: ImageData, num_classes: int) -> None:
    """Every label in [0, num_classes), else a ValueError naming the file the labels come from."""
    if len(data) == 0:
        raise ValueError(f"{data.source}: no images")
    low, high = int(data.labels.min()), int(data.labels.max())
    if low < 0 or high >= num_classes:
        raise ValueError(
            f"{data.source}: labels range over [{low}, {high}], but the model has {num_classes} classes "
            f"(labels must lie in [0, {num_classes - 1}]; see --num-classes)"
        )


def resize(data: ImageData, img_size: int) -> ImageData:
    """The same data with images (N, C, H, W) resized to (N, C, img_size, img_size) (bilinear,
    antialiased; a no-op at the same size)."""
    if data.images.shape[-2:] == (img_size, img_size):
        return data
    images = torch.nn.functional.interpolate(
        data.images, size=(img_size, img_size), mode="bilinear", antialias=True, align_corners=False
    )
    return dataclasses.replace(data, images=images)


def augment(images: torch.Tensor, generator: torch.Generator, max_shift: int, flip: bool) -> torch.Tensor:
    """Random translation by up to ``max_shift`` pixels (edge pixels repeated into the gap) and, when
    ``flip``, random horizontal flips. images (N, C, H, W) -> same shape."""
    n, _, height, width = images.shape
    if flip:
        flips = torch.rand(n, generator=generator) < 0.5
        images = torch.where(flips.view(-1, 1, 1, 1).to(images.device), images.flip(-1), images)
    if max_shift <= 0:
        return images
    padded = torch.nn.functional.pad(images, (max_shift,) * 4, mode="replicate")
    dy = torch.randint(0, 2 * max_shift + 1, (n,), generator=generator).to(images.device)
    dx = torch.randint(0, 2 * max_shift + 1, (n,), generator=generator).to(images.device)
    rows = (dy.view(n, 1) + torch.arange(height, device=images.device)).view(n, 1, height, 1)
    cols = (dx.view(n, 1) + torch.arange(width, device=images.device)).view(n, 1, 1, width)
    batch = torch.arange(n, device=images.device).view(n, 1, 1, 1)
    channels = torch.arange(images.shape[1], device=images.device).view(1, -1, 1, 1)
    return padded[batch, channels, rows, cols]
