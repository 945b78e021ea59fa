"""The recipe schema (version 1): what a user may write in a recipe YAML file.

Validated at the edge with pydantic (``extra="forbid"``) and turned once into the
frozen :class:`quantkit.recipe.plan.Recipe`.  Every validation failure is raised as a
:class:`~quantkit.errors.RecipeError` whose message names the key path, the value
received and what is allowed.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

SCHEMA_VERSION = 1

ActDType = Literal["uint8", "int8"]
WeightDType = Literal["int8", "uint8"]
Format = Literal["int8", "int4", "int8_weight", "int8_dynamic", "fp16", "bf16", "fp32"]
"""int8: static W8A8 QDQ; int4 / int8_weight: weight-only (MatMulNBits); int8_dynamic: W8A8 with per-token
activation scales computed at run time (MatMulIntegerToFloat); fp16 / bf16: 16-bit weight storage; fp32:
keep.  Any mix of them can live in one model (linear-layer formats apply to MatMul / Gemm layers)."""
Calibrator = str  # validated against the calibrator registry when the plan is built
Metric = Literal["auto", "classification", "embedding", "sqnr"]


MAX_TOKENS = 131_072
"""The longest token sequence any recipe setting may ask for (latency ``seq_len`` / ``long_prefill``,
sensitivity ``seq_len``): 128k tokens, the longest LLM context in common use."""


def _check_pattern(pattern: str) -> None:
    """A user regex must compile (:func:`quantkit.recipe.patterns.compile_pattern`); ValueError otherwise."""
    from quantkit.errors import RecipeError
    from quantkit.recipe.patterns import compile_pattern

    try:
        compile_pattern(pattern, "")
    except RecipeError as exc:
        raise ValueError(str(exc)) from None


def _check_op_type(op: str) -> None:
    """An ``op_type`` that is no ONNX operator but one in another case or with one typo (``conv``, ``Matmul``,
    ``MatMull``) is refused naming it: it would match no node, silently.  Other names (a custom domain's op)
    pass: a recipe may be shared by models that lack the op."""
    import difflib

    import onnx.defs

    names = {sc.name for sc in onnx.defs.get_all_schemas_with_history()} | {
        "MatMulNBits", "GatherBlockQuantized", "MatMulIntegerToFloat", "QGemm", "GroupQueryAttention", "Attention",
        "MultiHeadAttention", "SkipLayerNormalization", "SkipSimplifiedLayerNormalization", "FusedConv", "FusedMatMul",
        "QLinearConv", "QLinearMatMul", "QLinearAdd", "QLinearMul", "QLinearSigmoid", "QLinearConcat"}
    if op in names:
        return
    near = [n for n in names if n.lower() == op.lower()] or difflib.get_close_matches(op, sorted(names), n=1,
                                                                                        cutoff=0.9)
    if near:
        raise ValueError(f"op_type {op!r} is not an ONNX operator; did you mean {near[0]!r}? (op types are "
                         f"case-sensitive)")


def _power_of_two_group(v: int | None) -> int | None:
    if v is not None and v & (v - 1):
        raise ValueError(
            f"group_size {v} must be a power of two (MatMulNBits blocks); allowed: 16, 32, ... or null"
        )
    return v


def _scalar_kinds(annotation: Any) -> set[str]:
    """The scalar kinds a field's annotation admits: ``int``, ``float``, ``bool``, ``str``, and ``=<value>`` for
    each string of a ``Literal``, through ``Optional`` / unions / ``Annotated``; empty for anything else."""
    import typing

    origin = typing.get_origin(annotation)
    if origin is typing.Annotated:
        return _scalar_kinds(typing.get_args(annotation)[0])
    if origin is Literal:
        return {f"={a}" if isinstance(a, str) else "bool" if isinstance(a, bool) else "int"
                for a in typing.get_args(annotation)}
    if origin is not None and origin not in (list, dict, tuple, set):  # a union (X | Y, Optional[X])
        out: set[str] = set()
        for a in typing.get_args(annotation):
            out |= _scalar_kinds(a)
        return out
    return {t.__name__ for t in (int, float, bool, str) if annotation is t}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_coercion(cls, v: Any, info: ValidationInfo) -> Any:
        """A number or switch written as something else is refused, not coerced: ``batch_size: true`` (was 1),
        ``batch_size: "8"``, ``layerwise: "yes"`` / ``1`` (were True), ``enabled: "false"`` (was False)."""
        name = info.field_name
        if v is None or name is None or name not in cls.model_fields:
            return v
        if any(name in d.info.fields and d.info.mode != "after"
               for k, d in cls.__pydantic_decorators__.field_validators.items() if k != "_no_coercion"):
            return v  # the field's own validator reads the raw input (smoothquant: off)
        kinds = _scalar_kinds(cls.model_fields[name].annotation)
        words = {k for k in kinds if k.startswith("=")}
        kinds -= words
        if not kinds or not kinds <= {"int", "float", "bool", "str"}:
            return v
        if isinstance(v, bool):
            bad = "bool" not in kinds
        elif isinstance(v, (int, float)):
            bad = not kinds & {"int", "float"}
        elif isinstance(v, str):
            bad = "str" not in kinds and f"={v}" not in words
        else:
            return v
        if bad:
            wanted = " or ".join(sorted({"int": "an integer", "float": "a number", "bool": "true / false",
                                         "str": "text"}[k] for k in kinds) + sorted(repr(w[1:]) for w in words))
            raise ValueError(f"{v!r} ({type(v).__name__}) is not accepted; allowed: {wanted}")
        return v


class ModelSection(_Strict):
    """Where the model comes from: a built-in name, an ONNX file or a Hugging Face folder."""

    source: str = Field(min_length=1)
    seq_len: int = Field(128, ge=1, le=8192, description="sequence length used to export text models")
    graph: Literal["auto", "decoder", "full_sequence"] = Field(
        "auto",
        description="causal LMs: 'decoder' = the KV-cache decoder built from the weights (GroupQueryAttention, "
        "fused RMSNorm; quantized, evaluated and timed with its cache), 'full_sequence' = the torch-exported "
        "input_ids -> logits graph without a cache, 'auto' = decoder for LLaMA-family models, else the export",
    )

    @model_validator(mode="after")
    def _source_carries_graph(self) -> ModelSection:
        # The loader reads the graph from the source string (quantkit.frontends.ModelSource), so every
        # caller that hands rec.model.source to load_model gets the recipe's graph.
        from quantkit.frontends import ModelSource

        if getattr(self.source, "graph", None) != self.graph:
            object.__setattr__(self, "source", ModelSource(str(self.source), self.graph))
        return self


class DataSection(_Strict):
    """A dataset description handed to :func:`quantkit.data.make_dataset` (``kind`` plus its options).

    Its integer options are range-checked here, so ``quantkit validate`` refuses them: ``count`` 1 to
    100000, ``seq_len`` 2 to 131072, ``seed`` / ``offset`` >= 0, ``seconds`` / ``hop`` numbers
    (:data:`quantkit.data.factory.SPEC_INT_RANGES`, :data:`~quantkit.data.factory.SPEC_FLOAT_RANGES`).
    """

    model_config = ConfigDict(extra="allow", frozen=True)
    kind: Literal["sample_photos", "images", "npz", "text", "audio"]

    @model_validator(mode="after")
    def _int_ranges(self) -> DataSection:
        from quantkit.data.factory import check_spec_ints
        from quantkit.errors import DataError

        try:
            check_spec_ints({"kind": self.kind, **(self.model_extra or {})})
        except DataError as exc:
            raise ValueError(str(exc)) from None
        return self


class CalibrationSection(_Strict):
    data: DataSection | None = None  # may be omitted when the Python API is given the data
    batch_size: int = Field(1, ge=1, le=4096)
    # auto: mse's and minmax's ranges, the one whose emitted model is closer to FP32 on calibration samples
    # kept (mse alone: best on EfficientNet-Lite0 and MiniLM; minmax wins on some CNNs, e.g. ShuffleNetV2)
    calibrator: Calibrator = "auto"
    calibrator_options: dict[str, Any] = Field(default_factory=dict)
    max_batch_output_bytes: int = Field(
        512 * 2**20, ge=2**20, description="memory budget for exposed activations per pass (chunking)"
    )
    sequential: bool = Field(
        True, description="weight-only GPTQ/AWQ: later decoder blocks see the already-quantized earlier ones"
    )
    stages: int = Field(
        8,
        ge=1,
        le=1024,
        description="weight-only sequential mode: dependency levels are grouped into at most this many passes",
    )
    max_rows: int = Field(
        4096, ge=64, le=1 << 16, description="weight-only: activation rows kept per layer input for AWQ"
    )
    layerwise: bool | Literal["auto"] = Field(
        "auto",
        description="decoder LLMs (the families quantkit's builder supports): true = build, calibrate and quantize "
        "block by block while the checkpoint streams (bounded memory; formats int4 / int8_weight / fp32; "
        "resumable); false = the whole-graph path (FP32 model in memory; every format, search), run only when its "
        "estimated peak memory fits; auto = streamed whenever the recipe can be, else the whole graph when it fits",
    )
    histogram_bins: int = Field(8192, ge=256, le=1 << 16, description="streaming histogram bins per tensor")
    cache: bool = Field(True, description="reuse collected statistics from the on-disk cache")


class WeightScheme(_Strict):
    dtype: WeightDType = "int8"
    symmetric: bool = True
    granularity: Literal["channel", "tensor"] = "channel"


class ActivationScheme(_Strict):
    dtype: ActDType = "uint8"
    symmetric: bool = False


def _smoothquant_bool(v: Any, off: Any) -> Any:
    """YAML reads an unquoted ``off`` / ``no`` / ``false`` as False (and ``on`` / ``yes`` as True): False means
    no smoothing, never alpha 0.0 by way of bool -> float; True says nothing about alpha and is refused."""
    if v is False:
        return off
    if v is True:
        raise ValueError("smoothquant: true is ambiguous; allowed: a number in [0, 1], 'auto' or 'off'")
    return v


def _smoothquant_alpha(v: Any) -> Any:
    if isinstance(v, float) and not 0.0 <= v <= 1.0:
        raise ValueError(f"smoothquant alpha {v} is outside [0, 1]; allowed: a number in [0, 1], 'auto' or 'off'")
    return v


class LayerScheme(_Strict):
    """The scheme of one layer (the default, or one override)."""

    format: Format = "int8"
    weights: WeightScheme = WeightScheme()
    activations: ActivationScheme = ActivationScheme()
    calibrator: Calibrator | None = None
    group_size: int | None = Field(
        128, ge=16, description="weight-only group size along K; null = per channel"
    )
    algorithm: str = Field("rtn", description="weight-only algorithm: rtn | gptq | awq")
    algorithm_options: dict[str, Any] = Field(default_factory=dict)
    smoothquant: float | Literal["auto", "off"] = Field(
        "auto", description="int8_dynamic: SmoothQuant alpha in [0, 1], 'auto' (chosen per group of layers that "
        "share an input, 'no smoothing' included) or 'off'")
    granularity: Literal["per_token", "per_tensor"] = Field(
        "per_token", description="int8_dynamic: activation scale per token (row) or one per tensor")
    compute: Literal["storage", "native"] = Field(
        "storage", description="fp16 / bf16: 'storage' = 16-bit weights cast to fp32 once; 'native' = "
        "activations cast to 16 bits around the layer")

    _alpha_range = field_validator("smoothquant")(classmethod(lambda cls, v: _smoothquant_alpha(v)))
    _alpha_bool = field_validator("smoothquant", mode="before")(classmethod(lambda cls, v: _smoothquant_bool(v, "off")))

    @field_validator("group_size")
    @classmethod
    def _pow2(cls, v: int | None) -> int | None:
        return _power_of_two_group(v)


class Override(_Strict):
    """A per-layer override.  Exactly one of ``layer`` (exact node name), ``pattern`` (regex, searched in
    node names and module paths with a time limit: :mod:`quantkit.recipe.patterns`) and ``op_type``."""

    layer: str | None = None
    pattern: str | None = None
    op_type: str | None = None
    format: Format | None = None
    weights: WeightScheme | None = None
    activations: ActivationScheme | None = None
    calibrator: Calibrator | None = None
    group_size: int | None = Field(None, ge=16)
    per_channel: bool | None = Field(None, description="weight-only: one group per output channel")
    algorithm: str | None = None
    algorithm_options: dict[str, Any] | None = None
    smoothquant: float | Literal["auto", "off"] | None = None
    granularity: Literal["per_token", "per_tensor"] | None = None
    compute: Literal["storage", "native"] | None = None
    hot_rows: int | None = Field(
        None, ge=0,
        description="the lm_head or the input embedding at int4, layer-wise build: the N vocabulary rows most "
                    "frequent in the calibration tokens are stored at 8 bits (a second MatMulNBits / "
                    "GatherBlockQuantized; the order is kept), the rest at 4 bits. 0 or null: none",
    )

    _alpha_range = field_validator("smoothquant")(classmethod(lambda cls, v: _smoothquant_alpha(v)))
    _alpha_bool = field_validator("smoothquant", mode="before")(classmethod(lambda cls, v: _smoothquant_bool(v, "off")))

    @model_validator(mode="after")
    def _one_selector(self) -> Override:
        given = [k for k in ("layer", "pattern", "op_type") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(
                f"an override needs exactly one of 'layer', 'pattern', 'op_type'; got {given or 'none'}"
            )
        if self.pattern is not None:
            _check_pattern(self.pattern)
        if self.op_type is not None:
            _check_op_type(self.op_type)
        if self.hot_rows and self.layer is None:
            raise ValueError(f"hot_rows splits the vocabulary rows of one layer (the lm_head or the input embedding): "
                             f"it needs 'layer:'; got { {k: getattr(self, k) for k in given} }")
        return self


CLASS_KEYS: tuple[str, ...] = ("x86-vnni", "x86-avx2", "arm64", "portable")
"""The keys of ``quantization.by_cpu_class``: the CPU classes of ``target.isa`` (``auto`` resolves to one of the
first three) and ``portable``."""


class ClassScheme(_Strict):
    """What ``quantization.by_cpu_class`` may change in the default scheme for one CPU class: the weight-only grid
    (group size and weight scheme), whose decode speed depends on the CPU's kernels."""

    group_size: int | None = Field(None, ge=16, description="replaces quantization.default.group_size")
    weights: WeightScheme | None = Field(None, description="replaces quantization.default.weights")

    @field_validator("group_size")
    @classmethod
    def _pow2(cls, v: int | None) -> int | None:
        return _power_of_two_group(v)


class QuantizationSection(_Strict):
    default: LayerScheme = LayerScheme()
    op_types: Literal["auto"] | list[str] = "auto"
    overrides: list[Override] = Field(default_factory=list)
    by_cpu_class: dict[str, ClassScheme] = Field(
        default_factory=dict,
        description="per CPU class (the class target.isa names; auto: the running CPU's), a group_size and / or "
        "weights that replace the default's before any layer is resolved; an override's own values still win. "
        "Keys: x86-vnni, x86-avx2, arm64, portable",
    )
    fold_clip_ranges: bool = Field(
        True,
        description="quantize Relu/Clip outputs on [lo, hi] so ONNX Runtime can drop the activation (exact)",
    )
    bias_correction: bool = Field(
        True, description="shift each output channel's bias by the mean error weight quantization introduces"
    )
    quantize_outputs: bool = Field(
        False, description="also quantize graph outputs of MatMul/Gemm (False keeps logits in float)"
    )
    rotation: Literal["none", "hadamard"] = Field(
        "none",
        description="decoder LLMs built layer-wise, of a family whose residual stream meets only pre-norm RMSNorms "
        "(docs/llm-families.md): 'hadamard' rotates the residual stream by a randomized Hadamard matrix and each "
        "value / o_proj head by a smaller one, folded into the weights before they are quantized (exact in FP32; "
        "norm gammas folded into the linears, the lm_head stored apart from a tied embedding); 'none' keeps the "
        "weights as they are",
    )
    rotation_seed: int = Field(
        0, ge=0, le=2**32 - 1, description="the seed of the rotation's random signs (quantization.rotation: hadamard)"
    )

    @field_validator("op_types")
    @classmethod
    def _known_ops(cls, v: Any) -> Any:
        from quantkit.ops import QUANTIZABLE_OPS

        if isinstance(v, list):
            bad = [o for o in v if o not in QUANTIZABLE_OPS]
            if bad:
                raise ValueError(f"unsupported op types {bad}; allowed: {sorted(QUANTIZABLE_OPS)}")
        return v

    @field_validator("by_cpu_class")
    @classmethod
    def _known_classes(cls, v: dict[str, ClassScheme]) -> dict[str, ClassScheme]:
        bad = sorted(k for k in v if k not in CLASS_KEYS)
        if bad:
            raise ValueError(f"unknown CPU class {bad}; allowed: {list(CLASS_KEYS)}")
        return v


class GreedyAgreementSection(_Strict):
    prompts: int = Field(
        64, ge=1, le=4096,
        description="prompts cut from the evaluation windows at fixed, evenly spaced offsets (the same every run)",
    )
    prompt_tokens: int = Field(32, ge=1, le=MAX_TOKENS, description="tokens per prompt")
    tokens: int = Field(32, ge=1, le=4096, description="tokens each model generates greedily after every prompt")
    batch: int = Field(
        16, ge=1, le=1024,
        description="prompts decoded together (1: one at a time, as quantkit generate decodes; larger is faster). "
        "At accuracy_level 4 the quantized model's tokens depend on it: the int8 rounding of activations turns the "
        "float rounding differences between batch sizes into different tokens (the report's self_consistency "
        "measures that noise)",
    )


class EvaluationSection(_Strict):
    data: DataSection | None = None
    greedy_agreement: GreedyAgreementSection | None = Field(
        default_factory=GreedyAgreementSection,
        description="causal LMs: the FP32 and the quantized model each decode greedily after the same prompts; "
        "the report gives the share of tokens generated before the first divergence, the share of positions "
        "whose tokens agree, the quantized model's agreement when fed FP32's tokens, and the prompts decoded "
        "identically (quality.greedy_agreement). null: skip",
    )
    extra: list[DataSection] = Field(
        default_factory=list, max_length=8,
        description="causal LMs: more held-out texts (other domains); perplexity on each, FP32 vs quantized",
    )
    metric: Metric = "auto"
    fidelity_guard: bool = Field(
        True,
        description="models judged by output fidelity (not causal LMs): when an output of the emitted model is below "
        "20 dB SQNR against FP32 and the report's verdict names layers to keep in "
        "float, re-run the plan with them in float and ship that model if its worst output SQNR is at least 6 dB "
        "better (at most 2 rounds, at most half of the quantized layers; quantkit.fidelity_guard; every figure in "
        "the report's fidelity_guard). false: ship the plan as built, the verdict stays a warning",
    )
    perplexity: bool = Field(True, description="causal LMs: perplexity on the evaluation windows")
    batch_size: int = Field(8, ge=1, le=4096)
    fp32_baseline: Literal["auto", "whole", "streamed", "off"] = Field(
        "auto",
        description="decoders streamed block by block (calibration.layerwise): how the FP32 model that perplexity "
        "and latency are compared with is run. whole: the FP32 decoder built and held whole (refused before any "
        "work when it cannot fit); streamed: memory of about one block - the FP32 perplexity computed block by "
        "block (equal to the whole decoder's), latency timed on the FP32 and quantized decoders truncated to the "
        "first k blocks that fit the run's own peak (the ratios say 'measured on k of L blocks'); off: no FP32 "
        "figures; auto: whole when the FP32 weights are no larger than the streamed run's own estimated peak "
        "(so the baseline at most about doubles the run's memory), else streamed. The report's fp32_baseline "
        "says which and why",
    )


class LatencySection(_Strict):
    """Latency measurement; every count is bounded so that a typo cannot make a run time out for hours."""

    enabled: bool = True
    batch_size: int = Field(1, ge=1, le=4096)
    seq_len: int | None = Field(None, ge=1, le=MAX_TOKENS)
    warmup: int = Field(5, ge=0, le=10_000)
    repeat: int = Field(30, ge=1, le=10_000)
    threads: int | None = Field(None, ge=1, le=1024)
    long_prefill: int | None = Field(
        1024, ge=1, le=MAX_TOKENS,
        description="causal LMs with a KV cache: also time a prefill this long (None: skip)",
    )
    guard: bool = Field(
        True,
        description="static INT8: profile the FP32 and the int8 model per layer region (interleaved rounds); when "
        "some regions are slower in int8 in every round, re-run the plan with those layers in float, time both "
        "models against each other and ship the guarded one only if it is faster by a sign test and a margin "
        "(quantkit.guard; the decision, cached per int8 model and machine, and every figure in the report's "
        "latency_guard). false: ship the plan as built",
    )


class ExportSection(_Strict):
    external_data: Literal["auto", "always", "never"] = "auto"
    weight_only_form: Literal["matmulnbits", "dq"] = Field(
        "matmulnbits",
        description="com.microsoft.MatMulNBits, or the standard opset-21 blocked DequantizeLinear -> MatMul",
    )
    accuracy_level: Literal["auto", 0, 1, 2, 3, 4] = Field(
        "auto",
        description="MatMulNBits accuracy_level: 4 quantizes activations to int8 per block, 0 computes in float "
        "(exact); auto: built at 4, then level 0 is timed against it (prefill and decode) on this CPU when it is "
        "the target's class and latency is measured, and the faster ships; otherwise the target class's default "
        "(4; 0 for portable). The report's int4_kernel says which and why",
    )
    w4a8_max_error_ratio: float | None = Field(
        1.5, gt=1.0, le=1e6,
        description="LLMs built layer-wise with MatMulNBits at accuracy_level 4 (int8 activations): every 4-bit "
        "layer also runs at level 4 and at level 0 on its calibration inputs; where level 4's output error is more "
        "than this many times the weight-only error (||Y4 - Y|| / ||Y0 - Y||, Y the float product), the layers "
        "reading that input are kept at level 0 (report: w4a8_check and each layer's accuracy_level). null: no check",
    )
    kv_cache: Literal["float32", "int8"] = Field(
        "float32",
        description="LLM decoders built layer-wise: the element type of the KV cache (past_key_values.* / present.*). "
        "int8: GroupQueryAttention stores keys (after the rotary embedding) and values as int8 with per-layer, "
        "per-KV-head, per-channel scales calibrated on calibration.data (the shipped decoder's largest |K| / |V| "
        "over the windows / 127; rotated key channels one scale per rotary pair): a quarter of the float32 cache's "
        "bytes (docs/llm-layerwise.md, 'KV cache precision')",
    )
    activation_storage: Literal["uint8", "as_requested"] = Field(
        "uint8",
        description="store int8-grid activations as uint8 (zero point + 128, bit-identical) - what ONNX "
        "Runtime's CPU kernels compute in; 'as_requested' keeps int8 Q/DQ for other execution providers",
    )
    matmul_form: Literal["fused", "qdq"] = Field(
        "fused",
        description="float-output MatMul layers as one com.microsoft.MatMulIntegerToFloat with the bias "
        "folded in ('fused', ONNX Runtime) or as standard DQ -> MatMul -> Add ('qdq', any runtime)",
    )


class ReportSection(_Strict):
    formats: list[Literal["json", "md", "html"]] = Field(default_factory=lambda: ["json", "md"])  # type: ignore[arg-type]
    latency: LatencySection = LatencySection()
    kernel_check_samples: int = Field(
        16, ge=0, le=4096,
        description="evaluation samples run both with this CPU's fused int8 kernels and as the QDQ reference "
        "(ORT_DISABLE_ALL) to check that they agree; 0 skips the check",
    )


CandidateFormat = Literal["fp32", "fp16", "bf16", "int8", "int8_dynamic", "int8_weight", "int4"]
"""Formats a search may give a layer: fp32 (keep); fp16 / bf16 (weights stored in 16 bits); int8
(static W8A8 QDQ); int8_dynamic (W8A8, activations quantized at run time, SmoothQuant); int8_weight /
int4 (weight-only, MatMulNBits)."""


class Candidate(_Strict):
    """One candidate format of a mixed-precision search (``name`` is how reports refer to it)."""

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.+-]+$")
    format: CandidateFormat
    group_size: int | None = Field(
        None, ge=16, description="int4 / int8_weight: group size (default: the recipe's)"
    )
    per_channel: bool = Field(False, description="int4 / int8_weight: one group per output channel")
    algorithm: str | None = Field(
        None, description="int4 / int8_weight: rtn | gptq | awq (default: the recipe's)"
    )
    algorithm_options: dict[str, Any] | None = None
    granularity: Literal["per_token", "per_tensor"] = Field(
        "per_token", description="int8_dynamic: activation scale per token (row) or one per tensor"
    )
    smoothquant: float | Literal["auto"] | None = Field(
        "auto",
        description="int8_dynamic: SmoothQuant alpha in [0, 1], 'auto' (searched per layer group) or null",
    )
    compute: Literal["storage", "native"] = Field(
        "storage",
        description="fp16 / bf16: 'storage' = 16-bit weights cast to fp32 once (ONNX Runtime CPU has no fp16/bf16 "
        "MatMul); 'native' = activations cast to 16 bits around the layer (CUDA / TensorRT providers)",
    )

    @field_validator("group_size")
    @classmethod
    def _pow2(cls, v: int | None) -> int | None:
        return _power_of_two_group(v)

    @field_validator("smoothquant", mode="before")
    @classmethod
    def _alpha_bool(cls, v: Any) -> Any:
        return _smoothquant_bool(v, None)

    @field_validator("smoothquant")
    @classmethod
    def _alpha(cls, v: Any) -> Any:
        if isinstance(v, float) and not 0.0 <= v <= 1.0:
            raise ValueError(
                f"smoothquant alpha {v} is outside [0, 1]; allowed: a number in [0, 1], 'auto' or null"
            )
        return v


