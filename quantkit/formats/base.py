"""What a format handler is, and the state one execution of a precision plan shares between handlers.

A **format handler** owns the formats of one family (see :mod:`quantkit.formats`): it declares the
statistics it needs, picks its layers out of a :class:`~quantkit.recipe.plan.PrecisionPlan`, lowers them
into the quantized model, and gives the rows of its report section.  Handlers never see each other;
the boundary each one needs with its neighbours is local to its layers:

* float formats read and write float tensors (no boundary);
* static INT8 owns the Q/DQ edges of its chains: an int8 chain starts with a ``QuantizeLinear`` of a
  float tensor and ends in a ``DequantizeLinear`` (or a float-output kernel), so it meets any other
  format on a float tensor;
* weight-only and dynamic INT8 layers take and produce float tensors (their quantization of the
  activations, if any, happens inside the kernel).

:class:`Artifacts` holds what one plan computed that another plan of the same model can reuse (the
search executes many plans of one model): activation ranges, input means, kernel-order Hessians,
weight-only results, SmoothQuant scales and codes.
"""

from __future__ import annotations

import abc
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import onnx
import onnx_ir as ir

from quantkit.recipe.plan import PrecisionPlan
from quantkit.recipe.schema import RecipeModel

if TYPE_CHECKING:
    from quantkit.data import Dataset
    from quantkit.lowering.qdq import LoweringResult
    from quantkit.lowering.select import QuantPlan
    from quantkit.scheme.target import Target
    from quantkit.staging import StageArea, StagedModel

__all__ = ["Artifacts", "FormatHandler", "Job", "Lowered"]


@dataclass
class Artifacts:
    """Reusable results of executing plans on one float model (keyed so a changed plan misses)."""

    ranges: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    means: dict[str, np.ndarray] = field(default_factory=dict)
    hessians: dict[str, Any] = field(default_factory=dict)  # layer -> BlockDiagonal (pair-safe rounding)
    pair_cache: dict[tuple[str, bytes], Any] = field(default_factory=dict)
    woq: dict[tuple[Any, ...], Any] = field(default_factory=dict)  # (layer, scheme key) -> WOQResult
    dynamic: dict[tuple[Any, ...], Any] = field(default_factory=dict)  # (layers, scheme key) -> DynamicArtifact
    absmax: dict[str, Any] = field(default_factory=dict)  # input tensor -> ChannelAbsMax
    calibration_info: dict[str, Any] = field(default_factory=dict)
    # the ``auto`` calibrator: candidate -> tensor -> range, and the run's choice (``calibrator_choice``)
    range_candidates: dict[str, dict[str, tuple[np.ndarray, np.ndarray]]] = field(default_factory=dict)
    calibrator_choice: dict[str, Any] = field(default_factory=dict)
    # the FP32 model's outputs per evaluation sample (quantkit.pipeline.Fp32Outputs): a second plan's evaluation
    # compares against them instead of running FP32 again
    fp32_outputs: dict[str, Any] = field(default_factory=dict)


@dataclass
class Job:
    """One execution of a precision plan: the float model, the plan, the data and the shared artifacts.

    ``float_model`` is the prepared float graph; handlers read it and never edit it (the linear-format
    rewrite of Gemm to MatMul + Add happens before, see :func:`quantkit.formats.execute.prepare_float`).
    """

    float_model: ir.Model
    plan: PrecisionPlan
    calibration: Dataset | None
    target: Target
    progress: bool = True
    use_cache: bool = True
    artifacts: Artifacts = field(default_factory=Artifacts)
    stage: StageArea | None = None  # where models are staged for sessions (quantkit.staging); None: bytes

    @property
    def recipe(self) -> RecipeModel:
        return self.plan.recipe

    @functools.cached_property
    def float_proto(self) -> onnx.ModelProto:
        return ir.to_proto(self.float_model)

    @functools.cached_property
    def float_bytes(self) -> bytes:
        return self.float_proto.SerializeToString()

    @functools.cached_property
    def float_staged(self) -> StagedModel | None:
        """The float model staged on disk (None without a stage area); handlers never edit the float model, so
        it is written once per job."""
        return None if self.stage is None else self.stage.stage(self.float_model, "fp32-")

    @property
    def float_source(self) -> bytes | str:
        """What a session of the float model opens: the staged path, else the serialized model."""
        staged = self.float_staged
        return staged.path if staged is not None else self.float_bytes

    def float_digest(self) -> str:
        """Content hash of the float model (statistics cache key)."""
        from quantkit.calibrate.cache import model_hash

        staged = self.float_staged
        if staged is not None:
            return staged.area.digest(staged)
        return model_hash(self.float_bytes)

    def stage_model(self, model: ir.Model, stem: str) -> bytes | str:
        """What a session of ``model`` opens: staged in this job's area, else serialized."""
        if self.stage is None:
            return ir.to_proto(model).SerializeToString()
        return self.stage.stage(model, stem).path


@dataclass
class Lowered:
    """The quantized model of a plan, and what each handler did (for the census and the report)."""

    model: ir.Model
    static: QuantPlan
    lowering: LoweringResult
    layers: dict[str, dict[str, str]] = field(default_factory=dict)  # handler name -> layer -> format
    sections: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # handler name -> report rows
    notes: dict[str, str] = field(default_factory=dict)
    zero_range: list[str] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    woq: Any = None  # the weight-only outcome (per-layer results), when the plan has such layers

    def fused_layers(self) -> list[str]:
        """Layers the census should find in a quantized kernel (float formats excluded)."""
        from quantkit.ops import PASSTHROUGH

        out = [k for k, lp in self.static.layers.items() if lp.op_type not in PASSTHROUGH]
        for handler, layers in self.layers.items():
            if handler in ("weight_only", "dynamic"):
                out += list(layers)
        return out

    def formats(self) -> dict[str, str]:
        """Every planned layer -> its format (static int8 layers included)."""
        out = {k: "int8" for k in self.static.layers}
        for layers in self.layers.values():
            out.update(layers)
        return out


class FormatHandler(abc.ABC):
    """Base class of the handlers registered in :data:`quantkit.formats.FORMAT_HANDLERS`."""

    name: ClassVar[str]
    formats: ClassVar[tuple[str, ...]]
    family: ClassVar[str]  # "float" | "static" | "dynamic" | "weight_only"
    needs: ClassVar[str]  # the statistics it gathers, for docs and reports
    boundary: ClassVar[str]  # what it needs from its neighbours

    @abc.abstractmethod
    def select(self, job: Job) -> dict[str, Any]:
        """The layers of ``job.plan`` this handler lowers (name -> whatever it needs later)."""

    @abc.abstractmethod
    def lower(self, job: Job, model: ir.Model, layers: dict[str, Any], out: Lowered) -> None:
        """Edit ``model`` in place for ``layers``; record rows/notes in ``out``."""
