"""Serializable Keras 3 learning-rate schedules with Model Garden semantics.

Model Garden's `official/modeling/optimization/lr_schedule.py` (checked
against the 2023 version of tensorflow/models) defines, on Keras 2:

- `*WithOffset` wrappers: ``schedule(step - offset)``, step cast to float32;
- `LinearWarmup(after, warmup_steps, warmup_learning_rate)`:
  ``warmup_lr + step / warmup_steps * (after(warmup_steps) - warmup_lr)``
  while ``step < warmup_steps``, then ``after(step)`` (the decay schedule
  sees the global step: warmup steps count towards its `decay_steps`);
- `PolynomialWarmUp(after, warmup_steps, power)`:
  ``after(warmup_steps) * (max(step, 1) / warmup_steps) ** power`` while
  ``step < warmup_steps``, then ``after(step)``.

These classes reproduce that arithmetic for Keras 3 and save and load with
the optimizer (`keras.optimizers.schedules.serialize`).
"""

import keras
from keras.optimizers.schedules import LearningRateSchedule
import tensorflow as tf


def _schedule_or_float(value):
    if isinstance(value, dict):
        return keras.optimizers.schedules.deserialize(value)
    return value


def _serialize_schedule_or_float(value):
    if isinstance(value, LearningRateSchedule):
        return keras.optimizers.schedules.serialize(value)
    return value


def _evaluate(schedule, step):
    if isinstance(schedule, LearningRateSchedule):
        return tf.cast(schedule(step), tf.float32)
    return tf.constant(schedule, tf.float32)


@keras.saving.register_keras_serializable(package="tf_vrgd")
class Constant(LearningRateSchedule):
    """A constant learning rate, as a schedule (Model Garden `constant`)."""

    def __init__(self, learning_rate, name="Constant"):
        self.learning_rate = float(learning_rate)
        self.name = name

    def __call__(self, step):
        return tf.constant(self.learning_rate, tf.float32)

    def get_config(self):
        return {"learning_rate": self.learning_rate, "name": self.name}


@keras.saving.register_keras_serializable(package="tf_vrgd")
class Offset(LearningRateSchedule):
    """``schedule(step - offset)`` (Model Garden's `offset` field)."""

    def __init__(self, schedule, offset=0, name="Offset"):
        self.schedule = _schedule_or_float(schedule)
        self.offset = int(offset)
        self.name = name

    def __call__(self, step):
        return self.schedule(tf.cast(step, tf.float32) - float(self.offset))

    def get_config(self):
        return {
            "schedule": _serialize_schedule_or_float(self.schedule),
            "offset": self.offset,
            "name": self.name,
        }


@keras.saving.register_keras_serializable(package="tf_vrgd")
class DelayedPolynomialDecay(LearningRateSchedule):
    """`initial_learning_rate` until step `decay_start_steps`, then Keras'
    `PolynomialDecay` counted from there:
    ``decay(max(step - decay_start_steps, 0))`` (the package's
    `delayed_polynomial` type). The DLRM schedule of NVIDIA's reference and
    MLPerf (Model Garden's ranking `WarmUpAndPolyDecay` after its warm-up),
    which the VRGD paper's DLRM runs use.

    Model Garden's `polynomial` with an `offset` does not hold the rate:
    before the offset its step is negative and the polynomial of a negative
    step exceeds `initial_learning_rate` ((1 + 2)^2 = 9 times it at twice
    `decay_steps` before the offset with power 2).
    """

    def __init__(
        self,
        initial_learning_rate,
        decay_start_steps,
        decay_steps,
        end_learning_rate=0.0001,
        power=1.0,
        name="DelayedPolynomialDecay",
    ):
        self.initial_learning_rate = float(initial_learning_rate)
        self.decay_start_steps = int(decay_start_steps)
        self.decay_steps = int(decay_steps)
        self.end_learning_rate = float(end_learning_rate)
        self.power = float(power)
        self.name = name
        self._decay = keras.optimizers.schedules.PolynomialDecay(
            self.initial_learning_rate, self.decay_steps, self.end_learning_rate, self.power
        )

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        return self._decay(tf.maximum(step - float(self.decay_start_steps), 0.0))

    def get_config(self):
        return {
            "initial_learning_rate": self.initial_learning_rate,
            "decay_start_steps": self.decay_start_steps,
            "decay_steps": self.decay_steps,
            "end_learning_rate": self.end_learning_rate,
            "power": self.power,
            "name": self.name,
        }


