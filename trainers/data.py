"""Dataset registry. A dataset is held in memory as tensors and batched by indexing, or, when its training
set is any other map-style Dataset (with its own per-sample transforms: augmentation), read through a
DataLoader in the same order (trainers/feed.py). A test set of tensors is evaluated by indexing too; any other
is read through a DataLoader in eval batches at every evaluation, and only its labels are kept (for the class
count and chance). Samples may be (input, label) pairs or mappings (trainers/batches.py), batched by the
dataset's own collate function when it gives one."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import sysconfig
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from torch.utils.data import DataLoader, Dataset, TensorDataset

from . import batches
from .errors import ConfigError, DataError
from .imports import load_factory
from .losses import IGNORE_INDEX


@dataclass
class Data:
    """Train and test data; `num_classes` is the output width (the target width for float targets, the
    vocabulary for tokens). The training set is tensors (x_train, y_train) or a Dataset (train_set)."""

    x_train: torch.Tensor | None
    y_train: torch.Tensor | None
    x_test: torch.Tensor | None  # None when the test set is read through a loader
    y_test: torch.Tensor  # the test labels (padded with IGNORE_INDEX to one length when they are sequences)
    notes: tuple[str, ...] = ()  # what loading had to mend (e.g. a rebuilt cache), for the run's warnings
    digest: str = ""  # of the data as loaded (see with_digest): the dataset's identity in a run's record
    train_set: Dataset | None = None  # read through a DataLoader (trainers/feed.py)
    classes: int = 0  # the output width when the labels alone do not tell it (a vocabulary)
    test_set: Dataset | None = None  # read through a DataLoader (trainers/feed.py) when x_test is None
    collate: Callable | None = None  # the dataset's own batching of samples (None: torch's default)
    label_key: str = "labels"  # the target's entry in samples that are mappings

    @property
    def n_train(self) -> int:
        return len(self.train_set) if self.train_set is not None else len(self.x_train)

    @property
    def n_test(self) -> int:
        return len(self.test_set) if self.x_test is None else len(self.x_test)

    @property
    def input_shape(self) -> Any:
        """A sample's input shape (for a mapping, its tensors' shapes by key), given to model factories."""
        if self.x_test is not None:
            return tuple(self.x_test.shape[1:])
        return batches.shape(batches.split(self.test_set[0], self.label_key)[0])

    def example(self, n: int = 2) -> Any:
        """The inputs of the first n test samples (a tensor, or a mapping of them)."""
        if self.x_test is not None:
            return self.x_test[:n]
        samples = [self.test_set[i] for i in range(min(n, len(self.test_set)))]
        collate = self.collate or torch.utils.data.default_collate
        return batches.split(collate(samples), self.label_key)[0]

    @property
    def classification(self) -> bool:
        return not self.y_test.is_floating_point()

    @property
    def num_classes(self) -> int:
        if self.classes:
            return self.classes
        if self.classification:
            labels = [self.y_test, self.y_train if self.train_set is None else
                      torch.as_tensor(getattr(self.train_set, "targets", [0]))]
            return int(max(t[t != IGNORE_INDEX].max() for t in labels)) + 1
        return 1 if self.y_test.dim() == 1 else self.y_test.shape[1]

    @property
    def chance(self) -> float | None:
        """The accuracy of always answering the test set's most common class or token (None for float
        targets)."""
        if not self.classification:
            return None
        counted = self.y_test[self.y_test != IGNORE_INDEX].cpu()
        return torch.bincount(counted).max().item() / len(counted)

    def to(self, device: torch.device, dtype: torch.dtype) -> "Data":
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, dtype if t.is_floating_point() else None)

        return dataclasses.replace(self, x_train=move(self.x_train), y_train=move(self.y_train),
                                   x_test=move(self.x_test), y_test=move(self.y_test))

    def with_digest(self) -> "Data":
        """The same data with `digest`: SHA-256 over the tensors' bytes, first 16 hex digits (about 1 ms a MB).
        Two runs with the same digest trained and tested on the same numbers. A training Dataset counts by
        its class, size and `targets` (its augmented samples differ every epoch by design)."""
        h = hashlib.sha256()
        tensors = [self.y_test] if self.x_test is None else [self.x_test, self.y_test]
        if self.x_test is None:
            h.update(f"{type(self.test_set).__qualname__}:{len(self.test_set)}".encode())
        if self.train_set is None:
            tensors = [self.x_train, self.y_train] + tensors
        else:
            h.update(f"{type(self.train_set).__qualname__}:{len(self.train_set)}".encode())
            if hasattr(self.train_set, "targets"):
                tensors.append(torch.as_tensor(self.train_set.targets))
        for t in tensors:
            h.update(str((t.dtype, tuple(t.shape))).encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return dataclasses.replace(self, digest=h.hexdigest()[:16])


MNIST1D_SHAPES = {"x": (4000, 40), "y": (4000,), "x_test": (1000, 40), "y_test": (1000,)}


def _read_mnist1d(path: Path) -> dict[str, np.ndarray] | None:
    """The cached arrays, or None when the file is not a complete MNIST-1D cache (empty, truncated, other)."""
    try:
        with np.load(path, allow_pickle=False) as arrays:
            found = {k: arrays[k] for k in MNIST1D_SHAPES}
    except Exception:  # zipfile, pickle refusal, missing key, truncated member: all mean "not our cache"
        return None
    if any(found[k].shape != shape for k, shape in MNIST1D_SHAPES.items()):
        return None
    return found


def mnist1d(data_dir: str, **_) -> Data:
    """MNIST-1D (Greydanus 2020): 4,000 train and 1,000 test series of length 40, generated offline and
    cached. A cache that is not one (empty, truncated, another file) is rebuilt, with a note: the data is
    deterministic, so nothing is lost."""
    path = Path(data_dir) / "mnist1d.npz"
    notes: tuple[str, ...] = ()
    arrays = _read_mnist1d(path) if path.exists() else None
    if arrays is None:
        if path.exists():
            notes = (f"the MNIST-1D cache {path} was not a complete cache (empty, truncated or another file): "
                     f"rebuilt it",)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # mnist1d imports scipy.ndimage.filters
            from mnist1d.data import get_dataset_args, make_dataset
        # make_dataset reseeds numpy's and Python's global RNGs; give the caller theirs back.
        np_state, py_state = np.random.get_state(), random.getstate()
        try:
            raw = make_dataset(get_dataset_args())
        finally:
            np.random.set_state(np_state)
            random.setstate(py_state)
        arrays = {k: np.asarray(raw[k]) for k in MNIST1D_SHAPES}
        _save_npz_atomically(path, **arrays)
    x, x_test = (torch.from_numpy(arrays[k]).float().unsqueeze(1) for k in ("x", "x_test"))
    y, y_test = (torch.from_numpy(arrays[k]).long() for k in ("y", "y_test"))
    return Data(x, y, x_test, y_test, notes)


def _save_npz_atomically(path: Path, **arrays: np.ndarray) -> None:
    """Concurrent workers may build the cache at once: each writes a temp file and renames it into place.
    The file gets the permissions the umask gives any new file (mkstemp alone would make it 0600)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz.tmp")
        umask = os.umask(0)
        os.umask(umask)
        os.fchmod(fd, 0o666 & ~umask)
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, path)
    except OSError as exc:
        raise DataError(f"cannot write the dataset cache in {path.parent} ({exc.strerror}): "
                        f"pass a writable --data-dir") from None


