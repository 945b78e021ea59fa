"""Calibration and evaluation data.

Every dataset implements :class:`Dataset`: ``batches(batch_size)`` yields feed dicts
``{onnx_input_name: array}`` lazily, ``len()`` counts samples, ``fingerprint()`` is a
sha256 over content and settings.

==================  ===========================================================
kind (recipe)       class
==================  ===========================================================
``sample_photos``   :class:`SamplePhotosDataset` -- crops of offline sample photos
``images``          :class:`ImageFolderDataset` -- a folder of jpg/png/bmp/webp
``npz``             :class:`NpzDataset` -- a .npz file or a folder of them
``text``            :class:`TextDataset` -- pydoc / a .txt file / strings, tokenised
(Python only)       :class:`IterableDataset`, :class:`ArrayDataset`
==================  ===========================================================

Data may carry class labels beside the inputs (an ``.npz`` array or a dict key named ``labels``, ``label``,
``targets``, ``target`` or ``y``; PyTorch's ``(inputs, target)`` items): ``labels()`` returns them, and the
evaluation reports accuracy against them (:func:`dataset_labels`).

A KV-cache decoder's ``past_key_values.*`` inputs are filled with empty past tensors
(:class:`KVCacheFeeds`) wherever a dataset is bound to a model's inputs.
"""

from quantkit.data.base import (
    LABEL_KEYS,
    ArrayDataset,
    Dataset,
    InputInfo,
    check_batch,
    class_labels,
    dataset_labels,
    model_inputs,
)
from quantkit.data.factory import DATASET_KINDS, as_dataset, make_dataset
from quantkit.data.images import PRESETS, ImageFolderDataset, Preprocess, get_preprocess, preprocess_image
from quantkit.data.iterable import IterableDataset
from quantkit.data.kv import KVCacheFeeds, bind_kv_cache
from quantkit.data.npz import NpzDataset
from quantkit.data.photos import (
    PHOTO_NAMES,
    CropSpec,
    SamplePhotosDataset,
    sample_photos,
    write_sample_photos,
)
from quantkit.data.text import TextDataset, load_text, split_sentences

__all__ = [
    "LABEL_KEYS",
    "class_labels",
    "dataset_labels",
    "DATASET_KINDS",
    "PHOTO_NAMES",
    "PRESETS",
    "ArrayDataset",
    "CropSpec",
    "Dataset",
    "ImageFolderDataset",
    "InputInfo",
    "IterableDataset",
    "KVCacheFeeds",
    "NpzDataset",
    "Preprocess",
    "SamplePhotosDataset",
    "TextDataset",
    "as_dataset",
    "bind_kv_cache",
    "check_batch",
    "get_preprocess",
    "load_text",
    "make_dataset",
    "model_inputs",
    "preprocess_image",
    "sample_photos",
    "split_sentences",
    "write_sample_photos",
]
