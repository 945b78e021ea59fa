"""CPU classes a quantized model is built for, and how to detect the one we run on.

ONNX Runtime's u8 x s8 integer kernels (``QLinearConv``, ``QGemm``, ``QLinearMatMul``,
``MatMulInteger``, ``MatMulIntegerToFloat``, ``DynamicQuantizeMatMul``) compute differently on
different x86 CPUs:

* ``x86-vnni`` — AVX512-VNNI, AVX-VNNI or AMX: ``vpdpbusd`` adds four u8*s8 products straight into
  an int32 accumulator: exact for every input.
* ``x86-avx2`` — AVX2, or AVX-512 without VNNI: ``vpmaddubsw`` adds each *pair* of adjacent u8*s8
  products (along the reduction axis K) into a **saturating int16** before widening to int32.  A
  pair whose sum leaves ``[-32768, 32767]`` is clipped and the result silently differs from the QDQ
  math.  See :mod:`quantkit.scheme.saturation`.
* ``arm64`` — NEON ``sdot``/``udot`` or widening multiplies into int32: exact.
* ``portable`` — not a CPU but a promise: the model must be exact on every class above, which today
  means obeying the ``x86-avx2`` pair bound.

``auto`` (the default of a recipe's ``target.isa``) resolves to the class of the running CPU.
"""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from quantkit.errors import RecipeError

__all__ = [
    "CPU_CLASSES",
    "ISA_CHOICES",
    "CpuInfo",
    "Target",
    "cpu_class_saturates",
    "detect_cpu",
    "resolve_target",
]

CPU_CLASSES: tuple[str, ...] = ("x86-vnni", "x86-avx2", "arm64")
"""The classes of CPU whose integer kernels quantkit models (see the module docstring)."""

ISA_CHOICES: tuple[str, ...] = ("auto", "portable", *CPU_CLASSES)
"""What a recipe's ``target.isa`` accepts."""

_SATURATING = frozenset({"x86-avx2"})
_VNNI_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8", "avx_vnni_int8")


def cpu_class_saturates(cpu_class: str) -> bool:
    """True when the u8*s8 kernels of ``cpu_class`` add product pairs in saturating int16."""
    if cpu_class not in CPU_CLASSES:
        raise RecipeError(f"unknown CPU class {cpu_class!r}; allowed: {list(CPU_CLASSES)}")
    return cpu_class in _SATURATING


@dataclass(frozen=True)
class CpuInfo:
    """The running CPU: its model name, the ISA flags that matter for int8, and its class."""

    model_name: str
    machine: str
    flags: tuple[str, ...]
    cpu_class: str

    def as_dict(self) -> dict[str, object]:
        return {"model_name": self.model_name, "machine": self.machine, "flags": list(self.flags),
                "cpu_class": self.cpu_class}


def classify(machine: str, flags: set[str]) -> str:
    """The CPU class of a machine (``platform.machine()``) with these ``/proc/cpuinfo`` flags."""
    m = machine.lower()
    if m in ("aarch64", "arm64"):
        return "arm64"
    if any(f in flags for f in _VNNI_FLAGS):
        return "x86-vnni"
    return "x86-avx2"


def detect_cpu() -> CpuInfo:
    """The running CPU, from ``/proc/cpuinfo`` (Linux); elsewhere the saturating x86 class is assumed,
    the safe guess (a model built for it is exact on every class).

    The environment variable ``QUANTKIT_CPU_CLASS`` (one of :data:`CPU_CLASSES`) overrides the detected
    class: ``auto`` targets then build for that class (used by the tests to run both paths on one CPU)."""
    info = _read_cpu()
    forced = os.environ.get("QUANTKIT_CPU_CLASS")
    if forced:
        if forced not in CPU_CLASSES:
            raise RecipeError(f"QUANTKIT_CPU_CLASS={forced!r}; allowed: {list(CPU_CLASSES)}")
        return CpuInfo(info.model_name, info.machine, info.flags, forced)
    return info


@lru_cache(maxsize=1)
def _read_cpu() -> CpuInfo:
    machine = platform.machine()
    name = platform.processor() or machine
    flags: set[str] = set()
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        text = ""
    for line in text.splitlines():
        key, _, val = line.partition(":")
        key = key.strip().lower()
        if key == "model name" and name in ("", machine, platform.processor()):
            name = val.strip()
        elif key in ("flags", "features") and not flags:
            flags = set(val.split())
    interesting = tuple(sorted(f for f in flags if f in (*_VNNI_FLAGS, "avx2", "avx512f", "avx512bw", "asimddp")))
    return CpuInfo(model_name=name, machine=machine, flags=interesting, cpu_class=classify(machine, flags))


@dataclass(frozen=True)
class Target:
    """What a model is lowered for.  ``isa`` as written in the recipe; ``cpu_class`` what it resolved to
    (``portable`` stays ``portable``)."""

    device: str
    isa: str
    cpu_class: str

    @property
    def pair_safe(self) -> bool:
        """Whether int8 weights must obey the int16 pair bound (exact on saturating CPUs)."""
        return self.cpu_class == "portable" or cpu_class_saturates(self.cpu_class)

    def as_dict(self) -> dict[str, str]:
        return {"device": self.device, "isa": self.isa, "cpu_class": self.cpu_class}


def resolve_target(isa: str = "auto", device: str = "cpu") -> Target:
    """Turn a recipe's ``target`` into a :class:`Target` (``auto`` = the running CPU's class)."""
    if device != "cpu":
        raise RecipeError(f"target.device {device!r}; allowed: ['cpu']")
    if isa not in ISA_CHOICES:
        raise RecipeError(f"target.isa {isa!r}; allowed: {list(ISA_CHOICES)}")
    cls = detect_cpu().cpu_class if isa == "auto" else isa
    return Target(device=device, isa=isa, cpu_class=cls)
