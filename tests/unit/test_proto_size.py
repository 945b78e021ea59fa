"""A model over protobuf's 2 GB limit is sized without ``ByteSize()`` (which raises there): a > 2 GB float model
with external data ran the whole quantization, then ended in an internal error building its report
(``EncodeError: Failed to serialize proto``)."""

from __future__ import annotations

from typing import Any

import onnx
import pytest

from quantkit.irtools import proto_size
from tests.conftest import tiny_cnn, tiny_encoder


class _OverTheLimit:
    """A ModelProto whose ``ByteSize()`` fails as protobuf's does beyond 2 GB; every part readable."""

    def __init__(self, proto: onnx.ModelProto) -> None:
        self._proto = proto

    def ByteSize(self) -> int:  # noqa: N802 - protobuf's name
        raise ValueError("Failed to serialize proto")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._proto, name)


@pytest.mark.parametrize("build", [tiny_cnn, tiny_encoder])
def test_a_model_over_the_limit_is_sized_by_its_parts(build: Any) -> None:
    proto = build()
    exact = proto.ByteSize()
    assert proto_size(proto) == exact
    parts = len(proto.graph.node) + len(proto.graph.initializer) + len(proto.graph.input) + len(proto.graph.output)
    estimate = proto_size(_OverTheLimit(proto))
    # the parts' sizes without their field tags / length prefixes (a few bytes each), plus 1 KiB
    assert exact - 8 * parts <= estimate <= exact + 1024, (estimate, exact)