@keras.saving.register_keras_serializable(package="tf_vrgd")
class PerUpdate(LearningRateSchedule):
    """``schedule(step // accumulation_steps)``: a schedule whose steps count
    optimizer updates, under gradient accumulation.

    Keras evaluates an optimizer's schedule at its micro-step counter, so
    with `gradient_accumulation_steps = A` a schedule would run A times too
    fast in updates. Wrapped, the update that ends micro-steps
    ``uA .. uA + A - 1`` sees step ``u``, the step the same optimizer without
    accumulation sees at its update ``u`` (Model Garden counts steps in
    updates too).
    """

    def __init__(
        self,
        schedule: LearningRateSchedule | float,
        accumulation_steps: int,
        name: str = "PerUpdate",
    ) -> None:
        self.schedule = _schedule_or_float(schedule)
        self.accumulation_steps = int(accumulation_steps)
        if self.accumulation_steps < 1:
            raise ValueError(
                "`accumulation_steps` must be an integer >= 1. Received: "
                f"accumulation_steps={accumulation_steps!r}"
            )
        self.name = name

    def __call__(self, step):
        return self.schedule(tf.math.floordiv(tf.cast(step, tf.int64), self.accumulation_steps))

    def get_config(self):
        return {
            "schedule": _serialize_schedule_or_float(self.schedule),
            "accumulation_steps": self.accumulation_steps,
            "name": self.name,
        }


class _Warmup(LearningRateSchedule):
    def __init__(self, after_warmup, warmup_steps, name):
        self.after_warmup = _schedule_or_float(after_warmup)
        self.warmup_steps = int(warmup_steps)
        self.name = name

    def _warmup(self, step, target):
        raise NotImplementedError

    def __call__(self, step):
        step = tf.cast(step, tf.float32)
        target = _evaluate(self.after_warmup, self.warmup_steps)
        return tf.where(
            step < float(self.warmup_steps),
            self._warmup(step, target),
            _evaluate(self.after_warmup, step),
        )

    def get_config(self):
        return {
            "after_warmup": _serialize_schedule_or_float(self.after_warmup),
            "warmup_steps": self.warmup_steps,
            "name": self.name,
        }


@keras.saving.register_keras_serializable(package="tf_vrgd")
class LinearWarmup(_Warmup):
    """Linear ramp from `warmup_learning_rate` to ``after_warmup(warmup_steps)``
    over `warmup_steps`, then `after_warmup` (Model Garden `linear`)."""

    def __init__(self, after_warmup, warmup_steps, warmup_learning_rate=0.0, name="LinearWarmup"):
        super().__init__(after_warmup, warmup_steps, name)
        self.warmup_learning_rate = float(warmup_learning_rate)

    def _warmup(self, step, target):
        start = self.warmup_learning_rate
        return start + step / float(self.warmup_steps) * (target - start)

    def get_config(self):
        return {**super().get_config(), "warmup_learning_rate": self.warmup_learning_rate}


@keras.saving.register_keras_serializable(package="tf_vrgd")
class PolynomialWarmup(_Warmup):
    """``after_warmup(warmup_steps) * (max(step, 1) / warmup_steps) ** power``
    during warmup, then `after_warmup` (Model Garden `polynomial` warmup)."""

    def __init__(self, after_warmup, warmup_steps, power=1.0, name="PolynomialWarmup"):
        super().__init__(after_warmup, warmup_steps, name)
        self.power = float(power)

    def _warmup(self, step, target):
        if self.warmup_steps <= 0:
            return target
        done = tf.maximum(step, 1.0) / float(self.warmup_steps)
        return target * tf.pow(done, self.power)

    def get_config(self):
        return {**super().get_config(), "power": self.power}