def _torchvision(cls_name: str, mean: tuple[float, ...], std: tuple[float, ...], augment: bool = False):
    def load(data_dir: str, **_) -> Data:
        import torchvision.datasets as tvd

        cls = getattr(tvd, cls_name)
        present = _present(data_dir, cls_name)  # before a download attempt creates the folder
        try:
            # torchvision checks what it finds (MD5 sums for CIFAR's pickles, weights_only for MNIST's .pt)
            # and downloads only what is missing.
            splits = [cls(data_dir, train=train, download=not present) for train in (True, False)]
        except Exception as exc:  # a failed download raises URLError, RuntimeError or OSError
            if present:
                raise DataError(f"dataset {cls_name}: the files in {data_dir!r} were refused ({type(exc).__name__}: "
                                f"{str(exc).strip().splitlines()[0][:160] if str(exc).strip() else 'no message'}): "
                                f"they are incomplete or failed their checksum; replace them") from None
            raise DataError(f"dataset {cls_name} is not in {data_dir!r} and could not be downloaded "
                            f"({type(exc).__name__}): copy its files there or connect to the network") from None
        images, labels = [], []
        for split in splits:
            pixels = torch.as_tensor(np.asarray(split.data))
            images.append(pixels.unsqueeze(1) if pixels.dim() == 3 else pixels.permute(0, 3, 1, 2))  # N,C,H,W
            labels.append(torch.as_tensor(np.asarray(split.targets)).long())
        if augment:
            train_set = Augmented(images[0], labels[0], mean, std)
            return Data(None, None, normalize(images[1], mean, std), labels[1], train_set=train_set)
        return Data(normalize(images[0], mean, std), labels[0], normalize(images[1], mean, std), labels[1])

    return load


