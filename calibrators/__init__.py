"""Built-in calibrators, one per file; importing this package registers them.

Each module imports only :mod:`quantkit.calibrate.base` (never ``quantkit.calibrate``'s
other modules), so ``import calibrators`` and ``import quantkit.calibrate`` work in either order.
"""

from calibrators.minmax import MinMaxCalibrator

__all__ = ["MinMaxCalibrator"]
