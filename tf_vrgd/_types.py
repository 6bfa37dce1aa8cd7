"""Type aliases of the public API's signatures."""

from collections.abc import Callable, Sequence

import keras

# A float, a Keras schedule of the optimizer's step, or a callable returning
# the rate.
LearningRate = float | keras.optimizers.schedules.LearningRateSchedule | Callable[[], float]
# Regular expressions searched in variable paths, or None.
Patterns = Sequence[str] | None
