"""Models staged on disk for sessions (quantkit.staging): same results as serialized bytes, the model left as it was,
variants and sub-models over the same weights, and the folder gone when the area closes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from quantkit.api import quantize
from quantkit.evaluate.latency import make_session
from quantkit.lowering.kernel_check import kernel_vs_reference
from quantkit.pipeline import fidelity_and_layer_sqnr
from quantkit.staging import STAGE_PREFIX, StageArea
from quantkit.tempdirs import MARKER
from tests.conftest import image_batches, tiny_cnn
from tests.unit.test_target import _conv_with_wrapping_bias

RECIPE = {"version": 1, "name": "unit", "report": {"latency": {"enabled": False, "guard": False}}}


def test_a_staged_model_runs_as_its_bytes_do_and_is_left_unchanged(tmp_path: Path) -> None:
    proto = tiny_cnn(seed=3)
    model = ir.from_proto(proto)
    before = {name: v.const_value.numpy().copy() for name, v in model.graph.initializers.items()}
    feed = image_batches(1)[0]
    with StageArea(str(tmp_path), size_threshold=0) as area:
        assert area.folder.name.startswith(STAGE_PREFIX) and (area.folder / MARKER).is_file()
        staged = area.stage(model, "m-")
        graph = staged.graph()
        assert graph.graph.initializer and all(
            t.data_location == onnx.TensorProto.EXTERNAL for t in graph.graph.initializer)
        assert len(Path(staged.path).read_bytes()) < len(proto.SerializeToString())  # the weights are elsewhere
        want = make_session(proto.SerializeToString()).run(None, feed)
        got = make_session(staged.path).run(None, feed)
        for w, g in zip(want, got, strict=True):
            np.testing.assert_array_equal(w, g)
        inner = proto.graph.node[1].output[0]
        sess = make_session(staged.variant([inner]))
        assert [o.name for o in sess.get_outputs()][-1] == inner
        np.testing.assert_array_equal(
            sess.run([inner], feed)[0],
            make_session(staged.variant([inner])).run([inner], feed)[0])  # one file per set of outputs, reused
        digest = area.digest(staged)
        assert area.digest(area.stage(model, "again-")) == digest  # the same content, the same key
        for name, v in model.graph.initializers.items():  # staging did not touch the in-memory model
            np.testing.assert_array_equal(v.const_value.numpy(), before[name])
        changed = ir.from_proto(tiny_cnn(seed=4))
        assert area.digest(area.stage(changed, "other-")) != digest
        folder = area.folder
    assert not folder.exists()


def test_kernel_check_and_fidelity_are_the_same_on_a_staged_model(tmp_path: Path) -> None:
    res = quantize(tiny_cnn(seed=1), image_batches(8), RECIPE, evaluate=False, progress=False)
    qproto = ir.to_proto(res.model)
    fproto = ir.to_proto(res.float_model)
    feeds = [{"input": f["input"][:1]} for f in image_batches(4, seed=9)]
    plain = kernel_vs_reference(qproto, feeds, samples=4).as_dict()
    ev = image_batches(4, seed=7)
    from quantkit.data import as_dataset, model_inputs

    ds = as_dataset(ev, model_inputs(res.float_model))
    fid, sq = fidelity_and_layer_sqnr(fproto, qproto, res.plan, ds, limit=4)
    with StageArea(str(tmp_path), size_threshold=0) as area:
        q_staged = area.stage(res.model, "q-")
        f_staged = area.stage(res.float_model, "f-")
        assert kernel_vs_reference(qproto, feeds, samples=4, staged=q_staged).as_dict() == plain
        fid_s, sq_s = fidelity_and_layer_sqnr(fproto, qproto, res.plan, ds, limit=4, float_staged=f_staged,
                                              quant_staged=q_staged)
    assert sq_s == sq and sq
    assert fid_s == fid


def test_the_kernel_check_fills_the_per_layer_probe_with_the_same_figures(tmp_path: Path) -> None:
    """The per-layer SQNR from the kernel check's QDQ-math runs equals the probe's own runs, and the evaluation then
    runs no quantized sample for it; token feeds the check cuts are not observed."""
    from quantkit.data import as_dataset, model_inputs
    from quantkit.pipeline import layer_probe, verify_kernels
    from quantkit.scheme.target import resolve_target

    res = quantize(tiny_cnn(seed=2), image_batches(8), RECIPE, evaluate=False, progress=False)
    qproto, fproto = ir.to_proto(res.model), ir.to_proto(res.float_model)
    ds = as_dataset(image_batches(6, seed=5), model_inputs(res.float_model))
    fid, sq = fidelity_and_layer_sqnr(fproto, qproto, res.plan, ds, limit=4)
    with StageArea(str(tmp_path), size_threshold=0) as area:
        q_staged = area.stage(res.model, "q-")
        f_staged = area.stage(res.float_model, "f-")
        probe = layer_probe(fproto, qproto, res.plan, limit=4, float_staged=f_staged, quant_staged=q_staged)
        assert probe is not None
        kernels = verify_kernels(qproto, resolve_target("auto", "cpu"), ds, 16, staged=q_staged, probe=probe)
        assert probe.observed == 4 and not probe.wants_more()
        assert probe._s_q is None  # the probe never opened a quantized session of its own
        fid_p, sq_p = fidelity_and_layer_sqnr(fproto, qproto, res.plan, ds, limit=4, float_staged=f_staged,
                                              quant_staged=q_staged, probe=probe)
    assert kernels["check"]["samples"] >= 4
    assert sq_p.keys() == sq.keys() and sq
    for layer, db in sq.items():
        assert sq_p[layer] == pytest.approx(db, abs=1e-9)
    # the FP32 reference of the first samples came from the exposed FP32 session there and from the plain one
    # here (exposing tensors blocks float fusions: rounding-level differences)
    assert fid_p.keys() == fid.keys()
    for out, row in fid.items():
        assert fid_p[out] == pytest.approx(row, rel=1e-5)


def test_fp32_outputs_are_computed_once_per_sample_and_reused_by_a_second_evaluation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel check's FP32 runs hand the fidelity pass their outputs, and a second plan's evaluation of the
    same float model (a latency guard's re-run) runs no FP32 sample at all: same figures."""
    import quantkit.pipeline as pipeline
    from quantkit.data import as_dataset, model_inputs
    from quantkit.pipeline import Fp32Outputs, graph_key, layer_probe, verify_kernels
    from quantkit.scheme.target import resolve_target

    res = quantize(tiny_cnn(seed=2), image_batches(8), RECIPE, evaluate=False, progress=False)
    qproto, fproto = ir.to_proto(res.model), ir.to_proto(res.float_model)
    ds = as_dataset(image_batches(6, seed=5), model_inputs(res.float_model))
    fid, sq = fidelity_and_layer_sqnr(fproto, qproto, res.plan, ds, limit=4)
    store: dict = {}
    opened: list[str] = []
    real = pipeline.make_session

    def counting(model: bytes | str, **kw: object) -> object:
        opened.append("float" if model == f_staged.path else "other")
        return real(model, **kw)

    monkeypatch.setattr(pipeline, "make_session", counting)
    with StageArea(str(tmp_path), size_threshold=0) as area:
        q_staged = area.stage(res.model, "q-")
        f_staged = area.stage(res.float_model, "f-")
        probe = layer_probe(fproto, qproto, res.plan, limit=8, float_staged=f_staged, quant_staged=q_staged)
        assert probe is not None
        memo = Fp32Outputs(store, graph_key(fproto))
        probe.memo = memo
        verify_kernels(qproto, resolve_target("auto", "cpu"), ds, 16, staged=q_staged, probe=probe)
        fid1, _ = fidelity_and_layer_sqnr(fproto, qproto, res.plan, ds, limit=8, float_staged=f_staged,
                                          quant_staged=q_staged, probe=probe, memo=memo)
        assert memo.hits == 8  # the probe's 8 observed samples (the first batch): FP32 ran only the others
        assert opened.count("float") == 1
        opened.clear()
        again = Fp32Outputs(store, graph_key(fproto))  # the re-run: another job, the same artifacts
        fid2, _ = fidelity_and_layer_sqnr(fproto, qproto, res.plan, ds, limit=0, float_staged=f_staged,
                                          quant_staged=q_staged, memo=again)
        assert again.hits == len(ds) and "float" not in opened  # no FP32 session at all
        # another float graph (a Gemm rewritten for another plan) shares nothing
        other = onnx.ModelProto()
        other.CopyFrom(fproto)
        other.graph.node[0].name = "renamed"
        assert Fp32Outputs(store, graph_key(other)).get(next(iter(ds.batches(1))), ["logits"]) is None
    for out, row in fid.items():
        assert fid1[out] == pytest.approx(row, rel=1e-5)
        assert fid2[out] == pytest.approx(fid1[out], rel=1e-6)  # the exposed session's rounding on some samples


def test_a_staged_kernel_check_still_names_the_layer_whose_kernel_parts(tmp_path: Path) -> None:
    """The layer-alone sub-models reference the staged weights: the wrapping int32 bias is still caught."""
    model = _conv_with_wrapping_bias()
    feeds = [{"x": np.random.default_rng(i).uniform(0, 5, (1, 4, 8, 8)).astype(np.float32)} for i in range(2)]
    with StageArea(str(tmp_path), size_threshold=0) as area:
        chk = kernel_vs_reference(model, feeds, samples=2, staged=area.stage(ir.from_proto(model), "w-"))
    assert not chk.agree
    assert chk.first_parted is not None and chk.first_parted["layer"] == "conv" and chk.first_parted["off"] > 0.1


def test_a_run_leaves_no_stage_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # re-read TMPDIR
    quantize(tiny_cnn(seed=2), image_batches(4), RECIPE, evaluation_data=image_batches(2, seed=5), progress=False)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(STAGE_PREFIX)]
