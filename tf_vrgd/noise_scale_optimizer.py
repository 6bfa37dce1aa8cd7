"""`NoiseScale`: the gradient noise scale of any Keras optimizer's
training, at the cost of one number per variable in the collective the
optimizer runs anyway (the estimators: `tf_vrgd.noise_scale`)."""

import keras
import numpy as np
import tensorflow as tf

from tf_vrgd import functional, validation
from tf_vrgd._accumulation import GradientCompanion, ReplicaAccumulationMixin
from tf_vrgd._cadence import Cadence
from tf_vrgd._gsnr import GSNRMixin
from tf_vrgd._keras_adapters import Untracked
from tf_vrgd._wrapper import InnerOptimizerWrapper, find_inner

# The columns of `NoiseScale.noise_scale_sums`: per variable, the sums over
# the measured updates of |G_big|^2 and |G_small|^2, then their count.
COLUMNS = ("squared_norm_of_mean", "mean_squared_norm", "updates")


@keras.saving.register_keras_serializable(package="tf_vrgd")
class NoiseScale(InnerOptimizerWrapper):
    """Measures the gradient noise scale of any Keras optimizer's updates.

    Data-parallel training has each update's gradient at two batch sizes:
    each replica's (B_small examples) and their mean (B_big, the global
    batch). Every `interval`-th update, each replica adds the squared norm
    of its own gradient, one number per variable, to the all-reduce of the
    gradients that the inner optimizer runs anyway (the same collective
    call); after it, the first replica of each machine takes the squared
    norm of the reduced gradient. Per variable and update that gives

        |G_big|^2 = |mean of the samples|^2,
        |G_small|^2 = mean over the samples of |sample|^2,

    whose running sums `noise_scale_sums` returns and `tf_vrgd.GSNRMonitor`
    turns into the noise scale B_simple = tr(Sigma) / |G|^2 in examples
    (`tf_vrgd.noise_scale`, docs/algorithms.md §9). The samples are the
    replicas (Keras scales each replica's loss by 1/R, which is undone
    here). With one replica and no accumulation there is one sample:
    nothing is measured.

    The inner optimizer's update is untouched: the gradients it applies
    are the ones it would have reduced itself. The running sums are
    diagnostics, not state: they are neither in `variables` nor saved.

    With `gradient_accumulation_steps` (this package's optimizers, whose
    accumulation runs under `MirroredStrategy`), each micro-step's
    gradient is a sample: each replica sums its micro-steps' squared norms
    and the update's collective reduces that sum with the accumulated
    gradients.

    Args:
        optimizer: The Keras 3 optimizer to wrap. Not a VR optimizer (they
            measure the noise scale from their own moments: give
            `GSNRMonitor` a `batch_size`), a `LARC` (wrap LARC's inner
            optimizer instead) or a `LossScaleOptimizer` (wrap NoiseScale
            in one instead).
        interval: Integer >= 1: measure at updates 1, N + 1, 2N + 1, ...
            Defaults to 1.
        name: String. Defaults to "noise_scale", numbered like Keras'.
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer,
        interval: int = 1,
        name: str | None = None,
    ) -> None:
        check_measurable(optimizer, "NoiseScale")
        super().__init__(optimizer, name=name)
        self.interval = validation.check_integer("interval", interval, low=1)
        self._sums = None
        self._install_reduce_hook()

    def rule_config(self):
        return {"interval": self.interval}

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        # One row per variable, the same on every replica (each writes its
        # own copy with the same reduced values). A diagnostic: kept out of
        # Keras' tracking, so out of `variables` and checkpoints.
        with keras.name_scope(self.name, caller=self):
            self._sums = Untracked(
                tf.Variable(
                    tf.zeros([len(var_list), len(COLUMNS)]),
                    trainable=False,
                    name="noise_scale_sums",
                    synchronization=tf.VariableSynchronization.ON_READ,
                    aggregation=tf.VariableAggregation.ONLY_FIRST_REPLICA,
                )
            )
            if self.inner_optimizer.gradient_accumulation_steps:
                # Each replica's sum of its micro-steps' squared norms.
                self._local_norms = Untracked(
                    tf.Variable(
                        tf.zeros([len(var_list)]),
                        trainable=False,
                        name="noise_scale_micro_step_norms",
                        synchronization=tf.VariableSynchronization.ON_READ,
                        aggregation=tf.VariableAggregation.SUM,
                    )
                )

    def _install_reduce_hook(self):
        # Keras' TensorFlow optimizers all-reduce the gradients of an update
        # in one call, `_all_reduce_sum_gradients`, in replica context;
        # the squared norms join that call.
        inner = self.inner_optimizer
        keras_all_reduce = inner._all_reduce_sum_gradients

        def all_reduce_sum_gradients(grads_and_vars):
            replica_context = tf.distribute.get_replica_context()
            strategy = tf.distribute.get_strategy()
            if replica_context is None or strategy.num_replicas_in_sync < 2 or not self.built:
                # One sample: nothing to measure.
                return keras_all_reduce(grads_and_vars)
            return self._reduce_and_measure(replica_context, strategy, list(grads_and_vars))

        inner._all_reduce_sum_gradients = all_reduce_sum_gradients
        if inner.gradient_accumulation_steps:
            inner._gradient_companion = GradientCompanion(
                self._micro_step_norms, self._record_accumulated, self._reset_micro_step_norms
            )
        # A flag, not a reference back: Keras' saving walks the attributes
        # of optimizers, and a cycle would make it recurse.
        inner._all_reduce_measured_by = "NoiseScale"

    def _reduce_and_measure(self, replica_context, strategy, grads_and_vars):
        present = [(i, g, v) for i, (g, v) in enumerate(grads_and_vars) if g is not None]
        if not present:
            return grads_and_vars
        gradients = [g for _, g, _ in present]
        variables = [v for _, _, v in present]
        local = self._if_measured(
            lambda: self._scatter(variables, squared_norms(gradients)),
            lambda: tf.zeros([len(self.inner_optimizer._trainable_variables)]),
        )
        *reduced, local_sum = replica_context.all_reduce(
            tf.distribute.ReduceOp.SUM, [*gradients, local]
        )

        def record():
            # Each replica's gradient is its sample over R (Keras' loss
            # scaling): sum_d |g_d|^2 / R = R * sum_d |g_d / R|^2.
            replicas = strategy.num_replicas_in_sync
            self._add_to_sums(variables, squared_norms(reduced), replicas * local_sum)

        # The sums are read from the first replica of each machine (on-read,
        # first replica): the others skip the squared norms of the reduced
        # gradients, which would be the same.
        local_replicas = len(strategy.extended.worker_devices)
        first_here = tf.equal(
            tf.math.floormod(replica_context.replica_id_in_sync_group, local_replicas), 0
        )
        self._if_measured(lambda: tf.cond(first_here, record, lambda: None), lambda: None)
        out = list(grads_and_vars)
        for (i, _, v), g in zip(present, reduced):
            out[i] = (g, v)
        return out

    def _add_to_sums(self, variables, big, small):
        """Adds one measured update to the running sums: |G_big|^2 of each
        of `variables` (`big`, in their order), |G_small|^2 of every
        variable (`small`, in the optimizer's order) and a count."""
        counts = self._scatter(variables, tf.ones([len(variables)]))
        self._sums.value.assign_add(
            tf.stack([self._scatter(variables, big), small, counts], axis=1)
        )

    def _scatter(self, variables, values):
        """`values` (one per variable of `variables`) at their rows of a
        vector over every trainable variable."""
        rows = [[self.inner_optimizer._get_variable_index(v)] for v in variables]
        return tf.scatter_nd(rows, values, [len(self.inner_optimizer._trainable_variables)])

    def _micro_step_norms(self, grads, variables):
        """Replica context, each micro-step: adds the micro-step's squared
        norms to this replica's sums (at measured updates); returns them,
        for the update's collective."""
        norms = self._local_norms.value

        def add():
            norms.assign_add(self._scatter(variables, squared_norms(grads)))

        self._if_measured(add, lambda: None)
        return [norms.read_value()]

    def _record_accumulated(self, distribution, means, variables, sums):
        """Cross-replica context, on update steps: the running sums from
        the reduced means of the micro-steps and the reduced micro-step
        norms. With R replicas of A micro-steps, each micro-step gradient
        is its sample over R: |G_small|^2 = sum |g / R|^2 * R / A."""
        replicas = distribution.num_replicas_in_sync
        steps = self.inner_optimizer.gradient_accumulation_steps

        def first(value):
            return distribution.experimental_local_results(value)[0]

        def record():
            big = squared_norms([first(m) for m in means])
            self._add_to_sums(variables, big, first(sums[0]) * (replicas / steps))

        self._if_measured(record, lambda: None)

    def _reset_micro_step_norms(self):
        norms = self._local_norms.value
        norms.assign(tf.zeros_like(norms))

    def _if_measured(self, measure, otherwise):
        """`measure()` at updates 1, N + 1, 2N + 1, ..., `otherwise()` at
        the others (`Cadence.choose`, the VR hook's cadence too)."""
        return Cadence(self.interval).choose(self.inner_optimizer.iterations, measure, otherwise)

    # -- diagnostics ----------------------------------------------------------

    def noise_scale_sums(self) -> np.ndarray | None:
        """Running sums since the last `reset_noise_scale_sums`, one row per
        trainable variable, in the columns of `COLUMNS`: |G_big|^2 and
        |G_small|^2 summed over the measured updates, and their number.
        None before the optimizer is built."""
        if not self.built:
            return None
        return self._sums.value.read_value().numpy()

    def reset_noise_scale_sums(self) -> None:
        """Restarts the running sums (no host sync)."""
        if self.built:
            self._sums.value.assign(tf.zeros_like(self._sums.value))

    def trainable_variables_in_order(self) -> list:
        """The variables whose rows `noise_scale_sums` holds, in order."""
        return list(self.inner_optimizer._trainable_variables)


def check_measurable(optimizer, wrapper):
    """Refuses, naming what to do instead, an optimizer that `wrapper` (the
    name of a class that measures in the inner optimizer's all-reduce:
    `NoiseScale`, `AdaScale`) cannot wrap."""
    InnerOptimizerWrapper.check_inner(optimizer)
    if isinstance(optimizer, GSNRMixin):
        raise ValueError(
            "`optimizer` is a VR optimizer, which measures the noise scale from its "
            "own moments: give tf_vrgd.GSNRMonitor a `batch_size` instead. "
            f"Received: optimizer={optimizer!r}"
        )
    if isinstance(optimizer, (InnerOptimizerWrapper, keras.optimizers.LossScaleOptimizer)):
        raise ValueError(
            f"`optimizer` must not be a NoiseScale, an AdaScale, a LARC or a "
            f"LossScaleOptimizer: {wrapper} rewrites the all-reduce of the optimizer that "
            f"applies the gradients. Wrap LARC's inner optimizer, and wrap {wrapper} in a "
            f"LossScaleOptimizer. Received: optimizer={optimizer!r}"
        )
    if optimizer.gradient_accumulation_steps and not isinstance(
        optimizer, ReplicaAccumulationMixin
    ):
        raise ValueError(
            f"With `gradient_accumulation_steps`, {wrapper} measures each micro-step's "
            "gradient inside the accumulation of this package's optimizers "
            "(tf_vrgd.SGD, Adam, AdamWeightDecay, LARS, LAMB); Keras' own accumulation "
            f"keeps only their sum. Received: {type(optimizer).__name__} with "
            f"gradient_accumulation_steps={optimizer.gradient_accumulation_steps}"
        )
    measured_by = getattr(optimizer, "_all_reduce_measured_by", None)
    if measured_by is not None:
        raise ValueError(
            f"`optimizer` is already wrapped by a {measured_by}, which rewrote its "
            f"all-reduce. Received: optimizer={optimizer!r}"
        )


def squared_norms(gradients):
    """The squared norm of each gradient, as a vector: ``2 * l2_loss`` in
    float32, one fused kernel that reads the values once (2.5x faster on
    ResNet-50's gradients than the same reductions in one XLA program on
    a CPU: docs/RESULTS.md, "NoiseScale's cost"). A row-sparse gradient's
    repeated rows are summed first (the gradient it means)."""
    norms = []
    for gradient in gradients:
        if isinstance(gradient, tf.IndexedSlices):
            gradient = functional.sum_duplicate_rows(gradient).values
        norms.append(2.0 * tf.nn.l2_loss(tf.cast(gradient, tf.float32)))
    return tf.stack(norms)


def find_noise_scale(optimizer: keras.optimizers.Optimizer | None) -> NoiseScale | None:
    """The `NoiseScale` inside wrappers (LossScaleOptimizer), or None."""
    return find_inner(optimizer, NoiseScale)


def noise_terms(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(|G_big|^2, |G_small|^2)`` per variable, averaged over the updates
    of `NoiseScale.noise_scale_sums` (NaN for a variable without one): the
    inputs of `tf_vrgd.noise_scale.estimates`."""
    sums = np.asarray(sums, np.float64)
    with np.errstate(invalid="ignore", divide="ignore"):
        return sums[:, 0] / sums[:, 2], sums[:, 1] / sums[:, 2]