class SensitivitySection(_Strict):
    samples: int = Field(
        2, ge=1, le=4096, description="calibration samples used to measure each layer's damage"
    )
    seq_len: int | None = Field(
        256, ge=2, le=MAX_TOKENS, description="text models: tokens per sample (None: as in the data)"
    )
    metric: Literal["auto", "kl", "mse"] = Field(
        "auto",
        description="damage: mean KL divergence of the output distribution (kl: logits) or relative output MSE "
        "(mse: embeddings, regression); auto = kl when the model's first output is 'logits' or the evaluation "
        "metric is classification, else mse",
    )
    measure: Literal["all", "scaled"] = Field(
        "all",
        description="all: every (layer, candidate) damage is measured; scaled (linear layers): per layer group only "
        "the weight-only candidate with the largest input-weighted rounding error is measured and the group's "
        "other weight-only candidates get that damage times their error ratio (one run per group instead of one "
        "per candidate)",
    )


class SearchSection(_Strict):
    """Per-layer mixed precision: sensitivity x cost, an integer program, the Pareto front."""

    candidates: list[str | Candidate] = Field(min_length=1)
    metric: Literal["size", "latency"] = Field("size", description="the cost axis of the front")
    points: int = Field(
        5, ge=0, le=64, description="frontier points to emit and evaluate, spread along the front"
    )
    budgets: list[float | str] = Field(
        default_factory=list,
        description="extra points at these budgets of `metric`: a fraction of FP32 (0.3), 'uniform:<candidate>' "
        "(the cost of that candidate everywhere) or 'between:<a>:<b>:<t>' (t of the way from uniform a to b)",
    )
    include_uniform: bool = Field(
        True, description="also emit and evaluate every candidate applied uniformly"
    )
    target: dict[Literal["size", "latency", "damage"], float | str] | None = Field(
        None,
        description="the one point `quantkit calibrate` / quantize() emits: {size: B} or {latency: B} (least "
        "predicted damage within the budget B, written as in `budgets`), or {damage: D} (cheapest in `metric` "
        "with predicted damage <= D: a number, or 'uniform:<candidate>')",
    )
    tie: Literal["shared_input", "none"] = Field(
        "shared_input",
        description="layers reading one input (q/k/v, gate/up) share a format (one smoothing scale)",
    )
    layers: str | None = Field(
        None, description="regex: only matching layers are searched (default: all); matched with a time limit "
        "(quantkit.recipe.patterns)",
    )
    sensitivity: SensitivitySection = SensitivitySection()
    frontier_points: int = Field(
        24, ge=2, le=512, description="budgets tried when tracing the predicted front"
    )
    time_limit_s: float = Field(10.0, gt=0, le=3600, description="per integer-program solve")

    @field_validator("layers")
    @classmethod
    def _layers_regex(cls, v: str | None) -> str | None:
        if v is not None:
            _check_pattern(v)
        return v

    @field_validator("candidates")
    @classmethod
    def _names(cls, v: list[Any]) -> list[Any]:
        allowed = list(CandidateFormat.__args__)  # type: ignore[attr-defined]
        names = []
        for c in v:
            if isinstance(c, str) and c not in allowed:
                raise ValueError(
                    f"unknown candidate {c!r}; allowed shorthands: {allowed} (or a mapping with name/format)"
                )
            names.append(c if isinstance(c, str) else c.name)
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"candidate names must be unique; repeated: {dup}")
        return v

    @field_validator("budgets")
    @classmethod
    def _budgets(cls, v: list[Any]) -> list[Any]:
        for b in v:
            if isinstance(b, str) and not (b.startswith("uniform:") or b.startswith("between:")):
                raise ValueError(
                    f"budget {b!r}: allowed: a number, 'uniform:<candidate>', 'between:<a>:<b>:<t>'"
                )
            if isinstance(b, (int, float)) and b <= 0:
                raise ValueError(f"budget {b!r} must be > 0 (a fraction of the FP32 cost)")
        return v

    @field_validator("target")
    @classmethod
    def _target(cls, v: Any) -> Any:
        if v is None:
            return v
        if len(v) != 1:
            raise ValueError(
                f"target needs exactly one of 'size', 'latency', 'damage'; got {sorted(v) or 'none'}"
            )
        cls._budgets(list(v.values()))
        return v

    def candidate_list(self) -> list[Candidate]:
        return [Candidate(name=c, format=c) if isinstance(c, str) else c for c in self.candidates]


