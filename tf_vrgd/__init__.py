"""tf_vrgd: large-batch optimizers for Keras 3 on TensorFlow.

LARS and the LARC wrapper, and (by ALGORITHMS.md) the VR family of
"Accelerating Large Batch Training via Gradient Signal to Noise Ratio".
"""

from tf_vrgd import functional
from tf_vrgd.larc import LARC
from tf_vrgd.lars import LARS

__version__ = "0.1.0"

__all__ = ["LARC", "LARS", "functional", "__version__"]
