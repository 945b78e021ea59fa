"""Models staged on disk for ONNX Runtime sessions: the weights written once, every session and variant sharing them.

A run opens many sessions on the same two models (FP32 and quantized): calibration exposing every tensor, the
calibrator choice, the kernel check, the fidelity pass and its per-layer probe, latency, the latency guard.  Made
from serialized bytes, each costs a protobuf serialization of the whole model plus ONNX Runtime parsing and copying
it again (a 266 MB DistilBERT: ~1.2 s to serialize, ~1.3 s per session).  Staged, the model is written once as a
small graph file plus one external-data file of aligned weights (``onnx_ir.save``); a session opens the path
(ONNX Runtime maps the weights: ~0.14 s for the same model) and a variant (extra graph outputs, a sub-model of some
layers) is another small graph file in the same folder naming the same weights.

The folder is made with :func:`quantkit.tempdirs.owned_tempdir` (a marker proves it is quantkit's, so a killed
run's folder is removed by the next run and nothing else ever is) and removed when the :class:`StageArea` closes.
"""

from __future__ import annotations

import itertools
import logging
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import onnx
import onnx_ir as ir

from quantkit.tempdirs import clean_stale, owned_tempdir

__all__ = ["STAGE_PREFIX", "StageArea", "StagedModel"]

log = logging.getLogger("quantkit")

STAGE_PREFIX = ".quantkit-sessions-"
"""Prefix of a stage folder in the system's temporary directory."""


class StagedModel:
    """One model in a :class:`StageArea`: ``path`` (give it to :func:`quantkit.evaluate.latency.make_session`),
    ``graph()`` (the small graph proto whose initializers name the external weights) and :meth:`variant` /
    :meth:`write` (more graphs over the same weights)."""

    def __init__(self, area: StageArea, stem: str) -> None:
        self.area = area
        self.stem = stem
        self.path = str(area.folder / f"{stem}.onnx")
        self._graph: onnx.ModelProto | None = None
        self._variants: dict[tuple[str, ...], str] = {}

    def graph(self) -> onnx.ModelProto:
        """The staged graph (weights external: cheap to copy and to serialize); do not edit it, copy it."""
        if self._graph is None:
            self._graph = onnx.load(self.path, load_external_data=False)
        return self._graph

    def variant(self, outputs: Sequence[str]) -> str:
        """Path of this model with ``outputs`` as extra graph outputs (made once per set of outputs)."""
        key = tuple(dict.fromkeys(outputs))
        if key not in self._variants:
            m = onnx.ModelProto()
            m.CopyFrom(self.graph())
            have = {o.name for o in m.graph.output}
            for t in key:
                if t not in have:
                    m.graph.output.append(onnx.helper.make_empty_tensor_value_info(t))
                    have.add(t)
            self._variants[key] = self.write(m, "variant")
        return self._variants[key]

    def write(self, proto: onnx.ModelProto, tag: str) -> str:
        """Write ``proto`` (a graph over this area's weights: initializers copied from :meth:`graph`) into the
        area; its path."""
        return self.area.write(proto, f"{self.stem}-{tag}")


class StageArea:
    """A private folder of staged models (module doc); a context manager that removes it on exit."""

    def __init__(self, parent: str | None = None, *, size_threshold: int = 1024) -> None:
        root = Path(parent or tempfile.gettempdir())
        self.size_threshold = size_threshold  # tensors of at least this many bytes go to the weights file
        clean_stale(root, STAGE_PREFIX)  # a killed run's stage folder, proven quantkit's and orphaned
        self.folder = owned_tempdir(root, STAGE_PREFIX)
        self._count = itertools.count()
        self.closed = False

    def stage(self, model: ir.Model, stem: str) -> StagedModel:
        """Write ``model`` (left unchanged) into the area: its graph file and its weights file."""
        stem = f"{stem}{next(self._count)}"
        ir.save(model, self.folder / f"{stem}.onnx", external_data=f"{stem}.weights", size_threshold_bytes=self.size_threshold)
        return StagedModel(self, stem)

    def write(self, proto: onnx.ModelProto, stem: str) -> str:
        """Write a graph proto whose external weights lie in this area; its path."""
        return self.write_bytes(proto.SerializeToString(), stem)

    def digest(self, staged: StagedModel) -> str:
        """SHA-256 of a staged model's content: its graph (the weights file's name left out, which differs
        between stagings) and its weights file - the same model staged twice has the same digest."""
        import hashlib

        h = hashlib.sha256()
        from onnx.external_data_helper import _get_all_tensors

        graph = onnx.ModelProto()
        graph.CopyFrom(staged.graph())
        for t in _get_all_tensors(graph):  # subgraphs' tensors too
            for e in t.external_data:
                if e.key == "location":
                    e.value = ""
        h.update(graph.SerializeToString(deterministic=True))
        path = self.folder / f"{staged.stem}.weights"
        if path.exists():
            with open(path, "rb") as fh:
                while chunk := fh.read(1 << 22):
                    h.update(chunk)
        return h.hexdigest()

    def write_bytes(self, data: bytes, stem: str) -> str:
        """Write a serialized graph whose external weights lie in this area; its path."""
        path = self.folder / f"{stem}{next(self._count)}.onnx"
        path.write_bytes(data)
        return str(path)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            shutil.rmtree(self.folder, ignore_errors=True)

    def __enter__(self) -> StageArea:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
