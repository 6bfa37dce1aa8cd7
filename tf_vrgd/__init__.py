"""tf_vrgd: large-batch optimizers for Keras 3 on TensorFlow.

LARS, LAMB (Model Garden form) and the LARC wrapper, and the VR family of
"Accelerating Large Batch Training via Gradient Signal to Noise Ratio"
(VR-SGD/Momentum, VR-Adam, VR-LARS, VR-LAMB).
"""

from tf_vrgd import functional, noise_scale, schedules, statistics
from tf_vrgd._gsnr import find_vr_optimizer
from tf_vrgd.adam import Adam
from tf_vrgd.adamw import AdamWeightDecay
from tf_vrgd.adascale import AdaScale, ScaleInvariantStop
from tf_vrgd.lamb import LAMB
from tf_vrgd.larc import LARC
from tf_vrgd.lars import LARS
from tf_vrgd.loss_scale import LossScaleOptimizer
from tf_vrgd.monitor import GSNRMonitor
from tf_vrgd.noise_scale_optimizer import NoiseScale
from tf_vrgd.replica_noise import independent_replica_noise
from tf_vrgd.sgd import SGD
from tf_vrgd.vr_adam import VRAdam
from tf_vrgd.vr_lamb import VRLAMB
from tf_vrgd.vr_lars import VRLARS
from tf_vrgd.vr_sgd import VRSGD

__version__ = "0.1.0"

__all__ = [
    "LAMB",
    "LARC",
    "LARS",
    "SGD",
    "VRLAMB",
    "VRLARS",
    "VRSGD",
    "AdaScale",
    "Adam",
    "AdamWeightDecay",
    "GSNRMonitor",
    "LossScaleOptimizer",
    "NoiseScale",
    "ScaleInvariantStop",
    "VRAdam",
    "__version__",
    "find_vr_optimizer",
    "functional",
    "independent_replica_noise",
    "noise_scale",
    "schedules",
    "statistics",
]
