"""Data loaders on files the tests write: MNIST IDX (raw and .gz), CIFAR-10 batches, image folders."""

import gzip
import pickle
import struct

import numpy as np
import pytest
import torch
from PIL import Image

from vit.data import augment, load_dataset, load_digits, read_idx


def write_idx(path, array: np.ndarray, compress: bool) -> None:
    header = bytes([0, 0, 0x08, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if compress:
        path = path.with_name(path.name + ".gz")
        with gzip.open(path, "wb") as handle:
            handle.write(data)
    else:
        path.write_bytes(data)


@pytest.fixture(params=[False, True], ids=["raw", "gz"])
def mnist_dir(tmp_path, request):
    rng = np.random.default_rng(0)
    for prefix, n in (("train", 30), ("t10k", 12)):
        write_idx(tmp_path / f"{prefix}-images-idx3-ubyte", rng.integers(0, 256, (n, 28, 28)), request.param)
        write_idx(tmp_path / f"{prefix}-labels-idx1-ubyte", rng.integers(0, 10, (n,)), request.param)
    return tmp_path


def test_mnist_loads(mnist_dir):
    train, test = load_dataset("mnist", mnist_dir)
    assert train.images.shape == (30, 1, 28, 28) and test.images.shape == (12, 1, 28, 28)
    assert train.labels.dtype == torch.int64 and int(train.labels.max()) < 10
    assert abs(train.images.mean().item()) < 1e-5 and abs(train.images.std().item() - 1) < 1e-2
    raw = read_idx(next(mnist_dir.glob("train-images*")))
    expected = (raw[3].astype(np.float32) / 255 - train.mean[0]) / train.std[0]
    np.testing.assert_allclose(train.images[3, 0].numpy(), expected, rtol=1e-5, atol=1e-5)


def test_mnist_errors_name_the_path(tmp_path):
    with pytest.raises(
        FileNotFoundError, match="train-images-idx3-ubyte not found in .*expected a folder holding"
    ):
        load_dataset("mnist", tmp_path)
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        load_dataset("mnist", tmp_path / "nope")
    (tmp_path / "train-images-idx3-ubyte").write_bytes(
        b"\x00\x00\x08\x03" + struct.pack(">3I", 5, 28, 28) + b"\x00" * 10
    )
    with pytest.raises(ValueError, match="train-images-idx3-ubyte is malformed"):
        read_idx(tmp_path / "train-images-idx3-ubyte")
    (tmp_path / "junk").write_bytes(b"\x12\x34\x56\x78")
    with pytest.raises(ValueError, match="bad magic number"):
        read_idx(tmp_path / "junk")


def write_cifar(folder, n=8):
    rng = np.random.default_rng(1)
    folder.mkdir(parents=True, exist_ok=True)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {
            b"data": rng.integers(0, 256, (n, 3072), dtype=np.uint8),
            b"labels": list(rng.integers(0, 10, n)),
        }
        with open(folder / name, "wb") as handle:
            pickle.dump(batch, handle)
    with open(folder / "batches.meta", "wb") as handle:
        pickle.dump({b"label_names": [f"class{i}".encode() for i in range(10)]}, handle)


def test_cifar10_loads(tmp_path):
    write_cifar(tmp_path / "cifar-10-batches-py")
    train, test = load_dataset("cifar10", tmp_path)
    assert train.images.shape == (40, 3, 32, 32) and test.images.shape == (8, 3, 32, 32)
    assert train.classes[3] == "class3" and train.flip_ok


def test_cifar10_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found in .*cifar-10-batches-py folder"):
        load_dataset("cifar10", tmp_path)
    write_cifar(tmp_path)
    (tmp_path / "test_batch").write_bytes(b"not a pickle")
    with pytest.raises(ValueError, match="test_batch is not a CIFAR-10 python batch"):
        load_dataset("cifar10", tmp_path)


def write_folder(root, classes=("cat", "dog", "owl"), per_class=5):
    rng = np.random.default_rng(2)
    for name in classes:
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            Image.fromarray(rng.integers(0, 256, (20, 14, 3), dtype=np.uint8)).save(root / name / f"{i}.png")


def test_image_folder_split_and_resize(tmp_path):
    write_folder(tmp_path)
    train, test = load_dataset("folder", tmp_path, img_size=16, in_chans=3)
    assert train.classes == ["cat", "dog", "owl"]
    assert len(train) + len(test) == 15 and train.images.shape[1:] == (3, 16, 16)
    assert sorted(test.labels.tolist()) == [0, 1, 2]  # stratified
    gray, _ = load_dataset("folder", tmp_path, img_size=8, in_chans=1)
    assert gray.images.shape[1:] == (1, 8, 8)


def test_image_folder_with_train_and_test_subfolders(tmp_path):
    write_folder(tmp_path / "train")
    write_folder(tmp_path / "val", per_class=2)
    train, test = load_dataset("folder", tmp_path, img_size=8)
    assert len(train) == 15 and len(test) == 6


def test_image_folder_errors(tmp_path):
    with pytest.raises(ValueError, match="holds 0 class folder"):
        load_dataset("folder", tmp_path, img_size=8)
    write_folder(tmp_path)
    (tmp_path / "cat" / "broken.png").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="cannot read image .*broken.png"):
        load_dataset("folder", tmp_path, img_size=8)


def test_digits_split_is_fixed_and_stratified():
    train, test = load_digits()
    again, _ = load_digits()
    assert len(train) + len(test) == 1797 and train.images.shape[1:] == (1, 8, 8)
    torch.testing.assert_close(train.images, again.images)
    counts = torch.bincount(test.labels, minlength=10)
    assert counts.min() >= 40 and counts.max() <= 50


def test_synthetic_and_unknown_dataset():
    train, test = load_dataset("synthetic", img_size=12, in_chans=2, num_classes=4)
    assert train.images.shape == (512, 2, 12, 12) and set(test.labels.tolist()) <= {0, 1, 2, 3}
    with pytest.raises(ValueError, match="unknown dataset 'imagenet'; valid names"):
        load_dataset("imagenet")
    with pytest.raises(ValueError, match="dataset 'mnist' needs a path"):
        load_dataset("mnist")


def test_augment_shifts_and_flips():
    images = torch.arange(2 * 1 * 5 * 5, dtype=torch.float32).view(2, 1, 5, 5)
    generator = torch.Generator().manual_seed(3)
    out = augment(images, generator, max_shift=0, flip=False)
    assert torch.equal(out, images)
    shifted = augment(images, generator, max_shift=1, flip=False)
    assert shifted.shape == images.shape
    for i in range(2):  # each output is some translate of its input by at most one pixel (edges replicated)
        padded = torch.nn.functional.pad(images[i : i + 1], (1, 1, 1, 1), mode="replicate")[0, 0]
        candidates = [padded[dy : dy + 5, dx : dx + 5] for dy in range(3) for dx in range(3)]
        assert any(torch.equal(shifted[i, 0], c) for c in candidates)
    flipped = augment(images, torch.Generator().manual_seed(0), max_shift=0, flip=True)
    assert all(
        torch.equal(flipped[i], images[i]) or torch.equal(flipped[i], images[i].flip(-1)) for i in range(2)
    )
