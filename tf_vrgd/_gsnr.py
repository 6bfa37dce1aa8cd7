"""The Keras face of the VR hook shared by every VR optimizer: the
arguments, `build` (wiring the hook's parts), the apply path and the
diagnostics. docs/hook.md follows one gradient through the parts:
`ReplicaIntake` (`_gsnr_intake`) on each replica, `MessageLayout`
(`_gsnr_layout`) for the one collective, `DevicePrograms` (`_gsnr_device`)
on each device, the rule's composition and write-back (`_gsnr_slots`),
then the base optimizer's `update_step`.

It replaces Keras' TensorFlow update path, `_backend_apply_gradients`,
which is private: the Keras range this is written for is pinned in
`setup.cfg`, and
`tests/test_vr_keras.py::test_keras_private_update_path_is_unchanged`
fails, naming the method, if an upgrade changes it.
"""

import functools
import inspect

import keras
import numpy as np
import tensorflow as tf

from tf_vrgd import functional, statistics, validation
from tf_vrgd._cadence import Cadence
from tf_vrgd._gsnr_device import DevicePrograms
from tf_vrgd._gsnr_intake import ReplicaIntake, at_least_one_row, float32_rows_or_dense
from tf_vrgd._gsnr_layout import MessageLayout
from tf_vrgd._gsnr_slots import GSNRRule
from tf_vrgd._keras_adapters import (
    apply_moving_average,
    build_without_keras_accumulators,
    decay,
    is_update_step,
    tf_variable,
)
from tf_vrgd._wrapper import find_inner
from tf_vrgd.statistics import variable_path

_VR_ARGUMENTS = """\
        gamma: Float in (0, 1], the floor of the clipped GSNR. Defaults to
            0.1.
        beta_3: Float in [0, 1), the GSNR momentum (0: none, as in
            Algorithm 1). Defaults to {beta_3}.
        gsnr_epsilon: Float > 0, the variance floor relative to the second
            moment. Defaults to 1e-6.
        gsnr_interval: Int >= 1, measure the GSNR at updates 1, N + 1,
            2N + 1, ... only; the updates between reduce the gradient alone
            and apply the last scale. Defaults to 1 (every update).
        jit_update: Bool, XLA-compile the update (one program per device
            for the variables over 2^14 elements) and, with accumulation,
            the micro-step sums. Defaults to True.
        track_gsnr_statistics: Bool, sum per-variable GSNR statistics at
            every update for `gsnr_statistics()` and `tf_vrgd.GSNRMonitor`.
            Defaults to False (they cost extra reductions per update).
        **kwargs: Keras base optimizer arguments (`name`, `weight_decay`,
            `clipnorm`, `clipvalue`, `global_clipnorm`, `use_ema`,
            `ema_momentum`, `ema_overwrite_frequency`, `loss_scale_factor`,
            `gradient_accumulation_steps`, and the base class' own).
            `gradient_accumulation_steps = A` makes k = replicas x A samples
            per update. Clipping then applies to each micro-step's gradient
            (each is a sample), where Keras clips the mean of the A
            micro-steps once per update.
"""


def fill_vr_arguments(docstring, beta_3):
    """A VR class' docstring with the arguments every VR class shares in
    place of its ``{vr_args}`` line (one text, like Keras' base optimizer
    argument template)."""
    return docstring.replace("{vr_args}", _VR_ARGUMENTS.format(beta_3=beta_3))