def normalize(images: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> torch.Tensor:
    """uint8 images (N, C, H, W) or (C, H, W) as floats with the channels' mean and std."""
    shape = (-1, 1, 1)
    return (images.float() / 255.0 - torch.tensor(mean).view(shape)) / torch.tensor(std).view(shape)


class Augmented(Dataset):
    """The standard CIFAR augmentation, per sample: a random 32x32 crop of the image padded by 4 pixels
    (zeros), a horizontal flip with probability 1/2, then normalization. Draws from torch's RNG, which the
    loader seeds per (seed, epoch, sample)."""

    def __init__(self, images: torch.Tensor, labels: torch.Tensor, mean, std, pad: int = 4):
        self.images, self.targets, self.mean, self.std, self.pad = images, labels, mean, std, pad

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = normalize(self.images[i], self.mean, self.std)
        _, height, width = image.shape
        padded = torch.nn.functional.pad(image, (self.pad,) * 4)
        top, left = torch.randint(0, 2 * self.pad + 1, (2,)).tolist()
        crop = padded[:, top:top + height, left:left + width]
        if torch.rand(()) < 0.5:
            crop = crop.flip(-1)
        return crop, self.targets[i]


def cifar_shaped(data_dir: str = "", augment: bool = True, train: int = 2000, test: int = 500, **_) -> Data:
    """Generated CIFAR-shaped data, 3x32x32 uint8 images in 10 classes (a smooth random pattern per class
    plus noise), with CIFAR's augmentation: the DataLoader path without a download."""
    g = torch.Generator().manual_seed(10)
    patterns = torch.nn.functional.interpolate(torch.rand(10, 3, 8, 8, generator=g), size=32, mode="bilinear")
    labels = torch.arange(train + test) % 10
    noise = torch.randn(train + test, 3, 32, 32, generator=g) * 0.15
    images = ((patterns[labels] + noise).clamp(0, 1) * 255).round().to(torch.uint8)
    mean, std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    x_test = normalize(images[train:], mean, std)
    if augment:
        return Data(None, None, x_test, labels[train:], train_set=Augmented(images[:train], labels[:train], mean, std))
    return Data(normalize(images[:train], mean, std), labels[:train], x_test, labels[train:])


PYTEXT_CONTEXT = 64  # tokens per sequence at most


def _pytext_chunks(count: int) -> list[torch.Tensor]:
    """`count` byte sequences of 9 to 65 bytes, in order, from the installed standard library's source files
    (sorted, every 8th one): deterministic for a Python version."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [d for d in subfolders if d not in ("test", "tests", "site-packages", "dist-packages", "idlelib")]
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    files.sort()
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(9, PYTEXT_CONTEXT + 2, (count,), generator=g).tolist()
    text = bytearray()
    for path in files[::8]:
        if len(text) >= sum(lengths):
            break
        text += path.read_bytes()
    if len(text) < sum(lengths):
        raise DataError(f"the standard library in {root} holds too little text for pytext: use another dataset")
    ends = np.cumsum(lengths).tolist()
    return [torch.tensor(list(text[end - length:end]), dtype=torch.long) for end, length in zip(ends, lengths)]


def pytext(data_dir: str = "", train: int = 4000, test: int = 1000, **_) -> Data:
    """Byte-level text from the installed Python standard library (no download), in sequences of 9 to 65
    bytes. Inputs are the first L-1 bytes, targets the next ones; both are padded on the right to 64 (targets
    with IGNORE_INDEX), so micro-batches hold different numbers of tokens."""
    chunks = _pytext_chunks(train + test)
    x = torch.zeros(len(chunks), PYTEXT_CONTEXT, dtype=torch.long)
    y = torch.full((len(chunks), PYTEXT_CONTEXT), IGNORE_INDEX, dtype=torch.long)
    for row, chunk in enumerate(chunks):
        x[row, :len(chunk) - 1], y[row, :len(chunk) - 1] = chunk[:-1], chunk[1:]
    return Data(x[:train], y[:train], x[train:], y[train:], classes=256)


class Texts(Dataset):
    """Token sequences as transformers shapes them: {"input_ids": ids, "labels": ids}, of their own lengths."""

    def __init__(self, chunks: list[torch.Tensor]):
        self.chunks = chunks

    def __len__(self) -> int:
        return len(self.chunks)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.chunks[i], "labels": self.chunks[i]}


def pad_collate(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """A batch padded on the right to its longest sequence: input ids with 0, an attention mask, labels with
    IGNORE_INDEX (as transformers' DataCollatorForLanguageModeling does)."""
    longest = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    labels = torch.full((len(samples), longest), IGNORE_INDEX, dtype=torch.long)
    for row, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[row, :n], mask[row, :n], labels[row, :n] = s["input_ids"], 1, s["labels"]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def pytext_hf(data_dir: str = "", train: int = 4000, test: int = 1000, seed: int = 0, **_) -> Data:
    """pytext's sequences as transformers' causal language models take them: mappings of input ids with
    labels that are the same ids (the model's loss shifts them), batched by `pad_collate` to each batch's
    longest; train and test sets read through a DataLoader."""
    chunks = _pytext_chunks(train + test)
    train_set, test_set = Texts(chunks[:train]), Texts(chunks[train:])
    return Data(None, None, None, test_labels(test_set, pad_collate, seed, "labels"), train_set=train_set,
                test_set=test_set, collate=pad_collate, classes=256)


def _present(data_dir: str, cls_name: str) -> bool:
    """Whether torchvision's folder for this dataset exists with files in it."""
    folder = Path(data_dir) / ("cifar-10-batches-py" if cls_name == "CIFAR10" else cls_name)
    return folder.is_dir() and any(p.is_file() for p in folder.rglob("*"))


DATASETS = {
    "mnist1d": mnist1d,
    "mnist": _torchvision("MNIST", (0.1307,), (0.3081,)),
    "fashion_mnist": _torchvision("FashionMNIST", (0.2860,), (0.3530,)),
    "cifar10": _torchvision("CIFAR10", (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616), augment=True),
    "cifar_shaped": cifar_shaped,
    "pytext": pytext,
    "pytext_hf": pytext_hf,
}


def _from_datasets(path: str, made, seed: int, label_key: str) -> Data:
    """(train, test) Datasets, or (train, test, collate_fn). TensorDatasets stay tensors; any other Dataset is
    read through a DataLoader, and of a test set only the labels are kept in memory."""
    try:
        train, test, *rest = made
        collate = rest[0] if rest else None
        if not isinstance(train, Dataset) or not isinstance(test, Dataset) or len(rest) > 1 or \
                (collate is not None and not callable(collate)):
            raise TypeError
    except (TypeError, ValueError):
        raise ConfigError(f"dataset factory {path!r} must return (train, test) Datasets, or (train, test, "
                          f"collate_fn)") from None
    try:
        if isinstance(test, TensorDataset):
            x_test, y_test = test.tensors
            data = Data(None, None, x_test, y_test, collate=collate, label_key=label_key)
        else:
            data = Data(None, None, None, test_labels(test, collate, seed, label_key), test_set=test,
                        collate=collate, label_key=label_key)
        if isinstance(train, TensorDataset):
            return dataclasses.replace(data, x_train=train.tensors[0], y_train=train.tensors[1])
    except ConfigError:  # (a ValueError too) it names the problem already
        raise
    except (TypeError, ValueError, IndexError):
        raise ConfigError(f"dataset factory {path!r}: its samples are neither (input, label) pairs nor mappings "
                          f"with a {label_key!r} entry that batch into tensors") from None
    return dataclasses.replace(data, train_set=train)


def test_labels(test: Dataset, collate: Callable | None, seed: int, label_key: str) -> torch.Tensor:
    """The labels of a test set, read once through a loader: sequences are padded with IGNORE_INDEX to the
    longest (a drawing test set reads in a state of its own, the same in every run)."""
    if hasattr(test, "targets"):  # torchvision's datasets know their labels without reading the images
        return torch.as_tensor(test.targets)
    found = []
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for batch in DataLoader(test, batch_size=256, collate_fn=collate):
            found.append(torch.as_tensor(batches.split(batch, label_key)[1]))
    if found[0].dim() == 2 and not found[0].is_floating_point():
        longest = max(t.shape[1] for t in found)
        found = [torch.nn.functional.pad(t, (0, longest - t.shape[1]), value=IGNORE_INDEX) for t in found]
    return torch.cat(found)


def load_data(name: str, data_dir: str, seed: int, label_key: str = "labels") -> Data:
    if ":" in name:
        return _from_datasets(name, load_factory(name, "dataset")(data_dir=data_dir, seed=seed), seed, label_key)
    return DATASETS[name](data_dir=data_dir, seed=seed)
