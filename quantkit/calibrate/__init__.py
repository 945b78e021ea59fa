"""Calibration: the calibrator protocol and registry, and ORT-driven statistics collection.

Importing this package registers the built-in calibrators (the top-level ``calibrators``
package); third-party ones come in through the ``quantkit.calibrators`` entry-point group.
"""

import calibrators  # noqa: F401  (registers the built-in calibrators; either import order works)
from quantkit.calibrate.base import (
    CALIBRATORS,
    Calibrator,
    CalibratorFactory,
    get_calibrator,
    register_calibrator,
)
from quantkit.calibrate.collect import CalibrationDataset, TensorRequest, collect_statistics

__all__ = [
    "CALIBRATORS",
    "CalibrationDataset",
    "Calibrator",
    "CalibratorFactory",
    "TensorRequest",
    "collect_statistics",
    "get_calibrator",
    "register_calibrator",
]
