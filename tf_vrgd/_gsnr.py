"""The cross-replica moment hook shared by every VR optimizer.

This is the one place where per-replica gradients (and accumulated
micro-steps) become ``(sum of samples, sum of squared samples)``, are
all-reduced together, and are turned into the GSNR-scaled gradient that the
base rule applies (docs/algorithms.md §1-3, §6). It replaces Keras' TensorFlow
update path, `_backend_apply_gradients`, which is private: the Keras range
this is written for is pinned in `setup.cfg`, and
`tests/test_vr_keras.py::test_keras_private_update_path_is_unchanged` fails,
naming the method, if an upgrade changes it.

Flow of one `apply` call (per replica, in replica context):

1. Keras' clipping, then the local moments: ``g`` and ``g^2``. With
   `gradient_accumulation_steps = A`, each replica adds both to its own
   on-read accumulators in place, in one XLA call for all variables, with
   no communication; the sums go on to step 2 and the accumulators are zeroed
   after the update's micro-step.
2. One `merge_call` into cross-replica context, where a `tf.cond` (not in
   replica context: Keras' own accumulation puts `merge_call` inside a cond
   and fails under `MirroredStrategy`) runs, once per update:
3. one `batch_reduce_to` SUM carries both sums for every variable (the
   small dense variables' as one flat vector, concatenated per replica
   before the `merge_call`; the rows of row-sparse gradients gathered, not
   summed into a table), and
4. once per device, inside `extended.update_non_slot`, one XLA program for
   the large dense variables, one flat pass for the small ones, and the
   row-sparse update for embedding tables compute ``gbar, s`` -> GSNR ->
   (GSNR momentum) -> ``ghat`` and hand ``ghat`` to the optimizer's
   `update_step`, the base rule. That program is traced once and run on
   every device with its variables rebound to the device's copies.

With `gsnr_interval = N > 1` only every N-th update (the first, N + 1,
...) squares, reduces the squares and measures the GSNR; the others
reduce the gradient sums alone and apply the last scale (its
`gsnr_scale` slot, or the GSNR momentum).

Gradients that arrive as `tf.IndexedSlices` (embedding lookups) stay
row-sparse throughout: their duplicate rows are summed per replica, their
squares, sums, collective and slots cost the rows a batch touched
(docs/algorithms.md §6).

The hook is three modules, one per phase: this one, the Keras face
(arguments, config, `build`, the apply path of step 1-2, diagnostics);
`_gsnr_intake` (`ReplicaIntake`: accumulation, the rows a replica
gathers, the GSNR cadence); `_gsnr_device` (`DevicePrograms`: steps 3-4).
The rule itself is in `tf_vrgd.functional` (`gsnr_scale` at a GSNR update,
`scale_between_gsnr_updates` between).
"""

import functools
import inspect

import keras
import numpy as np
import tensorflow as tf

