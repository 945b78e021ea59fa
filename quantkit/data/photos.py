"""Real photos that ship offline, cut into deterministic random crops.

Sources (loaded once per process): scikit-image's ``skimage.data`` colour photos
(astronaut, chelsea, coffee, rocket, hubble_deep_field, immunohistochemistry, retina,
colorwheel), its grayscale ones converted to RGB (camera, coins, moon, horse, page,
clock, brick) and scikit-learn's ``load_sample_images()`` (china, flower): 17 photos.

Sample ``i`` of split ``s`` with seed ``seed`` is drawn from its own random stream
``default_rng([seed, split_id(s), i])``:

* the photo is ``order[i % 17]``, where ``order`` is a permutation drawn from
  ``default_rng([seed, split_id(s)])`` (so photos are used round robin);
* a square crop of side ``round(u * short_side)``, ``u ~ U(0.3, 1.0)``, at a uniform
  random position, mirrored horizontally with probability 1/2;
* then the :class:`~quantkit.data.images.Preprocess` steps.

Because every sample has its own stream, ``count=10`` is a prefix of ``count=100``,
and the calibration and evaluation splits use different streams, so their crops
differ (the tests check that no crop box is shared).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from quantkit.data.base import MAX_SAMPLES, check_batch_size, new_hasher
from quantkit.data.images import ImagePreprocess, get_preprocess, preprocess_image, to_rgb_uint8
from quantkit.errors import DataError

__all__ = ["PHOTO_NAMES", "SPLITS", "CropSpec", "SamplePhotosDataset", "sample_photos", "write_sample_photos"]

SPLITS = ("calibration", "evaluation")
_SKIMAGE_NAMES = (
    "astronaut",
    "chelsea",
    "coffee",
    "rocket",
    "hubble_deep_field",
    "immunohistochemistry",
    "retina",
    "colorwheel",
    "camera",
    "coins",
    "moon",
    "horse",
    "page",
    "clock",
    "brick",
)
_SKLEARN_NAMES = ("china", "flower")
PHOTO_NAMES = _SKIMAGE_NAMES + _SKLEARN_NAMES
_MIN_SCALE, _MAX_SCALE = 0.3, 1.0


@functools.lru_cache(maxsize=1)
def sample_photos() -> tuple[tuple[str, np.ndarray], ...]:
    """``(name, uint8 HxWx3)`` for every source photo, loaded once per process.

    Raises:
        DataError: scikit-image or scikit-learn is not installed.
    """
    try:
        import skimage.data
        from sklearn.datasets import load_sample_images
    except ImportError as e:
        raise DataError(
            f"sample photos need scikit-image and scikit-learn (pip install quantkit[images]): {e}"
        ) from e
    photos: list[tuple[str, np.ndarray]] = []
    for name in _SKIMAGE_NAMES:
        photos.append((name, to_rgb_uint8(np.asarray(getattr(skimage.data, name)()))))
    bunch = load_sample_images()
    for name, filename, image in zip(_SKLEARN_NAMES, bunch.filenames, bunch.images, strict=True):
        if Path(filename).stem != name:
            raise DataError(f"scikit-learn sample image order changed: expected {name}, got {filename}")
        photos.append((name, to_rgb_uint8(np.asarray(image))))
    for _, a in photos:
        a.setflags(write=False)
    return tuple(photos)


@functools.lru_cache(maxsize=1)
def _photos_digest() -> str:
    h = new_hasher("photo-sources", {})
    for name, a in sample_photos():
        h.update(f"{name}|{a.shape}|".encode())
        h.update(a.tobytes())
    return str(h.hexdigest())


@dataclass(frozen=True)
class CropSpec:
    """Where sample ``index`` comes from: photo, crop box ``(left, top, side)`` and flip."""

    index: int
    photo: str
    left: int
    top: int
    side: int
    flip: bool


def _split_id(split: str) -> int:
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; allowed: {', '.join(SPLITS)}")
    return SPLITS.index(split)


def _crop_spec(i: int, split: str, seed: int) -> CropSpec:
    photos = sample_photos()
    sid = _split_id(split)
    order = np.random.default_rng([seed, sid]).permutation(len(photos))
    name, a = photos[int(order[i % len(photos)])]
    rng = np.random.default_rng([seed, sid, i])
    h, w = a.shape[:2]
    short = min(h, w)
    side = max(1, int(round(rng.uniform(_MIN_SCALE, _MAX_SCALE) * short)))
    top = int(rng.integers(0, h - side + 1))
    left = int(rng.integers(0, w - side + 1))
    flip = bool(rng.random() < 0.5)
    return CropSpec(i, name, left, top, side, flip)


def _crop(spec: CropSpec) -> np.ndarray:
    a = dict(sample_photos())[spec.photo]
    c = a[spec.top : spec.top + spec.side, spec.left : spec.left + spec.side]
    return np.ascontiguousarray(c[:, ::-1] if spec.flip else c)


def _check_count(count: int) -> None:
    """``count`` must be an integer from 1 to :data:`~quantkit.data.base.MAX_SAMPLES`."""
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise DataError(f"sample photo count must be a positive integer, got {count!r}")
    if count > MAX_SAMPLES:
        raise DataError(f"sample photo count is {count}; allowed: 1 to {MAX_SAMPLES}")


class SamplePhotosDataset:
    """``count`` preprocessed random crops of the offline sample photos (see module docstring)."""

    def __init__(
        self,
        count: int,
        split: str = "calibration",
        input_name: str = "input",
        preprocess: str | ImagePreprocess | Mapping[str, Any] = "efficientnet",
        seed: int = 0,
    ) -> None:
        """Raises DataError for a bad count or split."""
        _check_count(count)
        _split_id(split)
        self.count = count
        self.split = split
        self.input_name = input_name
        self.preprocess = get_preprocess(preprocess)
        self.seed = seed
        self._fp: str | None = None

    def crops(self) -> list[CropSpec]:
        """The crop boxes of all samples (cheap: no pixels are touched)."""
        return [_crop_spec(i, self.split, self.seed) for i in range(self.count)]

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Crops are cut and preprocessed one batch at a time."""
        check_batch_size(batch_size)
        for start in range(0, self.count, batch_size):
            stop = min(start + batch_size, self.count)
            arrays = [
                preprocess_image(_crop(_crop_spec(i, self.split, self.seed)), self.preprocess)
                for i in range(start, stop)
            ]
            yield {self.input_name: np.stack(arrays)}

    def __len__(self) -> int:
        return self.count

    def fingerprint(self) -> str:
        """sha256 over the settings and the source photos' pixels."""
        if self._fp is None:
            settings = {
                "count": self.count,
                "split": self.split,
                "seed": self.seed,
                "input": self.input_name,
                "preprocess": self.preprocess.settings(),
                "photos": _photos_digest(),
            }
            self._fp = new_hasher("sample_photos", settings).hexdigest()
        return self._fp


