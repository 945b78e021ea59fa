"""Image preprocessing and the image-folder dataset.

Preprocessing, in order (torchvision's ``Resize`` + ``CenterCrop`` + ``Normalize`` conventions):

1. convert to RGB;
2. resize so that the short side is ``resize_short`` (long side ``int(long * s / short)``);
3. centre crop ``crop`` x ``crop`` (top/left offsets ``round((size - crop) / 2)``);
4. ``x = (pixel / 255 - mean) / std`` per channel, float32;
5. lay out as CHW (``"NCHW"``) or HWC (``"NHWC"``).

A Hugging Face vision folder brings its own preprocessing
(:class:`quantkit.frontends.vision.FolderImageProcessor`, the ``preprocess`` name ``model``): every function
here that takes a :class:`Preprocess` takes one of those too (same ``output_shape`` / ``layout`` / ``settings()``
/ call).
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np
from PIL import Image

from quantkit.data.base import check_batch_size, hash_file, new_hasher
from quantkit.errors import DataError

if TYPE_CHECKING:
    from quantkit.frontends.vision import FolderImageProcessor

__all__ = [
    "IMAGE_SUFFIXES",
    "MODEL_PRESET",
    "PRESETS",
    "ImagePreprocess",
    "ImageFolderDataset",
    "Preprocess",
    "get_preprocess",
    "is_folder_processor",
    "list_images",
    "load_image",
    "preprocess_image",
]

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".bmp", ".webp")
_RESAMPLE = {"bicubic": Image.Resampling.BICUBIC, "bilinear": Image.Resampling.BILINEAR}
_LAYOUTS = ("NCHW", "NHWC")


@dataclass(frozen=True)
class Preprocess:
    """How a photo becomes a model input (see the module docstring for the math)."""

    resize_short: int = 256
    resize_mode: str = "bicubic"
    crop: int = 224
    mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    layout: str = "NCHW"

    def __post_init__(self) -> None:
        if self.resize_mode not in _RESAMPLE:
            raise DataError(
                f"preprocess resize_mode {self.resize_mode!r} is not allowed; allowed: {sorted(_RESAMPLE)}"
            )
        if self.layout not in _LAYOUTS:
            raise DataError(f"preprocess layout {self.layout!r} is not allowed; allowed: {list(_LAYOUTS)}")
        for key in ("resize_short", "crop"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise DataError(f"preprocess {key} must be a positive integer, got {v!r}")
        if self.crop > self.resize_short:
            raise DataError(f"preprocess crop {self.crop} is larger than resize_short {self.resize_short}")
        for key in ("mean", "std"):
            v = getattr(self, key)
            if len(v) != 3:
                raise DataError(f"preprocess {key} must have 3 values (R, G, B), got {v!r}")
            object.__setattr__(self, key, tuple(float(x) for x in v))
        if any(s == 0 for s in self.std):
            raise DataError(f"preprocess std must be non-zero, got {self.std}")

    @property
    def output_shape(self) -> tuple[int, int, int]:
        """Shape of one preprocessed sample (no batch dim)."""
        return (3, self.crop, self.crop) if self.layout == "NCHW" else (self.crop, self.crop, 3)

    def settings(self) -> dict[str, Any]:
        """Plain dict of the fields (for fingerprints and reports)."""
        return asdict(self)

    def __call__(self, image: Image.Image) -> np.ndarray:
        """Apply the steps of the module docstring to one PIL image."""
        img = image.convert("RGB")
        w, h = img.size
        s = self.resize_short
        size = (s, int(h * s / w)) if w <= h else (int(w * s / h), s)
        if size != (w, h):
            img = img.resize(size, _RESAMPLE[self.resize_mode])
        w, h = img.size
        c = self.crop
        top = int(round((h - c) / 2.0))
        left = int(round((w - c) / 2.0))
        img = img.crop((left, top, left + c, top + c))
        x: np.ndarray = np.asarray(img, dtype=np.float32) / np.float32(255.0)
        x = (x - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        if self.layout == "NCHW":
            x = x.transpose(2, 0, 1)
        return np.ascontiguousarray(x, dtype=np.float32)


ImagePreprocess = Union[Preprocess, "FolderImageProcessor"]
"""Either quantkit's own preprocessing or the one a Hugging Face vision folder ships."""

