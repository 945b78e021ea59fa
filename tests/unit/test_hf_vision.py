"""Hugging Face vision folders (image classification, semantic segmentation, bare backbones) are exported with
the folder's own image preprocessing: the ONNX model computes what the torch model computes, image data is
prepared exactly as the folder's processor prepares it unless the recipe names another preprocessing, and
folders quantkit cannot feed are refused saying what to do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx_ir as ir
import onnxruntime as ort
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from quantkit.data import make_dataset  # noqa: E402
from quantkit.data.base import InputInfo  # noqa: E402
from quantkit.data.photos import write_sample_photos  # noqa: E402
from quantkit.errors import DataError, ModelError  # noqa: E402
from quantkit.frontends import load_model  # noqa: E402
from quantkit.frontends.checkpoint import check_config_values  # noqa: E402
from quantkit.frontends.hf_folder import detect_task  # noqa: E402
from quantkit.frontends.vision import FolderImageProcessor  # noqa: E402


def _vit_config(**kw: object) -> object:
    return transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, intermediate_size=64, **kw)


def _processor(folder: Path) -> None:
    # resize 48 -> crop 32 (a crop the processor does, not quantkit's efficientnet default), ImageNet statistics
    transformers.ConvNextImageProcessor(size={"shortest_edge": 32}, crop_pct=0.75, image_mean=[0.485, 0.456, 0.406],
                                        image_std=[0.229, 0.224, 0.225]).save_pretrained(folder)


@pytest.fixture(scope="module")
def vit_classifier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("vit_cls")
    torch.manual_seed(0)
    config = _vit_config(num_labels=5)
    config.architectures = ["ViTForImageClassification"]
    transformers.ViTForImageClassification(config).eval().save_pretrained(folder)
    _processor(folder)
    return folder


@pytest.fixture(scope="module")
def photos(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("photos")
    write_sample_photos(folder, 6, "calibration", format="png")
    return folder


def test_the_folder_is_detected_as_vision_and_exported_with_its_head(vit_classifier: Path, photos: Path) -> None:
    assert detect_task(vit_classifier) == "vision"
    loaded = load_model(vit_classifier)
    assert isinstance(loaded.tokenizer, FolderImageProcessor) and loaded.kind == "hf" and loaded.graph == ""
    assert [v.name for v in loaded.model.graph.inputs] == ["pixel_values"]
    assert [v.name for v in loaded.model.graph.outputs] == ["logits"]
    shape = [d if isinstance(d, int) else None for d in loaded.model.graph.inputs[0].shape]
    assert shape == [None, 3, 32, 32]
    # the ONNX model computes the torch model's logits on a real photo prepared by the folder's processor
    from PIL import Image

    image = Image.open(sorted(photos.iterdir())[0])
    hf_proc = transformers.AutoImageProcessor.from_pretrained(str(vit_classifier), backend="pil")
    ref_pixels = hf_proc(images=image.convert("RGB"), return_tensors="np")["pixel_values"].astype(np.float32)
    np.testing.assert_array_equal(loaded.tokenizer(image)[None], ref_pixels)
    hf = transformers.ViTForImageClassification.from_pretrained(str(vit_classifier), attn_implementation="eager")
    with torch.no_grad():
        want = hf(pixel_values=torch.from_numpy(ref_pixels)).logits.numpy()
    sess = ort.InferenceSession(ir.to_proto(loaded.model).SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(None, {"pixel_values": ref_pixels})[0]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_image_data_uses_the_folder_processor_unless_the_spec_names_another(vit_classifier: Path, photos: Path,
                                                                          caplog: pytest.LogCaptureFixture) -> None:
    proc = FolderImageProcessor(vit_classifier)
    assert proc.output_shape == (3, 32, 32) and proc.settings()["processor"].startswith("ConvNextImageProcessor")
    inputs = [InputInfo("pixel_values", "float32", (None, 3, 32, 32))]
    own = make_dataset({"kind": "images", "path": str(photos)}, inputs=inputs, tokenizer=proc, split="calibration")
    named = make_dataset({"kind": "images", "path": str(photos), "preprocess": "model"}, inputs=inputs,
                         tokenizer=proc, split="calibration")
    a, b = next(iter(own.batches(6)))["pixel_values"], next(iter(named.batches(6)))["pixel_values"]
    np.testing.assert_array_equal(a, b)
    assert own.fingerprint() == named.fingerprint()
    # a preset the recipe names wins (with a warning), and gives other pixels and another fingerprint
    preset = make_dataset({"kind": "images", "path": str(photos), "preprocess": {"resize_short": 32, "crop": 32}},
                          inputs=inputs, tokenizer=proc, split="calibration")
    assert "ships its own image preprocessing" in caplog.text
    assert not np.allclose(next(iter(preset.batches(6)))["pixel_values"], a)
    assert preset.fingerprint() != own.fingerprint()
    # sample photos take it too
    sample = make_dataset({"kind": "sample_photos", "count": 2}, inputs=inputs, tokenizer=proc, split="evaluation")
    assert next(iter(sample.batches(2)))["pixel_values"].shape == (2, 3, 32, 32)


def test_data_that_does_not_fit_a_vision_model_is_refused_by_name(vit_classifier: Path) -> None:
    proc = FolderImageProcessor(vit_classifier)
    inputs = [InputInfo("pixel_values", "float32", (None, 3, 32, 32))]
    with pytest.raises(DataError, match=r"this model takes images \(pixel_values\).*images, sample_photos, npz"):
        make_dataset({"kind": "text", "source": "pydoc"}, inputs=inputs, tokenizer=proc, split="calibration")
    with pytest.raises(DataError, match=r"preprocess 'model' is the image processor of a Hugging Face vision folder.*"
                                        r"allowed: efficientnet, imagenet"):
        make_dataset({"kind": "sample_photos", "count": 2, "preprocess": "model"},
                     inputs=[InputInfo("x", "float32", (None, 3, 224, 224))], tokenizer=None, split="calibration")


def test_a_backbone_folder_exports_its_hidden_state_and_pooler(tmp_path: Path) -> None:
    torch.manual_seed(0)
    config = _vit_config()
    config.architectures = ["ViTModel"]
    transformers.ViTModel(config).eval().save_pretrained(tmp_path)
    _processor(tmp_path)
    assert detect_task(tmp_path) == "vision"
    loaded = load_model(tmp_path)
    assert [v.name for v in loaded.model.graph.outputs] == ["last_hidden_state", "pooler_output"]


def test_vision_folders_quantkit_cannot_feed_are_refused_saying_what_to_do(tmp_path: Path) -> None:
    config = _vit_config(num_labels=3)
    config.architectures = ["ViTForImageClassification"]
    transformers.ViTForImageClassification(config).save_pretrained(tmp_path / "no_processor")
    with pytest.raises(ModelError, match=r"vision model \(ViTForImageClassification\) without image preprocessing "
                                         r"settings \(preprocessor_config.json\).*save_pretrained"):
        load_model(tmp_path / "no_processor")
    # a processor whose output size follows the image (shortest edge, no crop) cannot be batched
    transformers.ViTForImageClassification(config).save_pretrained(tmp_path / "free_size")
    transformers.BitImageProcessor(size={"shortest_edge": 32}, do_center_crop=False).save_pretrained(
        tmp_path / "free_size")
    with pytest.raises(ModelError, match=r"makes inputs whose size depends on the image.*export the model yourself"):
        load_model(tmp_path / "free_size")
    # a detection head is not exported from a folder
    (tmp_path / "det").mkdir()
    (tmp_path / "det" / "config.json").write_text('{"architectures": ["DetrForObjectDetection"], '
                                                   '"model_type": "detr"}')
    with pytest.raises(ModelError, match=r"holds a vision model \(DetrForObjectDetection\).*export it to ONNX"):
        load_model(tmp_path / "det")


def test_per_stage_sizes_of_vision_configs_are_checked_element_by_element() -> None:
    check_config_values({"num_attention_heads": [1, 2, 5, 8], "hidden_size": 64}, "config.json")
    with pytest.raises(ModelError, match=r"num_attention_heads \[1, 0\] is out of range.*one per stage"):
        check_config_values({"num_attention_heads": [1, 0]}, "config.json")


@pytest.mark.slow
def test_a_vision_folder_quantizes_through_the_cli_with_its_own_preprocessing(tmp_path: Path, photos: Path) -> None:
    """The user's path: a recipe naming the folder and a folder of photos, nothing about preprocessing."""
    torch.manual_seed(0)
    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic",
                                       num_labels=10)
    config.architectures = ["ResNetForImageClassification"]
    model = transformers.ResNetForImageClassification(config).train()
    with torch.no_grad():  # BatchNorm statistics from random batches, as a trained model has them
        for _ in range(4):
            model(torch.randn(8, 3, 32, 32))
    model.eval().save_pretrained(tmp_path / "resnet")
    _processor(tmp_path / "resnet")
    recipe = tmp_path / "r.yaml"
    recipe.write_text(
        f"version: 1\nname: resnet\nmodel: {{source: {tmp_path / 'resnet'}}}\n"
        f"calibration: {{data: {{kind: images, path: {photos}}}}}\n"
        "evaluation: {data: {kind: sample_photos, count: 8}}\n"
        "report: {latency: {enabled: false}}\n")
    from quantkit.cli import main

    assert main(["calibrate", "--recipe", str(recipe), "--output", str(tmp_path / "out"), "--quiet"]) == 0
    import json

    report = json.loads((tmp_path / "out" / "report.json").read_text())
    fid = report["quality"]["fidelity"]["logits"]
    assert fid["sqnr_db"] > 25, fid
    census = report["census"]
    assert census["leftover_by_kind"]["stray"] == 0 and census["quantized_kernels"]["QLinearConv"] >= 5, census
    # the report says which preprocessing the folder brought
    assert "pixel_values [None, 3, 32, 32]; image processor ConvNextImageProcessor" in report["model_read_from"]