class GSNRMixin:
    """Turns a Keras optimizer into its VR twin: list it before the base
    optimizer class. It takes the arguments every VR optimizer shares
    (keyword only, documented once in `_VR_ARGUMENTS` and filled into the
    subclass' docstring at its ``{vr_args}`` line), saves them with
    `get_config`, and passes the rest on to the base class. A subclass sets
    `default_beta_3` and defines `__init__` only to check or document the
    base class' own arguments."""

    #: The GSNR momentum when `beta_3` is not given: 0 for VR-SGD/Momentum
    #: and VR-LARS (Algorithm 1), 0.9 for VR-Adam and VR-LAMB (Algorithms
    #: 3 and 5).
    default_beta_3 = 0.0

    # Whether the base rule's `update_step` takes a `tf.IndexedSlices`
    # gradient (Keras' SGD and Adam do: SGD without momentum then writes
    # the rows alone). LARS and LAMB need the whole gradient's norm.
    _row_sparse_base_rule = True

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        if cls.__doc__ and "{vr_args}" in cls.__doc__:
            cls.__doc__ = fill_vr_arguments(cls.__doc__, cls.default_beta_3)

    def __init__(
        self,
        *args,
        gamma: float = 0.1,
        beta_3: float | None = None,
        gsnr_epsilon: float = 1e-6,
        jit_update: bool = True,
        track_gsnr_statistics: bool = False,
        gsnr_interval: int = 1,
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        if beta_3 is None:
            beta_3 = self.default_beta_3
        self.gsnr_interval = validation.check_integer("gsnr_interval", gsnr_interval, low=1)
        self.gamma = validation.check_number("gamma", gamma, low=0.0, high=1.0, low_open=True)
        self.beta_3 = validation.check_number("beta_3", beta_3, low=0.0, high=1.0, high_open=True)
        self.gsnr_epsilon = validation.check_number(
            "gsnr_epsilon", gsnr_epsilon, low=0.0, low_open=True
        )
        self.jit_update = validation.check_bool("jit_update", jit_update)
        self._track_gsnr_statistics = validation.check_bool(
            "track_gsnr_statistics", track_gsnr_statistics
        )

    @classmethod
    def vr_arguments(cls) -> dict:
        """The shared VR arguments with this class' defaults."""
        parameters = inspect.signature(GSNRMixin.__init__).parameters
        defaults = {name: p.default for name, p in parameters.items() if p.kind is p.KEYWORD_ONLY}
        return {**defaults, "beta_3": cls.default_beta_3}

    def get_config(self):
        return {
            **super().get_config(),
            "gamma": self.gamma,
            "beta_3": self.beta_3,
            "gsnr_epsilon": self.gsnr_epsilon,
            "jit_update": self.jit_update,
            "track_gsnr_statistics": self.track_gsnr_statistics,
            "gsnr_interval": self.gsnr_interval,
        }

    @property
    def track_gsnr_statistics(self):
        """Whether each update sums GSNR statistics (fixed once built)."""
        return self._track_gsnr_statistics

    @track_gsnr_statistics.setter
    def track_gsnr_statistics(self, value):
        value = validation.check_bool("track_gsnr_statistics", value)
        if self.built and value != self._track_gsnr_statistics:
            raise ValueError(
                f"{type(self).__name__}.track_gsnr_statistics cannot change once "
                "the optimizer is built (its statistics slots are made, or not, "
                "by `build`). Construct the optimizer with "
                f"track_gsnr_statistics={value}."
            )
        self._track_gsnr_statistics = value

    def build(self, var_list):
        if self.built:
            return
        build_without_keras_accumulators(self, super().build, var_list)
        cadence = Cadence(self.gsnr_interval)
        make_slots = functools.partial(self._float32_slots, var_list)
        self._device = DevicePrograms(
            make_slots,
            var_list,
            GSNRRule(self.gamma, self.gsnr_epsilon, self.beta_3),
            cadence,
            self._base_rule,
            self._program_variables,
            jit=self.jit_update,
            keep_scale=self.gsnr_interval > 1 and self.beta_3 == 0,
            track_statistics=self.track_gsnr_statistics,
            make_hint=self._untracked_scalar,
        )
        self._intake = ReplicaIntake(
            make_slots, cadence, self.gradient_accumulation_steps, self.jit_update, self._scalar
        )

    def _scalar(self, name, **kwargs):
        """A float32 scalar of the optimizer's state (the sample count),
        the last of its `variables`, and saved by `tf.train.Checkpoint`
        under ``_accumulated_samples`` too, its key since it was first
        saved."""
        with keras.name_scope(self.name, caller=self):
            variable = keras.Variable(
                initializer="zeros", shape=(), dtype="float32", trainable=False, name=name, **kwargs
            )
        self._track_variable(variable)
        self._track_trackable(variable, name="_accumulated_samples")
        return variable

    def _untracked_scalar(self, name):
        """A float32 scalar of the device programs kept out of `variables`
        and checkpoints (`DevicePrograms.masked_hint`)."""
        with keras.name_scope(self.name, caller=self):
            return keras.Variable(
                initializer="zeros", shape=(), dtype="float32", trainable=False, name=name
            )

    def _float32_slots(self, var_list, name, shape=None, track=True, initializer="zeros", **kwargs):
        """One float32 variable per variable of `var_list` (GSNR statistics
        are float32 whatever the variable dtype), of its shape or `shape`
        (a shape, or a function of the variable giving one or None for no
        slot)."""
        slots = []
        for v in var_list:
            slot_shape = v.shape if shape is None else shape
            if callable(slot_shape):
                slot_shape = slot_shape(v)
                if slot_shape is None:
                    slots.append(None)
                    continue
            with keras.name_scope(self.name, caller=self):
                slot = keras.Variable(
                    initializer=initializer,
                    shape=slot_shape,
                    dtype="float32",
                    trainable=False,
                    name=f"{variable_path(v).replace('/', '_')}_{name}",
                    **kwargs,
                )
            if track:
                self._track_variable(slot)
            slots.append(slot)
        return slots

    def _base_rule(self, index):
        """The base optimizer's rule for variable `index`, as the device
        programs call it: ``apply(scaled_gradient, learning_rate)``, Keras'
        decoupled weight decay (as Keras applies it) then `update_step`
        (a `tf.IndexedSlices` made dense first for base rules that are
        dense by nature: `_row_sparse_base_rule`)."""
        keras_variable = self._trainable_variables[index]
        variable = tf_variable(keras_variable)
        decays = bool(self.weight_decay) and self._use_weight_decay(keras_variable)
        densify = not self._row_sparse_base_rule

        def apply(scaled_gradient, learning_rate):
            if densify and isinstance(scaled_gradient, tf.IndexedSlices):
                scaled_gradient = tf.convert_to_tensor(scaled_gradient)
            if decays:
                decay(variable, self.weight_decay, learning_rate)
            self.update_step(tf.cast(scaled_gradient, variable.dtype), variable, learning_rate)

        return apply

    def _program_variables(self):
        """The tf.Variables a device program may touch: the model's
        trainable ones, the optimizer's (slots, counters) and the device
        programs' own (the GSNR statistics, the hint)."""
        untracked = self._device.untracked_variables
        return [tf_variable(v) for v in [*self._trainable_variables, *self.variables, *untracked]]

    # -- replica context ------------------------------------------------------

    def _backend_apply_gradients(self, grads, trainable_variables):
        strategy = tf.distribute.get_strategy()
        self.check_sample_count(strategy.num_replicas_in_sync)
        replica_context = tf.distribute.get_replica_context()
        if replica_context is None:
            raise ValueError(
                f"{type(self).__name__}.apply() must be called in a replica "
                "context (inside `strategy.run`), where each replica holds its "
                "own gradient."
            )
        grads = [float32_rows_or_dense(g) for g in grads]
        if self.clipnorm or self.clipvalue or self.global_clipnorm:
            # Keras clips dense tensors: no row-sparse path with clipping.
            grads = self._clip_gradients([functional.as_float32(g) for g in grads])
        indices = [self._get_variable_index(v) for v in trainable_variables]
        # Row-sparse gradients (embedding lookups) take the row-sparse path
        # (docs/algorithms.md §6), each row once.
        sparse = tuple(j for j, g in enumerate(grads) if isinstance(g, tf.IndexedSlices))
        grads = [
            functional.sum_duplicate_rows(at_least_one_row(g)) if j in sparse else g
            for j, g in enumerate(grads)
        ]
        layout = MessageLayout(trainable_variables, indices, sparse)
        update_step = is_update_step(self) if self.gradient_accumulation_steps else None
        sums, squares, samples, after = self._intake.messages(
            grads, layout, self.iterations, update_step
        )
        # The layout is Python data alike on every replica, bound, not
        # passed: merge_call would gather one from each replica.
        replica_context.merge_call(
            functools.partial(self._cross_replica_update, layout=layout),
            args=(sums, squares, samples),
        )
        # After the update has read the sums (reads are ordered before
        # later writes to the same variable).
        after()
        # Keras' EMA order and cadence (once per `apply`, micro-steps
        # included), so that the averages match the base optimizer's.
        apply_moving_average(self, replica_context)

    def _cross_replica_update(self, distribution, sums, squares, samples, layout):
        def update():
            learning_rate = tf.convert_to_tensor(self.learning_rate)
            self._device.update(
                distribution, layout, sums, squares, samples, learning_rate, self.iterations
            )

        if not self.gradient_accumulation_steps:
            update()
        else:
            # In cross-replica context, so that no merge_call sits in a cond.
            tf.cond(is_update_step(self), update, lambda: None)

    def check_sample_count(self, replicas: int) -> None:
        """Raises ValueError, saying how to fix it, unless `replicas` x
        `gradient_accumulation_steps` gives k >= 2 gradient samples per
        update (what the first update checks)."""
        steps = self.gradient_accumulation_steps or 1
        if replicas * steps < 2:
            raise ValueError(
                f"{type(self).__name__} needs k >= 2 gradient samples per update "
                "to estimate the gradient variance, with k = replicas x "
                f"gradient_accumulation_steps; here k = {replicas} x {steps}. "
                "Train under tf.distribute.MirroredStrategy with 2 or more "
                "replicas (on a CPU-only machine, split the CPU with "
                "tf.config.set_logical_device_configuration), or pass "
                "gradient_accumulation_steps >= 2."
            )

    # -- diagnostics ------------------------------------------------------------

    def gsnr_statistic_sums(self) -> np.ndarray | None:
        """Running sums since the last `reset_gsnr_statistics`, one row per
        trainable variable: the per-update values of the columns of
        `tf_vrgd.statistics.COLUMNS`, summed, then the number of updates.

        Returns a float32 numpy array of shape
        ``[variables, statistics.ROW_WIDTH]`` (read from the device in one
        transfer), or None before the optimizer is built.
        Raises ValueError unless `track_gsnr_statistics` is True.
        """
        self._check_tracking("gsnr_statistic_sums")
        if not self.built:
            return None
        return tf.stack([v.value for v in self._device.state.statistics]).numpy()

    def gsnr_statistics(self) -> dict[str, dict[str, float]]:
        """Per-variable GSNR statistics averaged over the updates since the
        last `reset_gsnr_statistics` (or since the start).

        Returns:
            A dict from variable path to ``{"mean_gsnr", "fraction_at_gamma",
            "fraction_at_one", "mean_scale", "updates"}``: the mean over the
            variable's elements of the raw GSNR ``gbar^2 / var``, the
            fractions of elements whose normalised GSNR was clipped to
            `gamma` or to 1, and the mean factor applied to gbar (after the
            clip and the GSNR momentum; `tf_vrgd.statistics.COLUMNS`).
            The averages are NaN when no update has run. Empty before the
            optimizer is built. Raises ValueError unless
            `track_gsnr_statistics` is True.
        """
        self._check_tracking("gsnr_statistics")
        sums = self.gsnr_statistic_sums()
        if sums is None:
            return {}
        return {
            variable_path(variable): statistics.summarize(row)
            for variable, row in zip(self._trainable_variables, sums)
        }

    def trainable_variables_in_order(self) -> list:
        """The variables this optimizer was built on, in the order of its
        statistics rows."""
        return list(self._trainable_variables)

    def reset_gsnr_statistics(self) -> None:
        """Restarts the running sums behind `gsnr_statistics` (no host sync)."""
        self._check_tracking("reset_gsnr_statistics")
        if self.built:
            for v in self._device.state.statistics:
                v.assign(tf.zeros_like(v))

    def _check_tracking(self, method):
        if not self.track_gsnr_statistics:
            raise ValueError(
                f"{type(self).__name__}.{method}() needs the optimizer to sum "
                "GSNR statistics: construct it with track_gsnr_statistics=True."
            )


def find_vr_optimizer(optimizer: keras.optimizers.Optimizer | None) -> GSNRMixin | None:
    """The VR optimizer inside wrappers (LossScaleOptimizer, LARC), or None."""
    return find_inner(optimizer, GSNRMixin)
