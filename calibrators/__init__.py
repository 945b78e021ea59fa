"""Built-in calibrators, one per file; importing this package registers them.

* ``minmax`` — running (or moving-average) min / max, per-tensor or per-channel;
* ``percentile`` — clip at a percentile of the histogram;
* ``mse`` — the range with the least expected quantize-dequantize squared error;
* ``entropy`` — the KL-divergence threshold (TensorRT);
* ``auto`` — every candidate's range (``mse`` and ``minmax`` by default); the run keeps the candidate whose
  emitted model is closest to FP32 on calibration samples (the default).

The last three are per-tensor and work from :class:`quantkit.calibrate.stats.TensorStatistics`;
every built-in offers ``from_statistics(stats, **options)`` so one cached pass over the data
serves them all.  Each module imports only :mod:`quantkit.calibrate.base` and the leaf modules
``quantkit.calibrate.histogram`` / ``quantkit.calibrate.stats`` (never ``quantkit.calibrate.collect``),
so ``import calibrators`` and ``import quantkit.calibrate`` work in either order.
"""

from calibrators._common import HistogramCalibrator
from calibrators.auto import AutoCalibrator
from calibrators.entropy import EntropyCalibrator
from calibrators.minmax import MinMaxCalibrator
from calibrators.mse import MSECalibrator
from calibrators.percentile import PercentileCalibrator

__all__ = [
    "AutoCalibrator",
    "EntropyCalibrator",
    "HistogramCalibrator",
    "MSECalibrator",
    "MinMaxCalibrator",
    "PercentileCalibrator",
]