class TargetSection(_Strict):
    """The CPU the model is for (ONNX Runtime's int8 kernels compute differently per CPU class)."""

    device: Literal["cpu"] = "cpu"
    isa: Literal["auto", "portable", "x86-vnni", "x86-avx2", "arm64"] = Field(
        "auto",
        description="auto: the running CPU's class; x86-avx2: x86 without VNNI (int8 weights obey the int16 "
        "pair bound so the saturating kernels stay exact); x86-vnni: VNNI/AVX-VNNI/AMX; arm64; portable: exact "
        "on every class",
    )


class RecipeModel(_Strict):
    """The whole recipe file."""

    version: Literal[1]
    name: str = Field(
        "recipe",
        description="the run's name; the default output folder is out/<name>, so it is a plain name: letters, "
        "digits and _ . + - (no path separators, not starting with a dot)",
    )
    _origin: str | None = PrivateAttr(None)  # the recipe file it was loaded from (an input of the run)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, v: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}", v) or v in (".", ".."):
            raise ValueError(
                f"{v!r} is not a plain name; allowed: 1-128 letters, digits and _ . + - , not starting with a dot "
                "or separator (it names the default output folder out/<name>)"
            )
        return v
    model: ModelSection | None = None  # may be omitted when the Python API is given the model
    calibration: CalibrationSection = CalibrationSection()
    quantization: QuantizationSection = QuantizationSection()
    evaluation: EvaluationSection = EvaluationSection()
    export: ExportSection = ExportSection()
    report: ReportSection = ReportSection()
    search: SearchSection | None = None
    target: TargetSection = TargetSection()