MODEL_PRESET = "model"
"""The ``preprocess`` name of the model's own preprocessing (a Hugging Face folder's image processor)."""


PRESETS: dict[str, Preprocess] = {
    # EfficientNet-Lite (TF-Hub / lukemelas): bicubic 256, crop 224, x in [-1, 1].
    "efficientnet": Preprocess(256, "bicubic", 224, (0.5, 0.5, 0.5), (0.5, 0.5, 0.5), "NCHW"),
    # torchvision ImageNet models.
    "imagenet": Preprocess(256, "bilinear", 224, (0.485, 0.456, 0.406), (0.229, 0.224, 0.225), "NCHW"),
}


def get_preprocess(spec: str | ImagePreprocess | Mapping[str, Any]) -> ImagePreprocess:
    """A :class:`Preprocess` from a preset name, an instance, or a dict of fields (a folder's own processor is
    returned as it is).

    A dict may name a ``preset`` to start from and override some fields, e.g.
    ``{"preset": "imagenet", "layout": "NHWC"}``.

    Raises:
        DataError: unknown preset name or field; ``model`` (the model's own preprocessing) where no model
            processor was resolved.
    """
    if isinstance(spec, Preprocess) or is_folder_processor(spec):
        return spec  # type: ignore[return-value]
    if spec == MODEL_PRESET:
        raise DataError(
            f"preprocess {MODEL_PRESET!r} is the image processor of a Hugging Face vision folder "
            "(preprocessor_config.json); this model has none; allowed: "
            f"{', '.join(sorted(PRESETS))} or a mapping of {sorted(f.name for f in fields(Preprocess))}"
        )
    if isinstance(spec, str):
        if spec not in PRESETS:
            raise DataError(
                f"unknown preprocess preset {spec!r}; known presets: {', '.join(sorted(PRESETS))}"
            )
        return PRESETS[spec]
    if isinstance(spec, Mapping):
        allowed = {f.name for f in fields(Preprocess)}
        extra = sorted(set(spec) - allowed - {"preset"})
        if extra:
            raise DataError(f"unknown preprocess key(s) {extra}; allowed: {sorted(allowed | {'preset'})}")
        base = get_preprocess(spec["preset"]) if "preset" in spec else Preprocess()
        if not isinstance(base, Preprocess):
            raise DataError(f"preprocess preset {spec['preset']!r} cannot be changed field by field; allowed "
                            f"presets here: {', '.join(sorted(PRESETS))}")
        values = {**base.settings(), **{k: v for k, v in spec.items() if k != "preset"}}
        for key in ("mean", "std"):
            if isinstance(values[key], (list, tuple)):
                values[key] = tuple(values[key])
        return Preprocess(**values)
    raise DataError(f"preprocess must be a preset name, a Preprocess or a dict; got {type(spec).__name__}")


def is_folder_processor(obj: Any) -> bool:
    """Whether ``obj`` is a Hugging Face folder's image processor (the model's own preprocessing)."""
    from quantkit.frontends.vision import FolderImageProcessor

    return isinstance(obj, FolderImageProcessor)


def preprocess_image(image: Image.Image | np.ndarray, pre: ImagePreprocess) -> np.ndarray:
    """Apply ``pre`` to one image (PIL or uint8 HxW / HxWx3 / HxWx4 array); float32 CHW or HWC."""
    if isinstance(image, np.ndarray):
        image = Image.fromarray(to_rgb_uint8(image))
    return pre(image)


def to_rgb_uint8(a: np.ndarray) -> np.ndarray:
    """A uint8 HxWx3 array from a bool/uint8 grayscale, RGB or RGBA array."""
    if a.dtype == np.bool_:
        a = a.astype(np.uint8) * 255
    if a.dtype != np.uint8:
        raise DataError(f"expected a uint8 or bool image array, got {a.dtype}")
    if a.ndim == 2:
        a = np.stack([a, a, a], axis=-1)
    if a.ndim != 3 or a.shape[2] not in (3, 4):
        raise DataError(f"expected an HxW, HxWx3 or HxWx4 image array, got shape {a.shape}")
    return np.ascontiguousarray(a[:, :, :3])


