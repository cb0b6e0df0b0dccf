"""Dataset registry. Every dataset is held in memory as tensors and batched by indexing."""
from __future__ import annotations

import dataclasses
import hashlib
import os
import random
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import BatchsweepError, ConfigError
from .imports import load_factory


class DataError(BatchsweepError):
    """A dataset that cannot be found or made."""


@dataclass
class Data:
    """Train and test tensors; `num_classes` is the output width (the target width for float targets)."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    notes: tuple[str, ...] = ()  # what loading had to mend (e.g. a rebuilt cache), for the run's warnings
    digest: str = ""  # of the tensors as loaded (see with_digest): the dataset's identity in a run's record

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def classification(self) -> bool:
        return not self.y_train.is_floating_point()

    @property
    def num_classes(self) -> int:
        if self.classification:
            return int(max(self.y_train.max(), self.y_test.max())) + 1
        return 1 if self.y_train.dim() == 1 else self.y_train.shape[1]

    @property
    def chance(self) -> float | None:
        """The accuracy of always answering the test set's most common class (None for float targets)."""
        if not self.classification:
            return None
        return torch.bincount(self.y_test.cpu()).max().item() / len(self.y_test)

    def to(self, device: torch.device, dtype: torch.dtype) -> "Data":
        def move(t: torch.Tensor) -> torch.Tensor:
            return t.to(device, dtype if t.is_floating_point() else None)

        return Data(move(self.x_train), move(self.y_train), move(self.x_test), move(self.y_test), self.notes,
                    self.digest)

    def with_digest(self) -> "Data":
        """The same data with `digest`: SHA-256 over the four tensors' bytes, first 16 hex digits (about 1 ms
        a MB). Two runs with the same digest trained and tested on the same numbers."""
        h = hashlib.sha256()
        for t in (self.x_train, self.y_train, self.x_test, self.y_test):
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


def _torchvision(cls_name: str, mean: tuple[float, ...], std: tuple[float, ...]):
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
        tensors = []
        for split in splits:
            images = torch.as_tensor(np.asarray(split.data)).float() / 255.0
            images = images.unsqueeze(1) if images.dim() == 3 else images.permute(0, 3, 1, 2)  # to N,C,H,W
            m = torch.tensor(mean).view(1, -1, 1, 1)
            s = torch.tensor(std).view(1, -1, 1, 1)
            tensors += [(images - m) / s, torch.as_tensor(np.asarray(split.targets)).long()]
        return Data(*tensors)

    return load


def _present(data_dir: str, cls_name: str) -> bool:
    """Whether torchvision's folder for this dataset exists with files in it."""
    folder = Path(data_dir) / ("cifar-10-batches-py" if cls_name == "CIFAR10" else cls_name)
    return folder.is_dir() and any(p.is_file() for p in folder.rglob("*"))


DATASETS = {
    "mnist1d": mnist1d,
    "mnist": _torchvision("MNIST", (0.1307,), (0.3081,)),
    "fashion_mnist": _torchvision("FashionMNIST", (0.2860,), (0.3530,)),
    "cifar10": _torchvision("CIFAR10", (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}


def _from_tensor_datasets(path: str, pair) -> Data:
    try:
        train, test = pair
        (x, y), (x_test, y_test) = train.tensors, test.tensors
    except (TypeError, ValueError, AttributeError):
        raise ConfigError(f"dataset factory {path!r} must return (train, test) TensorDatasets of "
                          f"(inputs, labels)") from None
    return Data(x, y, x_test, y_test)


def load_data(name: str, data_dir: str, seed: int) -> Data:
    if ":" in name:
        return _from_tensor_datasets(name, load_factory(name, "dataset")(data_dir=data_dir, seed=seed))
    return DATASETS[name](data_dir=data_dir, seed=seed)