from tf_vrgd import functional, statistics, validation
from tf_vrgd._gsnr_device import DevicePrograms
from tf_vrgd._gsnr_intake import (
    ReplicaIntake,
    at_least_one_row,
    empty_like,
    float32_rows_or_dense,
    grouped,
    square_messages,
    update_groups,
)
from tf_vrgd._gsnr_rows import bundled_rows, row_bundles
from tf_vrgd._keras_adapters import (
    Untracked,
    apply_moving_average,
    build_without_keras_accumulators,
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


class GSNRMixin(ReplicaIntake, DevicePrograms):
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
        float32_slots = functools.partial(self._float32_slots, var_list)
        self._gsnr_momentums = (
            float32_slots("gsnr_momentum") if self.beta_3 > 0 else [None] * len(var_list)
        )
        # The scale of the last GSNR update, applied until the next one;
        # with a GSNR momentum, the momentum serves. 1 (the base rule) where
        # nothing has been measured yet: a row first looked up between two
        # GSNR updates.
        self._gsnr_scales = (
            float32_slots("gsnr_scale", initializer="ones")
            if self.gsnr_interval > 1 and self.beta_3 == 0
            else [None] * len(var_list)
        )
        # Per row of each variable, the GSNR updates in which the row had a
        # sample: the bias correction of the GSNR momentum of the variables
        # whose gradients arrive row-sparse (docs/algorithms.md §3). Read
        # only for those; which ones they are shows only at the first
        # update, so every variable with rows has one (a vector, 1/columns
        # of the variable).
        self._gsnr_row_updates = (
            float32_slots("gsnr_row_updates", shape=_rows)
            if self.beta_3 > 0
            else [None] * len(var_list)
        )
        if self.gradient_accumulation_steps:
            # Each replica accumulates its own micro-steps: the samples g_d
            # (Keras' 1/R loss scaling undone), their squares, and their
            # count. On-read SUM variables keep one value per replica, and
            # checkpoints and `model.save` store their cross-replica sum
            # (restored as sum / R per replica): totals in units that do not
            # depend on R, so a restore under another replica count resumes
            # into the mean over the samples actually taken.
            on_read = dict(synchronization="on_read", aggregation="sum")
            self._accumulated_gradients = float32_slots("gradient_accumulator", **on_read)
            self._accumulated_squares = float32_slots("squared_gradient_accumulator", **on_read)
            # Rows with a sample in the micro-steps so far (> 0), for the
            # variables whose gradients arrive row-sparse.
            self._accumulated_rows = float32_slots("accumulated_rows", shape=_rows, **on_read)
            with keras.name_scope(self.name, caller=self):
                self._accumulated_samples = keras.Variable(
                    initializer="zeros",
                    shape=(),
                    dtype="float32",
                    trainable=False,
                    name="gsnr_sample_count",
                    **on_read,
                )  # tracked on assignment
        else:
            self._accumulated_squares = None
            self._accumulated_rows = None
        # Diagnostics, not state: kept out of `variables` and checkpoints.
        self._gsnr_monitor = Untracked(
            float32_slots("gsnr_statistics", shape=(statistics.ROW_WIDTH,), track=False)
            if self.track_gsnr_statistics
            else [None] * len(var_list)
        )
        self._variable_updates = {}
        self._moment_accumulations = {}

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
        groups = update_groups(trainable_variables, sparse)
        rows = None
        if self.gradient_accumulation_steps:
            is_update_step = self._is_update_step()
            sums, squares, samples, rows = self._accumulate(grads, indices, sparse, is_update_step)
            sums, squares = grouped(sums, groups), grouped(squares, groups)
        else:
            sums, samples = grouped(grads, groups), None
            # Squared only for a GSNR update (an empty stand-in otherwise).
            squares = self._on_cadence(
                lambda: square_messages(sums),
                lambda: [empty_like(g, doubled=True) for g in sums],
            )
            for square, gradient in zip(squares, sums):
                # Read in the GSNR branch of `_cross_replica_update` only.
                if not isinstance(gradient, tf.IndexedSlices):
                    square.set_shape(gradient.shape)
        if sparse:
            # One message per bundle of tables with rows of one shape.
            bundles = row_bundles([trainable_variables[j].shape for j in sparse])
            part = slice(len(groups[0]), len(groups[0]) + len(sparse))
            sums, squares = list(sums), list(squares)
            sums[part] = bundled_rows(sums[part], bundles)
            squares[part] = bundled_rows(squares[part], bundles)
        replica_context.merge_call(
            self._cross_replica_update,
            args=(sums, squares, samples, list(trainable_variables), indices, groups),
        )
        if self.gradient_accumulation_steps:
            # After the update has read the sums (reads are ordered before
            # later writes to the same variable).
            tf.cond(
                is_update_step,
                functools.partial(self._reset_accumulators, indices, sparse, rows),
                lambda: None,
            )
        # Keras' EMA order and cadence (once per `apply`, micro-steps
        # included), so that the averages match the base optimizer's.
        apply_moving_average(self, replica_context)

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
        return tf.stack([v.value for v in self._gsnr_monitor.value]).numpy()

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
            for v in self._gsnr_monitor.value:
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


def _rows(variable):
    """The shape of a per-row slot of `variable`, None for a scalar."""
    return (variable.shape[0],) if len(variable.shape) else None
