"""`AdaScale`: the learning rate that follows the measured gain of a larger
batch (Johnson, Agrawal, Gu and Guestrin, "AdaScale SGD: A User-Friendly
Algorithm for Distributed Training", ICML 2020), on the noise-scale
measurement of `tf_vrgd.NoiseScale` (docs/algorithms.md §10)."""

from typing import NamedTuple

import keras
import tensorflow as tf

from tf_vrgd import schedules, validation
from tf_vrgd._accumulation import GradientCompanion
from tf_vrgd._keras_adapters import Untracked, decay_weights, tf_variable
from tf_vrgd._wrapper import InnerOptimizerWrapper, find_inner
from tf_vrgd.noise_scale import ratio
from tf_vrgd.noise_scale_optimizer import check_measurable, squared_norms

# AdaScale's state, in `variables` after the inner optimizer's: the gain
# and the scale-invariant step of the last update, and the moving averages
# of sigma^2 and mu^2; under gradient accumulation, then, each replica's
# sum of its micro-steps' squared norms.
STATE = ("gain", "scale_invariant_steps", "variance_average", "squared_norm_average")


@keras.saving.register_keras_serializable(package="tf_vrgd")
class AdaScale(InnerOptimizerWrapper):
    """Scales any Keras optimizer's learning rate by the gain of its batch.

    At a batch S times a base batch B0, AdaScale applies the inner rule at
    the rate ``r * lr(floor(tau))``, with the gain

        r = (sigma^2 + mu^2) / (sigma^2 / S + mu^2),  in [1, S],

    where sigma^2 is the variance of a base-batch gradient and mu^2 the
    squared norm of the true gradient, and tau, the scale-invariant step,
    grows by r after each update. A schedule written for the base batch then
    serves every batch: training ends when tau reaches its length
    (`tf_vrgd.ScaleInvariantStop`).

    Both terms come from the measurement `tf_vrgd.NoiseScale` takes: each
    replica adds the squared norm of its gradient (one number) to the
    all-reduce the inner optimizer runs anyway, and every replica then takes
    the squared norm of the reduced gradient, so that every replica computes
    the same gain. With k samples per update (replicas x
    `gradient_accumulation_steps`), |G_big|^2 the squared norm of their mean
    and |G_small|^2 the mean of their squared norms, summed over variables,

        sigma^2 = S (|G_small|^2 - |G_big|^2) / (k - 1),
        mu^2 = (k |G_big|^2 - |G_small|^2) / (k - 1),

    the unbiased estimates (the batch size cancels). Each is smoothed by a
    moving average, and r is taken from the averages (their bias correction,
    one factor for both, cancels in the ratio). r is 1 until both averages
    are positive; while they are, r lies in [1, S] without clipping. With
    one sample per update nothing is measured and r stays 1: the inner
    optimizer runs as is, with its schedule read at tau = the update count.

    The inner optimizer's learning rate is the base rate: a number (or
    variable), a Keras `LearningRateSchedule`, whose step is then tau in
    place of the update count (a `tf_vrgd.schedules.PerUpdate` is read at
    tau itself: tau counts base-batch updates), or a callable of no
    arguments, called as Keras calls it. Keras' decoupled `weight_decay`
    takes the applied rate too. `gain` and `scale_invariant_steps` read the
    last update's values; they and the averages are optimizer state, saved
    and restored with the model.

    Under `tf_vrgd.LossScaleOptimizer` (wrap AdaScale in it), the gain is
    measured on the unscaled gradients and a skipped step moves neither tau
    nor the averages.

    Args:
        optimizer: The Keras 3 optimizer to wrap, of the kinds `NoiseScale`
            takes: not a VR optimizer (they scale their own gradients), a
            `LARC` (wrap its inner optimizer), a `NoiseScale` or a
            `LossScaleOptimizer` (wrap AdaScale in one).
        scale: S > 1, the update's batch over the base batch. Defaults to
            the samples of an update, k (the base batch is then one
            replica's micro-step).
        decay: In [0, 1), the decay d of the moving averages: ``avg = d avg +
            (1 - d) new`` (their bias correction, 1 / (1 - d^n) after n
            updates, cancels in the gain). Defaults to ``max(1 - k / 1000,
            0)``, FairScale's default.
        name: String. Defaults to "ada_scale", numbered like Keras'.
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer,
        scale: float | None = None,
        decay: float | None = None,
        name: str | None = None,
    ) -> None:
        check_measurable(optimizer, "AdaScale")
        if scale is not None:
            scale = validation.check_number("scale", scale, low=1.0, low_open=True)
        if decay is not None:
            decay = validation.check_number("decay", decay, low=0.0, high=1.0, high_open=True)
        super().__init__(optimizer, name=name)
        self.scale = scale
        self.decay = decay
        self._state = None
        self._install_hooks()

    def rule_config(self):
        return {"scale": self.scale, "decay": self.decay}

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        initial = {"gain": 1.0}
        with keras.name_scope(self.name, caller=self):
            state = [
                self.add_variable(
                    (),
                    initializer=keras.initializers.Constant(initial.get(name, 0.0)),
                    dtype="float64" if name == "scale_invariant_steps" else "float32",
                    name=f"adascale_{name}",
                )
                for name in STATE
            ]
            # This update's rate, written with the state and read by the
            # update step on each device. Derived: not state.
            self._rate = Untracked(tf.Variable(0.0, trainable=False, name="adascale_rate"))
            if self.inner_optimizer.gradient_accumulation_steps:
                # Each replica's sum of its micro-steps' squared norms: state
                # (a checkpoint mid-accumulation keeps it, as the inner
                # optimizer keeps its accumulated gradients).
                self._micro_step_norms = keras.Variable(
                    0.0,
                    trainable=False,
                    name="adascale_micro_step_norms",
                    synchronization="on_read",
                    aggregation="sum",
                )
                self._track_variable(self._micro_step_norms)
                state.append(self._micro_step_norms)
        self._state = state

    @property
    def variables(self):
        return [*self.inner_optimizer.variables, *(self._state or ())]

    @property
    def gain(self) -> float:
        """The gain r of the last update (1.0 before the first)."""
        return 1.0 if self._state is None else float(self._state[0].numpy())

    @property
    def applied_learning_rate(self) -> float:
        """The rate the last update applied, ``r * lr(floor(tau))`` with tau
        before it (the inner optimizer's `learning_rate` is its base rate,
        read at its update count). 0.0 before this process' first update:
        it is derived from the state, not saved with it."""
        return 0.0 if self._state is None else float(self._rate.value.numpy())

    def noise_scale(self, update_examples: int) -> float:
        """The gradient noise scale B_simple = tr(Sigma) / |G|^2, in examples,
        from the two moving averages: ``(update_examples / S) * sigma^2 /
        mu^2`` (sigma^2 is a base batch's variance, and the base batch is
        the update's examples over S). NaN until the averaged mu^2 is
        positive.

        Args:
            update_examples: The examples of one update (all replicas and
                micro-steps).
        """
        update_examples = validation.check_integer("update_examples", update_examples, low=1)
        if self._state is None:
            return float("nan")
        state = _State(*self._state[: len(STATE)])
        variance, squared_norm = (
            float(v.numpy()) for v in (state.variance_average, state.squared_norm_average)
        )
        samples = self._samples(self.inner_optimizer._distribution_strategy)
        base_batch = update_examples / float(self.scale or samples)
        return float(ratio(base_batch * variance, squared_norm))

    @property
    def scale_invariant_steps(self) -> float:
        """tau: the base-batch steps the updates so far are worth."""
        return 0.0 if self._state is None else float(self._state[1].numpy())

    @property
    def scale_invariant_steps_variable(self):
        """tau as a float64 `tf.Variable` (None before `build`), for a
        learning rate that reads it in the graph: a callable base rate is
        called before tau grows by this update's gain."""
        return None if self._state is None else tf_variable(self._state[1])

    # -- the hooks ------------------------------------------------------------

    def _install_hooks(self):
        # Keras' TensorFlow optimizers reduce and apply an update in
        # `_backend_update_step` (replica context), after their decoupled
        # weight decay at the rate read before the reduction: both move
        # here, after the gain is known. The package's accumulation calls
        # the companion instead.
        inner = self.inner_optimizer
        inner._backend_update_step = self._reduce_measure_and_update
        inner._apply_weight_decay = lambda variables: None
        if inner.gradient_accumulation_steps:
            inner._gradient_companion = GradientCompanion(
                self._add_micro_step_norms, self._measure_accumulated, self._reset_micro_step_norms
            )
        inner._all_reduce_measured_by = "AdaScale"

    def _samples(self, distribution):
        return distribution.num_replicas_in_sync * (
            self.inner_optimizer.gradient_accumulation_steps or 1
        )

    def _reduce_measure_and_update(self, grads, trainable_variables, learning_rate):
        """In place of Keras' `_backend_update_step`, in replica context:
        the all-reduce of the gradients with each replica's squared norm
        (one call) and the squared norm of the reduced gradient on every
        replica; then, in cross-replica context, the gain, the weight decay
        and the inner update at the applied rate."""
        del learning_rate  # read at tau, after the measurement
        inner = self.inner_optimizer
        variables = [tf_variable(v) for v in trainable_variables]
        context = tf.distribute.get_replica_context()
        replicas = context.num_replicas_in_sync
        norms = ()
        if replicas > 1:
            local = tf.reduce_sum(squared_norms(grads))
            *grads, local_sum = context.all_reduce(tf.distribute.ReduceOp.SUM, [*grads, local])
            # Each replica's gradient is its sample over R (Keras' loss
            # scaling): sum_d |g_d|^2 / R = R * sum_d |g_d / R|^2.
            norms = (tf.reduce_sum(squared_norms(grads)), replicas * local_sum)
        tf.__internal__.distribute.interim.maybe_merge_call(
            self._update,
            inner._distribution_strategy,
            list(trainable_variables),
            list(zip(grads, variables)),
            norms,
        )

    def _update(self, distribution, keras_variables, grads_and_vars, norms):
        rate = self._measure(distribution, norms, lambda big, small: (big, small))
        decay_weights(self.inner_optimizer, distribution, keras_variables, rate)
        self.inner_optimizer._distributed_tf_update_step(distribution, grads_and_vars, rate)

    def _measure(self, distribution, args, norms_of):
        """Cross-replica context, once per applied update, on each device:
        the gain from ``norms_of(*args)`` (that device's ``(|G_big|^2,
        |G_small|^2)``; no `args`: nothing measured, the gain is 1), the
        rate at tau, and tau advanced. Returns the rate's variable, whose
        copy on each device the update reads."""
        samples = self._samples(distribution)
        scale = float(self.scale or samples)
        keep = self.decay if self.decay is not None else max(1.0 - samples / 1000.0, 0.0)
        state, rate = _State(*self._state[: len(STATE)]), self._rate.value

        def step(tau, *args):
            gain = tf.constant(1.0)
            if args and samples > 1:
                gain = _gain(state, norms_of(*args), samples, scale, keep)
            rate.assign(gain * tf.cast(self._base_rate(tau), tf.float32))
            tf_variable(state.gain).assign(gain)
            tau.assign_add(tf.cast(gain, tau.dtype))

        steps = tf_variable(state.scale_invariant_steps)
        distribution.extended.update(steps, step, args=tuple(args), group=False)
        return rate

    def _base_rate(self, tau):
        """The inner optimizer's learning rate at step floor(tau)."""
        learning_rate = self.inner_optimizer._learning_rate
        if isinstance(learning_rate, schedules.PerUpdate):
            learning_rate = learning_rate.schedule
        if isinstance(learning_rate, keras.optimizers.schedules.LearningRateSchedule):
            return learning_rate(tf.cast(tf.floor(tau.read_value()), tf.int64))
        if isinstance(learning_rate, keras.Variable):
            return learning_rate.value
        return learning_rate() if callable(learning_rate) else learning_rate

    # -- under the package's gradient accumulation -----------------------------

    def _add_micro_step_norms(self, grads, variables):
        """Replica context, each micro-step: adds its squared norms to this
        replica's sum; returns the sum, for the update's collective."""
        del variables
        norms = tf_variable(self._micro_step_norms)
        norms.assign_add(tf.reduce_sum(squared_norms(grads)))
        return [norms.read_value()]

    def _measure_accumulated(self, distribution, means, variables, sums):
        """Cross-replica context, on update steps: the gain from the reduced
        means of the micro-steps (their squared norm on each device) and
        the reduced micro-step norms; returns the rate the update applies.
        With R replicas of A micro-steps each micro-step's gradient is its
        sample over R: |G_small|^2 = sum |g / R|^2 * R / A."""
        del variables
        factor = (
            distribution.num_replicas_in_sync / self.inner_optimizer.gradient_accumulation_steps
        )

        def norms_of(summed, *means):
            return tf.reduce_sum(squared_norms(means)), summed * factor

        return self._measure(distribution, (sums[0], *means), norms_of)

    def _reset_micro_step_norms(self):
        tf_variable(self._micro_step_norms).assign(0.0)


class _State(NamedTuple):
    """AdaScale's optimizer variables (`STATE`), by name."""

    gain: object
    scale_invariant_steps: object
    variance_average: object
    squared_norm_average: object


def _gain(state, norms, samples, scale, keep):
    """One device, one update: adds this update's sigma^2 and mu^2 (from
    ``norms = (|G_big|^2, |G_small|^2)``) to the moving averages and returns
    the gain from them."""
    big, small = (tf.cast(n, tf.float32) for n in norms)
    k = float(samples)
    new = (scale * (small - big) / (k - 1.0), (k * big - small) / (k - 1.0))
    variance, squared_norm = (
        tf_variable(slot).assign(keep * tf_variable(slot) + (1.0 - keep) * value)
        for slot, value in zip((state.variance_average, state.squared_norm_average), new)
    )
    resolved = tf.logical_and(squared_norm > 0.0, variance > 0.0)
    ratio = (variance + squared_norm) / tf.where(resolved, variance / scale + squared_norm, 1.0)
    return tf.where(resolved, ratio, 1.0)


def find_adascale(optimizer: keras.optimizers.Optimizer | None) -> AdaScale | None:
    """The `AdaScale` inside wrappers (LossScaleOptimizer), or None."""
    return find_inner(optimizer, AdaScale)


class ScaleInvariantStop(keras.callbacks.Callback):
    """Stops `fit` once an `AdaScale`'s scale-invariant step tau reaches
    `steps`, the length of the base schedule in base-batch updates.

    The check runs after each batch (one read of tau from the device).

    Args:
        steps: Number > 0, the base schedule's length.
    """

    def __init__(self, steps: float) -> None:
        super().__init__()
        self.steps = validation.check_number("steps", steps, low=0.0, low_open=True)
        self._optimizer = None

    def on_train_begin(self, logs=None):
        self._optimizer = find_adascale(self.model.optimizer)
        if self._optimizer is None:
            raise ValueError(
                "ScaleInvariantStop needs a model trained with tf_vrgd.AdaScale "
                "(possibly inside a LossScaleOptimizer). "
                f"Received: {type(self.model.optimizer).__name__}"
            )

    def on_train_batch_end(self, batch, logs=None):
        if self._optimizer.scale_invariant_steps >= self.steps:
            self.model.stop_training = True
