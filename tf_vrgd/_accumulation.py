"""Gradient accumulation that runs under `tf.distribute` strategies.

Keras 3's own accumulation (TensorFlow backend) puts the update, with its
all-reduce, inside a `tf.cond` in replica context; under
`MirroredStrategy` with 2 or more replicas that is a `merge_call` inside a
conditional, which TensorFlow refuses. Its accumulators are also mirrored
variables, which replicas cannot add different values to.

`ReplicaAccumulationMixin` keeps Keras' semantics (the update applies the
mean of the last A micro-step gradients, averaged over replicas, clipped
as Keras clips them, with Keras' weight decay, learning rate per update and
EMA) and moves the collective out of the conditional:

- each replica adds its gradient to its own on-read (`SUM`) accumulator;
- in cross-replica context (one `merge_call` per micro-step), a `tf.cond`
  on the update step holds the all-reduce of the accumulated means and the
  per-device update, which is allowed there;
- the accumulators are then zeroed on update steps.

A checkpoint stores the cross-replica sum of the accumulators (the summed
mean gradients of the micro-steps taken, whatever the replica count), so a
restore under another replica count resumes mid-accumulation correctly.
The VR optimizers accumulate their own moments (`tf_vrgd._gsnr`) and do not
use this path.
"""

from collections.abc import Callable
from typing import NamedTuple

import keras
import tensorflow as tf

from tf_vrgd._keras_adapters import (
    apply_moving_average,
    build_without_keras_accumulators,
    decay_weights,
    is_update_step,
    tf_variable,
)


class GradientCompanion(NamedTuple):
    """What `ReplicaAccumulationMixin` calls around its collective (plain
    functions: no reference back to a wrapper that Keras' saving would
    walk); see its docstring."""

    replica_sums: Callable
    reduced: Callable
    reset: Callable


class ReplicaAccumulationMixin:
    """Mixed into a Keras optimizer (before it): `gradient_accumulation_steps`
    works under MirroredStrategy and MultiWorkerMirroredStrategy, as under
    the default strategy. Without accumulation, the base class runs as is.

    A companion (`tf_vrgd.NoiseScale`'s, `tf_vrgd.AdaScale`'s) may set `_gradient_companion` to an
    object with three functions: `replica_sums(grads, variables)`, called in
    each replica at each micro-step, gives tensors of its own that the
    update's collective reduces with the gradients (one call);
    `reduced(distribution, means, variables, sums)` receives, on update
    steps, the reduced means and those sums in cross-replica context, and
    may return the learning rate the update applies (`tf_vrgd.AdaScale`'s;
    None keeps the optimizer's); and `reset()` runs in each replica after
    an update step.
    """

    _gradient_companion = None

    def build(self, var_list):
        if self.built:
            return
        build_without_keras_accumulators(self, super().build, var_list)
        self._replica_accumulators = []
        steps = self.gradient_accumulation_steps
        if not steps:
            return
        for variable in var_list:
            with keras.name_scope(self.name, caller=self):
                slot = keras.Variable(
                    initializer="zeros",
                    shape=variable.shape,
                    dtype=variable.dtype,
                    trainable=False,
                    name=f"{variable.path.replace('/', '_')}_gradient_accumulator",
                    synchronization="on_read",
                    aggregation="sum",
                )
            self._track_variable(slot)
            self._replica_accumulators.append(slot)
        # Keras' name for them: float8 training accumulates the variables it
        # overwrites with their gradients (`overwrite_with_gradient`) there,
        # by maximum, before this class sees the other gradients.
        self._accumulated_gradients = self._replica_accumulators

    def _backend_apply_gradients(self, grads, trainable_variables):
        # Only when accumulating, and not for the VR optimizers, whose
        # `_backend_apply_gradients` comes first in the MRO.
        if not self.gradient_accumulation_steps:
            return super()._backend_apply_gradients(grads, trainable_variables)
        replica_context = tf.distribute.get_replica_context()
        if replica_context is None:
            raise ValueError(
                f"{type(self).__name__}.apply() with gradient_accumulation_steps must be "
                "called in a replica context (inside `strategy.run`)."
            )
        steps = self.gradient_accumulation_steps
        slots = [
            self._replica_accumulators[self._get_variable_index(v)] for v in trainable_variables
        ]
        for gradient, slot in zip(grads, slots):
            # On-read variables take no scatter: sparse (embedding)
            # gradients are added dense. Added to the tf.Variable: Keras'
            # `assign_add` goes through its `add`, which takes a (0, n)
            # operand for a bias and fails.
            tf_variable(slot).assign_add(tf.cast(tf.convert_to_tensor(gradient), slot.dtype))
        companion = self._gradient_companion
        extra = [] if companion is None else companion.replica_sums(grads, trainable_variables)
        # Keras' order: the mean over the micro-steps, clipped per replica.
        means = self._clip_gradients([slot.value.read_value() / steps for slot in slots])
        replica_context.merge_call(
            self._accumulated_update, args=(means, list(trainable_variables), extra)
        )
        # After the update has read them (reads are ordered before later
        # writes to the same variable).
        tf.cond(self._is_update_step(), lambda: self._zero(slots, companion), lambda: None)
        apply_moving_average(self, replica_context)

    def _is_update_step(self):
        return is_update_step(self)

    @staticmethod
    def _zero(slots, companion=None):
        for slot in slots:
            slot.assign(tf.zeros(slot.shape, slot.dtype))
        if companion is not None:
            companion.reset()

    def _accumulated_update(self, distribution, means, variables, extra=()):
        tf_variables = [tf_variable(v) for v in variables]
        companion = self._gradient_companion

        def update():
            values = list(zip(means, tf_variables)) + [(e, tf_variables[0]) for e in extra]
            reduced = distribution.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, values)
            reduced, reduced_extra = reduced[: len(means)], reduced[len(means) :]
            rate = None
            if companion is not None:
                rate = companion.reduced(distribution, reduced, variables, reduced_extra)
            learning_rate = self.learning_rate if rate is None else rate
            decay_weights(self, distribution, variables, learning_rate)
            self._distributed_tf_update_step(
                distribution, list(zip(reduced, tf_variables)), learning_rate
            )

        tf.cond(self._is_update_step(), update, lambda: None)
