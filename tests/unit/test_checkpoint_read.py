"""quantkit reads safetensors checkpoints without torch: the values must be the bits the safetensors library
(with torch) gives, for every float dtype quantkit accepts, and a short file must fail naming the tensor's file."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from quantkit.errors import ModelError  # noqa: E402
from quantkit.frontends.checkpoint import read_tensor, safetensors_header  # noqa: E402


def _write(path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(37, 11, generator=g) * 3
    base[0, :4] = torch.tensor([0.0, -0.0, 1e-40, 6.5e4])  # zero signs, a subnormal, a large value
    tensors = {"a.bf16": base.to(torch.bfloat16), "b.f16": base.to(torch.float16), "c.f32": base,
               "d.f64": base.to(torch.float64), "e.vec": torch.randn(5, generator=g).to(torch.bfloat16)}
    safetensors_torch.save_file(tensors, str(path))
    return tensors


def test_read_tensor_gives_the_stored_bits_of_every_float_dtype(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    tensors = _write(path)
    header = safetensors_header(path)
    for name, ref in tensors.items():
        got = read_tensor(header[name])
        assert got.shape == tuple(ref.shape), name
        want = ref.to(torch.float64).numpy()
        np.testing.assert_array_equal(np.asarray(got, np.float64), want, err_msg=name)
        # bit for bit after the float32 conversion every reader of a checkpoint makes
        np.testing.assert_array_equal(np.asarray(got, np.float32).view(np.uint32),
                                      ref.to(torch.float32).numpy().view(np.uint32), err_msg=name)


def test_read_tensor_of_a_truncated_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    _write(path)
    header = safetensors_header(path)
    path.write_bytes(path.read_bytes()[: header["c.f32"].offset + 8])  # the header was read before the cut
    with pytest.raises(ModelError, match=r"m\.safetensors.*truncated"):
        read_tensor(header["c.f32"])


def test_the_builder_reads_checkpoints_without_importing_torch(tmp_path: Path) -> None:
    """A decoder graph is built from a sharded bf16 checkpoint in a process that never imports torch (what the
    search's child process does); its logits are the bf16-rounded model's."""
    import subprocess
    import sys

    from tests.unit.test_llm_builder import DECODE, PREFILL, VOCAB, make_llama, reference, run_cached

    model = make_llama(tmp_path / "hf", tied=False, dtype=torch.bfloat16, shard="60KB", seed=3)
    out = tmp_path / "onnx" / "model.onnx"
    code = (
        "import sys\n"
        "from quantkit.frontends.llm_builder import build_llm\n"
        f"build_llm({str(tmp_path / 'hf')!r}, {str(out)!r}, genai_config=False)\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr[-2000:]
    ids = np.random.default_rng(4).integers(0, VOCAB, (1, PREFILL + DECODE), dtype=np.int64)
    np.testing.assert_allclose(run_cached(out, ids), reference(model, ids), atol=1e-4, rtol=0)