def write_sample_photos(
    folder: str | os.PathLike[str],
    count: int,
    split: str = "calibration",
    seed: int = 0,
    *,
    format: str = "png",
    size: int | None = None,
) -> list[Path]:
    """Write the raw crops of ``SamplePhotosDataset(count, split, seed=seed)`` as image files.

    Files are named ``{split}_{i:05d}_{photo}.{format}``.  With ``format="png"`` and
    ``size=None`` an :class:`ImageFolderDataset` over the folder yields exactly the
    arrays of the equivalent :class:`SamplePhotosDataset`; ``size`` resizes each crop to
    ``size x size`` (bicubic) first and ``format="jpg"`` writes JPEG (quality 95), both
    to keep files small.

    Raises:
        DataError: bad count, split, format or size.
    """
    _check_count(count)
    fmt = format.lower()
    if fmt not in ("png", "jpg", "jpeg"):
        raise DataError(f"sample photo format {format!r} is not allowed; allowed: png, jpg")
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise DataError(f"sample photo size must be a positive integer or None, got {size!r}")
    out = Path(folder).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    paths: list[Path] = []
    for i in range(count):
        spec = _crop_spec(i, split, seed)
        img = Image.fromarray(_crop(spec))
        if size is not None:
            img = img.resize((size, size), Image.Resampling.BICUBIC)
        path = out / f"{split}_{i:05d}_{spec.photo}.{fmt}"
        if fmt == "png":
            img.save(path, format="PNG")
        else:
            img.save(path, format="JPEG", quality=95)
        paths.append(path)
    return paths
