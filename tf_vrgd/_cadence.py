"""`Cadence`: which updates measure, for the VR hook (`gsnr_interval`) and
for `NoiseScale` (`interval`), stated once."""

from typing import NamedTuple

import tensorflow as tf


class Cadence(NamedTuple):
    """Measure at updates 1, N + 1, 2N + 1, ... (N = `interval`), read from
    the update count before the update in progress (an optimizer's
    `iterations`, which counts updates, not micro-steps)."""

    interval: int

    def measures(self, iterations):
        """Whether the update in progress, t = iterations + 1, measures."""
        return tf.equal(tf.math.floormod(iterations, self.interval), 0)

    def choose(self, iterations, measure, otherwise):
        """`measure()` at an update that measures, `otherwise()` at one that
        does not: a Python choice when every update measures (no
        conditional in the graph), else a `tf.cond`."""
        if self.interval == 1:
            return measure()
        return tf.cond(self.measures(iterations), measure, otherwise)

    def measured_updates(self, iterations):
        """The updates that measure, up to and including the one in
        progress (float32: what the GSNR momentum's bias correction
        counts)."""
        return tf.cast(iterations // self.interval + 1, tf.float32)