def list_images(folder: str | os.PathLike[str]) -> list[Path]:
    """Image files under ``folder`` (recursive), sorted by relative path.

    Raises:
        DataError: the folder does not exist or holds no images.
    """
    root = Path(folder).expanduser()
    if not root.is_dir():
        raise DataError(f"image folder {str(root)!r} does not exist or is not a folder")
    files = sorted(
        (p for p in root.rglob("*") if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise DataError(f"image folder {str(root)!r} contains no {'/'.join(IMAGE_SUFFIXES)} files")
    return files


def _bomb_pixels(exc: Exception) -> str:
    """The pixel count PIL names in a DecompressionBombError ("Image size (400000000 pixels) exceeds ...")."""
    found = re.search(r"\((\d+) pixels\)", str(exc))
    return f"{int(found.group(1))} pixels" if found else "too many pixels"


def load_image(path: Path, pre: ImagePreprocess) -> np.ndarray:
    """Decode one image file and apply ``pre``.

    Images larger than Pillow's decompression-bomb limit (``2 x PIL.Image.MAX_IMAGE_PIXELS``, about 179
    million pixels by default; a Python user may raise ``PIL.Image.MAX_IMAGE_PIXELS``) are refused from
    their header, before any pixel is decoded.

    Raises:
        DataError: naming the file: not an image, truncated or corrupt, or too many pixels (with its pixel
            count and the limit).
    """
    try:
        with Image.open(path) as img:
            return preprocess_image(img, pre)
    except Image.DecompressionBombError as e:
        limit = 2 * Image.MAX_IMAGE_PIXELS if Image.MAX_IMAGE_PIXELS else None
        raise DataError(
            f"image {str(path)!r} has {_bomb_pixels(e)}; allowed: at most {limit} pixels (Pillow's "
            "decompression-bomb limit, 2 x PIL.Image.MAX_IMAGE_PIXELS); shrink the image"
        ) from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error) as e:
        raise DataError(f"cannot read image {str(path)!r} (not an image, truncated or corrupt): {e}") from e


class ImageFolderDataset:
    """Preprocessed photos from a folder, decoded one batch at a time."""

    def __init__(
        self,
        folder: str | os.PathLike[str],
        input_name: str,
        preprocess: str | ImagePreprocess | Mapping[str, Any] = "efficientnet",
        limit: int | None = None,
        seed: int = 0,
    ) -> None:
        """List the images; with ``limit`` keep a random subset of that size drawn with ``seed``.

        The subset keeps the sorted order.  Raises DataError for a bad folder or limit.
        """
        files = list_images(folder)
        self.root = Path(folder).expanduser()
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
                raise DataError(f"image folder limit must be a positive integer, got {limit!r}")
            if limit < len(files):
                keep = np.random.default_rng(seed).choice(len(files), size=limit, replace=False)
                files = [files[i] for i in sorted(keep)]
        self.files: Sequence[Path] = files
        self.input_name = input_name
        self.preprocess = get_preprocess(preprocess)
        self.limit = limit
        self.seed = seed
        self._fp: str | None = None

    def batches(self, batch_size: int) -> Iterator[dict[str, np.ndarray]]:
        """Decode and preprocess ``batch_size`` files at a time."""
        check_batch_size(batch_size)
        for start in range(0, len(self.files), batch_size):
            arrays = [self._load(p) for p in self.files[start : start + batch_size]]
            yield {self.input_name: np.stack(arrays)}

    def _load(self, path: Path) -> np.ndarray:
        """Decode and preprocess one file (see :func:`load_image`)."""
        return load_image(path, self.preprocess)

    def __len__(self) -> int:
        return len(self.files)

    def fingerprint(self) -> str:
        """sha256 over preprocessing settings, relative file names and file bytes."""
        if self._fp is None:
            h = new_hasher("images", {"input": self.input_name, "preprocess": self.preprocess.settings()})
            for p in self.files:
                h.update(p.relative_to(self.root).as_posix().encode() + b"|")
                hash_file(h, p)
            self._fp = h.hexdigest()
        return self._fp
