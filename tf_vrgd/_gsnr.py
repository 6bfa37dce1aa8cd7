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
   `update_step`, the base rule.

With `gsnr_interval = N > 1` only every N-th update (the first, N + 1,
...) squares, reduces the squares and measures the GSNR; the others
reduce the gradient sums alone and apply the last scale (its
`gsnr_scale` slot, or the GSNR momentum).

Gradients that arrive as `tf.IndexedSlices` (embedding lookups) stay
row-sparse throughout: their duplicate rows are summed per replica, their
squares, sums, collective and slots cost the rows a batch touched
(docs/algorithms.md §6).
"""

import functools
import inspect

import keras
import numpy as np
import tensorflow as tf

from tf_vrgd import functional, statistics, validation
from tf_vrgd._keras_adapters import (
    apply_moving_average,
    build_without_keras_accumulators,
    is_update_step,
)
from tf_vrgd._keras_adapters import decay as _decay
from tf_vrgd._keras_adapters import tf_variable as _tf_variable
from tf_vrgd.statistics import variable_path, variable_size

# Variables of at most this many elements (64 KiB in float32) are updated
# together by `GSNRMixin._packed_update` instead of one by one in the XLA
# program; docs/algorithms.md §6 gives the measurements behind it.
PACKED_MAX_ELEMENTS = 2**14


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
        self._gsnr_monitor = _Untracked(
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
        grads = [_float32_rows_or_dense(g) for g in grads]
        if self.clipnorm or self.clipvalue or self.global_clipnorm:
            # Keras clips dense tensors: no row-sparse path with clipping.
            grads = self._clip_gradients([functional.as_float32(g) for g in grads])
        indices = [self._get_variable_index(v) for v in trainable_variables]
        # Row-sparse gradients (embedding lookups) take the row-sparse path
        # (docs/algorithms.md §6), each row once.
        sparse = tuple(j for j, g in enumerate(grads) if isinstance(g, tf.IndexedSlices))
        grads = [
            functional.sum_duplicate_rows(_at_least_one_row(g)) if j in sparse else g
            for j, g in enumerate(grads)
        ]
        groups = _update_groups(trainable_variables, sparse)
        rows = None
        if self.gradient_accumulation_steps:
            is_update_step = self._is_update_step()
            sums, squares, samples, rows = self._accumulate(grads, indices, sparse, is_update_step)
            sums, squares = _grouped(sums, groups), _grouped(squares, groups)
        else:
            sums, samples = _grouped(grads, groups), None
            if self.gsnr_interval == 1:
                squares = _squares(sums)
            else:
                # Squared only for a GSNR update (an empty stand-in otherwise).
                squares = tf.cond(
                    self._is_gsnr_update(),
                    lambda: _squares(sums),
                    lambda: [_empty_like(g, doubled=True) for g in sums],
                )
                for square, gradient in zip(squares, sums):
                    # Read in the GSNR branch of `_cross_replica_update` only.
                    if not isinstance(gradient, tf.IndexedSlices):
                        square.set_shape(gradient.shape)
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

    def _accumulate(self, grads, indices, sparse, is_update_step):
        """Adds this micro-step's gradients and their squares to the
        replica's running sums, in place, and returns the new sums (and,
        for row-sparse gradients, the rows they hold).

        One pass over memory (reads g and both sums, writes both sums: 20
        B/param in fp32) in one XLA call for all dense variables, unless
        `jit_update` is False. Row-sparse gradients add their rows (at the
        cost of the rows) and mark them; at the update, each replica
        gathers the rows it marked.
        """
        dense = tuple(indices[j] for j in range(len(grads)) if j not in sparse)
        dense_grads = [g for j, g in enumerate(grads) if j not in sparse]
        accumulate = self._moment_accumulation(dense, squares=True)
        add_rows = functools.partial(self._accumulate_rows, [indices[j] for j in sparse])
        sparse_grads = [grads[j] for j in sparse]

        def add(measure):
            if measure:
                accumulate(dense_grads)
            else:
                self._moment_accumulation(dense, squares=False)(dense_grads)
            add_rows(sparse_grads, measure)

        if self.gsnr_interval == 1:
            add(True)
        else:
            # No square is taken for an update that does not measure the GSNR.
            tf.cond(self._is_gsnr_update(), lambda: add(True), lambda: add(False))
        sums, squares, rows = [], [], []
        for j, i in enumerate(indices):
            if j in sparse:
                gathered = self._gathered_rows(i, grads[j], is_update_step)
                rows.append(gathered[0])
                sums.append(gathered[1])
                squares.append(gathered[2])
            else:
                sums.append(self._accumulated_gradients[i].value.read_value())
                squares.append(self._accumulated_squares[i].value.read_value())
        return sums, squares, self._accumulated_samples.value.read_value(), rows

    def _accumulate_rows(self, indices, grads, squares):
        """Adds row-sparse micro-step gradients (`g_d = R * g`) and, if
        `squares`, their squares to the replica's sums at their rows, and
        marks the rows."""
        replicas = tf.distribute.get_strategy().num_replicas_in_sync
        for i, gradient in zip(indices, grads):
            sample = gradient.values * float(replicas) if replicas > 1 else gradient.values
            rows = gradient.indices
            _replica_copy(self._accumulated_gradients[i]).scatter_add(
                tf.IndexedSlices(sample, rows)
            )
            if squares:
                _replica_copy(self._accumulated_squares[i]).scatter_add(
                    tf.IndexedSlices(tf.square(sample), rows)
                )
            _replica_copy(self._accumulated_rows[i]).scatter_update(
                tf.IndexedSlices(tf.ones_like(rows, tf.float32), rows)
            )

    def _gathered_rows(self, index, gradient, is_update_step):
        """At an update step, this replica's marked rows of variable
        `index` and its sums there: ``(rows, sums, sums and squares side
        by side)`` (`_squares`' layout; an empty stand-in for the last
        between GSNR updates); empty otherwise."""
        marks = _replica_copy(self._accumulated_rows[index])
        sum_slot = _replica_copy(self._accumulated_gradients[index])
        square_slot = _replica_copy(self._accumulated_squares[index])
        shape = gradient.dense_shape

        def gather(measure):
            rows = tf.cast(tf.where(marks.read_value() > 0.0)[:, 0], gradient.indices.dtype)
            rows = _at_least_one_row(tf.IndexedSlices(rows[:, None], rows)).indices
            sums = tf.IndexedSlices(sum_slot.sparse_read(rows), rows, shape)
            if measure:
                moments = _side_by_side(sums.values, square_slot.sparse_read(rows), sums)
            else:
                moments = _empty_like(gradient, doubled=True)
            return rows, sums, moments

        def none():
            empty = _empty_like(gradient)
            return empty.indices, empty, _empty_like(gradient, doubled=True)

        def at_update():
            if self.gsnr_interval == 1:
                return gather(True)
            return tf.cond(self._is_gsnr_update(), lambda: gather(True), lambda: gather(False))

        return tf.cond(is_update_step, at_update, none)

    def _moment_accumulation(self, indices, squares):
        """``sum += g_d; squares += g_d^2; samples += 1`` for the variables
        at `indices` (without the squares unless `squares`), with ``g_d = R *
        g`` (Keras scales a replica's loss by 1/R), made once per set of
        variables like `_device_update`.

        The slots are captured, not passed: a captured on-read slot is this
        replica's copy, and a trace is made per replica device. (Passed as
        arguments, distributed slots are bound at trace time too, so a
        function shared by several optimizers writes to the slots it was
        first traced with.)
        """
        if (indices, squares) in self._moment_accumulations:
            return self._moment_accumulations[(indices, squares)]
        sum_slots = [self._accumulated_gradients[i] for i in indices]
        square_slots = [self._accumulated_squares[i] for i in indices]
        samples = self._accumulated_samples

        def accumulate(grads):
            replicas = tf.distribute.get_strategy().num_replicas_in_sync
            for gradient, sum_slot, square_slot in zip(grads, sum_slots, square_slots):
                sample = gradient * float(replicas) if replicas > 1 else gradient
                # On the tf.Variables (see `ReplicaAccumulationMixin`: Keras'
                # `assign_add` fails on (0, n) variables).
                _tf_variable(sum_slot).assign_add(sample)
                if squares:
                    _tf_variable(square_slot).assign_add(tf.square(sample))
            samples.assign_add(1.0)

        if self.jit_update:
            accumulate = tf.function(accumulate, jit_compile=True)
        self._moment_accumulations[(indices, squares)] = accumulate
        return accumulate

    def _reset_accumulators(self, indices, sparse, rows):
        def reset(slots):
            for slot in slots:
                slot.assign(tf.zeros(slot.shape, slot.dtype))

        dense = [i for j, i in enumerate(indices) if j not in sparse]
        reset(self._accumulated_gradients[i] for i in dense)
        squares = [self._accumulated_squares[i] for i in dense]
        if self.gsnr_interval == 1:
            reset(squares)
        else:  # the squares hold sums at GSNR updates only
            tf.cond(self._is_gsnr_update(), lambda: reset(squares), lambda: None)
        # Row-sparse sums: zeros at the rows they hold, at the cost of the rows.
        for j, marked in zip(sparse, rows):
            i = indices[j]
            for slots in (self._accumulated_gradients, self._accumulated_squares):
                slot = _replica_copy(slots[i])
                zeros = tf.zeros(tf.concat([tf.shape(marked), slot.shape[1:]], 0), slot.dtype)
                slot.scatter_update(tf.IndexedSlices(zeros, marked))
            _replica_copy(self._accumulated_rows[i]).scatter_update(
                tf.IndexedSlices(tf.zeros_like(marked, tf.float32), marked)
            )
        self._accumulated_samples.assign(0.0)

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

    # -- cross-replica context ------------------------------------------------

    def _is_update_step(self):
        return is_update_step(self)

    def _is_gsnr_update(self):
        """Whether the update in progress (t = iterations + 1) measures the
        GSNR: t = 1, N + 1, 2N + 1, ..."""
        return tf.equal(self.iterations % self.gsnr_interval, 0)

    def _gsnr_update_count(self):
        """GSNR updates up to and including the update in progress (the
        GSNR momentum's bias correction counts them)."""
        return tf.cast(self.iterations // self.gsnr_interval + 1, tf.float32)

    def _cross_replica_update(
        self, distribution, sums, squares, samples, variables, indices, groups
    ):
        # `sums` and `squares` in `_grouped`'s order: the large dense
        # variables, the row-sparse ones, then the small dense ones as one
        # flat vector.
        large, sparse, packed = groups
        tf_variables = [_tf_variable(v) for v in variables]
        # Where each message goes (a variable's devices); the flat vector
        # goes where the first small variable lives.
        targets = [tf_variables[j] for j in large + sparse] + [tf_variables[j] for j in packed[:1]]
        dense = list(range(len(large))) + ([len(sums) - 1] if packed else [])
        rows_of = range(len(large), len(large) + len(sparse))
        large_indices = tuple(indices[j] for j in large)
        packed_indices = tuple(indices[j] for j in packed)
        sparse_indices = tuple(indices[j] for j in sparse)

        def update(measure):
            # One collective call for both sums of every variable (and, with
            # accumulation, the sample count); between GSNR updates, for the
            # gradient sums alone. Row-sparse sums travel as the rows each
            # replica holds (sums and squares side by side), gathered, not
            # summed into a table.
            values = [(sums[p], targets[p]) for p in dense]
            if measure:
                values += [(squares[p], targets[p]) for p in dense]
            values += [((squares if measure else sums)[p], targets[p]) for p in rows_of]
            if samples is not None:
                values.append((samples, tf_variables[0]))
            reduced = distribution.extended.batch_reduce_to(tf.distribute.ReduceOp.SUM, values)
            count = len(dense)
            rows_start = 2 * count if measure else count
            learning_rate = tf.convert_to_tensor(self.learning_rate)
            make = self._device_update if measure else self._device_scale_update
            device_update = make(large_indices, packed_indices, sparse_indices)
            # `fn` runs once per device holding the variables, inside that
            # device's update context: one compiled program per device updates
            # all of that device's copies.
            # (Plain statements, no conditional expressions in the call:
            # autograph, converting this inside a one-device tf.function,
            # mangles them.)
            dense_squares = None
            if measure:
                dense_squares = reduced[count : 2 * count]
            sample_count = None
            if samples is not None:
                sample_count = reduced[-1]
            distribution.extended.update_non_slot(
                distribution.extended.non_slot_devices(tf_variables),
                device_update,
                args=(
                    reduced[:count],
                    dense_squares,
                    reduced[rows_start : rows_start + len(sparse)],
                    sample_count,
                    learning_rate,
                    self._gsnr_update_count(),
                    distribution.num_replicas_in_sync,
                ),
                group=False,
            )

        def gsnr_or_scale_update():
            if self.gsnr_interval == 1:
                update(True)
            else:
                tf.cond(
                    self._is_gsnr_update(),
                    lambda: update(True),
                    lambda: update(False),
                )

        if not self.gradient_accumulation_steps:
            gsnr_or_scale_update()
        else:
            # In cross-replica context, so that no merge_call sits in a cond.
            tf.cond(self._is_update_step(), gsnr_or_scale_update, lambda: None)

    def _device_update(self, indices, packed_indices=(), sparse_indices=()):
        """The VR update on one device of the large dense variables at
        `indices`, the small ones at `packed_indices` (their reduced sums as
        one flat vector) and the row-sparse ones at `sparse_indices`
        (`_row_sparse_update`), made once per set of variables and traced
        once per device.

        The large variables (over `PACKED_MAX_ELEMENTS` elements) are
        updated by one XLA program (unless `jit_update` is False): GSNR,
        GSNR momentum and the base rule, fused per variable. The small ones
        (biases, normalisation scales: most of the variables of a ResNet or
        a transformer, a few percent of its parameters) travel and are
        measured as one flat vector (`_packed_update`), since compiling,
        launching kernels or sending a message per variable costs more than
        their bytes.

        Both capture the variables and slots rather than taking them as
        arguments, like `_moment_accumulation`. Traced inside a device's
        update context, a captured mirrored variable is that device's copy,
        so each device gets one trace of its own, whatever the number of
        variables.
        """
        key = (indices, packed_indices, sparse_indices)
        if key in self._variable_updates:
            return self._variable_updates[key]
        fused_updates = [self._variable_update(i) for i in indices]

        def fused_update(sums, squares, samples, learning_rate, step, replicas):
            hyper = self._shared_scalars(step)
            for update, sum_of_gradients, sum_of_squares in zip(fused_updates, sums, squares):
                update(sum_of_gradients, sum_of_squares, samples, learning_rate, hyper, replicas)

        if self.jit_update:
            fused_update = tf.function(fused_update, jit_compile=True, autograph=False)
        packed_update = self._packed_update(packed_indices)
        row_update = self._row_sparse_update(sparse_indices, measure=True)
        count = len(indices)

        # Plain Python over fixed lists, kept from autograph: converted inside
        # a one-device tf.function, in a process that has converted other
        # optimizers' updates, the closure fails to find `fused_update`.
        @tf.autograph.experimental.do_not_convert
        def device_update(sums, squares, row_moments, *scalars):
            if indices:
                fused_update(sums[:count], squares[:count], *scalars)
            if packed_indices:
                packed_update(sums[count], squares[count], *scalars)
            if sparse_indices:
                row_update(row_moments, *scalars)

        # The compiled program, whose traces the tests count.
        device_update.compiled = fused_update if indices and self.jit_update else None
        self._variable_updates[key] = device_update
        return device_update

    def _device_scale_update(self, indices, packed_indices=(), sparse_indices=()):
        """The update between GSNR updates on one device, for the variables
        of `_device_update`: the mean gradient from the reduced sums, times
        the scale of the last GSNR update (its `gsnr_scale` slot, or with
        beta_3 > 0 the GSNR momentum over the correction, which counts GSNR
        updates), then the base rule. The large variables in one XLA
        program, the small ones on their flat vector."""
        key = ("scale", indices, packed_indices, sparse_indices)
        if key in self._variable_updates:
            return self._variable_updates[key]
        variables, decays, _ = self._update_targets(indices)
        scale_slots = [self._gsnr_scales[i] for i in indices]
        momentum_slots = [self._gsnr_momentums[i] for i in indices]
        targets = list(zip(variables, decays, scale_slots, momentum_slots))

        def fused_update(sums, samples, learning_rate, gsnr_updates, replicas):
            correction = functional.gsnr_momentum_correction(self.beta_3, gsnr_updates)
            for (variable, decays, scale_slot, momentum_slot), total in zip(targets, sums):
                gradient_mean = total if samples is None else total / samples
                applied = momentum_slot / correction if momentum_slot is not None else scale_slot
                self._apply_base_rule(variable, decays, applied * gradient_mean, learning_rate)

        if self.jit_update:
            fused_update = tf.function(fused_update, jit_compile=True, autograph=False)
        packed_update = self._packed_scale_update(packed_indices)
        row_update = self._row_sparse_update(sparse_indices, measure=False)
        count = len(indices)

        # Plain Python over fixed lists: nothing for autograph to convert
        # (see `_device_update`).
        @tf.autograph.experimental.do_not_convert
        def device_update(sums, squares, row_sums, *scalars):
            if indices:
                fused_update(sums[:count], *scalars)
            if packed_indices:
                packed_update(sums[count], *scalars)
            if sparse_indices:
                row_update(row_sums, *scalars)

        self._variable_updates[key] = device_update
        return device_update

    def _shared_scalars(self, step):
        """Scalars shared by every variable of an update: one constant each
        in the program, not one per variable."""
        return {
            "gamma": tf.constant(self.gamma, tf.float32),
            "epsilon": tf.constant(self.gsnr_epsilon, tf.float32),
            "beta_3": tf.constant(self.beta_3, tf.float32),
            "correction": functional.gsnr_momentum_correction(self.beta_3, step),
        }

    def _packed_update(self, indices):
        """The VR update of the (small) variables at `indices`, from their
        reduced sums as one flat vector each (`_grouped`'s order).

        The GSNR and its momentum are computed element-wise on the whole,
        the per-variable means by one segment sum (in float64, exact to
        float32 round-off whatever the sizes), and the scaled gradient is
        split back; each variable's base rule then runs as Keras runs it,
        outside XLA. The ops do not grow with the number of variables,
        except the reshapes, splits and assignments.
        """
        if not indices:
            return None
        variables, decays, sizes = self._update_targets(indices)
        momentum_slots = [self._gsnr_momentums[i] for i in indices]
        scale_slots = [self._gsnr_scales[i] for i in indices]
        statistics_slots = [self._gsnr_monitor.value[i] for i in indices]
        segment_ids = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)

        def packed_update(sums, squares, samples, learning_rate, step, replicas):
            hyper = self._shared_scalars(step)
            segments = tf.constant(segment_ids)
            gradient_mean, second_moment = _moments(sums, squares, samples, replicas)
            new = functional.gsnr_scale(
                gradient_mean,
                second_moment,
                **hyper,
                previous_scale=_optional(_flatten, scale_slots),
                previous_momentum=_optional(_flatten, momentum_slots),
                segments=(segments, sizes),
                statistics=statistics_slots[0] is not None,
            )
            if scale_slots[0] is not None:
                _assign_split(scale_slots, new.scale, sizes)
            if momentum_slots[0] is not None:
                _assign_split(momentum_slots, new.momentum, sizes)
            if statistics_slots[0] is not None:
                for slot, row in zip(statistics_slots, tf.unstack(new.statistics)):
                    slot.assign_add(tf.concat([row, [1.0]], 0))
            self._apply_split(variables, decays, sizes, new.applied * gradient_mean, learning_rate)

        return packed_update

    def _packed_scale_update(self, indices):
        """`_packed_update` between GSNR updates: the flat mean gradient
        times the flat last scale (or corrected GSNR momentum), split back
        to each variable's base rule."""
        if not indices:
            return None
        variables, decays, sizes = self._update_targets(indices)
        momentum_slots = [self._gsnr_momentums[i] for i in indices]
        scale_slots = [self._gsnr_scales[i] for i in indices]

        def packed_update(total, samples, learning_rate, gsnr_updates, replicas):
            gradient_mean = total if samples is None else total / samples
            if momentum_slots[0] is not None:
                correction = functional.gsnr_momentum_correction(self.beta_3, gsnr_updates)
                applied = _flatten(momentum_slots) / correction
            else:
                applied = _flatten(scale_slots)
            self._apply_split(variables, decays, sizes, applied * gradient_mean, learning_rate)

        return packed_update

    def _update_targets(self, indices):
        """(tf.Variables, whether each decays in Keras' decoupled way,
        sizes) of the variables at `indices`."""
        keras_variables = [self._trainable_variables[i] for i in indices]
        decays = [self._decays_decoupled(v) for v in keras_variables]
        variables = [_tf_variable(v) for v in keras_variables]
        return variables, decays, [variable_size(v) for v in variables]

    def _decays_decoupled(self, keras_variable):
        """Whether `_apply_base_rule` decays this variable Keras' way."""
        return bool(self.weight_decay) and self._use_weight_decay(keras_variable)

    def _apply_split(self, variables, decays, sizes, scaled_gradient, learning_rate):
        """Each variable's base rule on its piece of the flat `scaled_gradient`."""
        for variable, decay, gradient in zip(variables, decays, tf.split(scaled_gradient, sizes)):
            self._apply_base_rule(
                variable, decay, tf.reshape(gradient, variable.shape), learning_rate
            )

    def _row_sparse_update(self, indices, measure):
        """The VR update of the variables at `indices` from row-sparse sums,
        on one device, at the cost of the rows: the reduced rows of every
        replica (duplicates across replicas summed), their moments, GSNR
        and momentum (the layer mean over the measured elements: rows no
        sample touched have none), the slots written at those rows, and the
        base rule given the scaled rows as a `tf.IndexedSlices` (as Keras
        applies an embedding's gradient). Between GSNR updates
        (`measure` False) the sums hold gradients alone and the rows' last
        scale is applied. Runs outside XLA: the number of rows is known
        only at run time."""
        targets = []
        for i in indices:
            keras_variable = self._trainable_variables[i]
            targets.append(
                (
                    _tf_variable(keras_variable),
                    self._decays_decoupled(keras_variable),
                    _optional_tf_variable(self._gsnr_scales[i]),
                    _optional_tf_variable(self._gsnr_momentums[i]),
                    _optional_tf_variable(self._gsnr_row_updates[i]),
                    self._gsnr_monitor.value[i],
                )
            )

        def row_update(reduced, samples, learning_rate, step, replicas):
            for target, rows_of_replicas in zip(targets, reduced):
                variable, decays, scale_slot, momentum_slot, count_slot, _ = target
                table_shape = tf.constant(variable.shape.as_list(), tf.int64)
                # Each replica's rows are unique already: only rows from
                # several replicas can repeat. (One replica under XLA must
                # not call `tf.unique` on them either: on the run-time-sized
                # list of accumulated rows it takes XLA's padding for rows.)
                gradient = (
                    functional.sum_duplicate_rows(rows_of_replicas)
                    if replicas > 1
                    else rows_of_replicas
                )
                rows = gradient.indices
                if measure:
                    sums, squares = tf.split(gradient.values, 2, axis=-1)
                    gradient_mean, second_moment = _moments(sums, squares, samples, replicas)
                    applied = self._measured_row_scale(
                        rows, gradient_mean, second_moment, target[2:]
                    )
                else:
                    sums = gradient.values
                    gradient_mean = sums if samples is None else sums / samples
                    if momentum_slot is not None:
                        counts = functional.row_broadcast(tf.gather(count_slot, rows), sums)
                        correction = functional.gsnr_momentum_correction(self.beta_3, counts)
                        # A row never measured takes the base rule (1).
                        applied = tf.where(
                            counts > 0.0, tf.gather(momentum_slot, rows) / correction, 1.0
                        )
                    else:
                        applied = tf.gather(scale_slot, rows)
                scaled = tf.IndexedSlices(applied * gradient_mean, rows, table_shape)
                self._apply_base_rule(variable, decays, scaled, learning_rate)

        return row_update

    def _measured_row_scale(self, rows, gradient_mean, second_moment, slots):
        """GSNR, clip and momentum of the `rows` of one variable at a GSNR
        update; writes its slots at those rows and returns the applied
        factor."""
        scale_slot, momentum_slot, count_slot, statistics_slot = slots
        at_rows = functools.partial(_optional, lambda slot: tf.gather(slot, rows))
        # Each row's bias correction counts the GSNR updates in which it
        # had a sample (docs/algorithms.md §3).
        new = functional.gsnr_scale(
            gradient_mean,
            second_moment,
            self.gamma,
            self.gsnr_epsilon,
            beta_3=self.beta_3,
            previous_scale=at_rows(scale_slot),
            previous_momentum=at_rows(momentum_slot),
            previous_row_updates=at_rows(count_slot if momentum_slot is not None else None),
            statistics=statistics_slot is not None,
        )
        if scale_slot is not None:
            scale_slot.scatter_update(tf.IndexedSlices(new.scale, rows))
        if momentum_slot is not None:
            count_slot.scatter_update(tf.IndexedSlices(new.row_updates, rows))
            momentum_slot.scatter_update(tf.IndexedSlices(new.momentum, rows))
        if statistics_slot is not None:
            statistics_slot.assign_add(tf.concat([new.statistics, [1.0]], 0))
        return new.applied

    def _variable_update(self, index):
        """The VR update of one variable, as a Python function of the reduced
        sums: GSNR, its momentum, then the base rule's `update_step`."""
        keras_variable = self._trainable_variables[index]
        variable = _tf_variable(keras_variable)
        decays = self._decays_decoupled(keras_variable)
        gsnr_momentum_slot = self._gsnr_momentums[index]
        scale_slot = self._gsnr_scales[index]
        statistics_slot = self._gsnr_monitor.value[index]

        def vr_update(sum_of_gradients, sum_of_squares, samples, learning_rate, hyper, replicas):
            gradient_mean, second_moment = _moments(
                sum_of_gradients, sum_of_squares, samples, replicas
            )
            new = functional.gsnr_scale(
                gradient_mean,
                second_moment,
                **hyper,
                previous_scale=scale_slot,
                previous_momentum=gsnr_momentum_slot,
                statistics=statistics_slot is not None,
            )
            if scale_slot is not None:
                scale_slot.assign(new.scale)
            if gsnr_momentum_slot is not None:
                gsnr_momentum_slot.assign(new.momentum)
            if statistics_slot is not None:
                # Running sums of tf_vrgd.statistics' columns and the update
                # count. Off by default: XLA on CPU runs these reductions
                # slowly (`scripts/bench_step.py --statistics`).
                statistics_slot.assign_add(tf.concat([new.statistics, [1.0]], 0))
            self._apply_base_rule(variable, decays, new.applied * gradient_mean, learning_rate)

        return vr_update

    def _apply_base_rule(self, variable, decays, scaled_gradient, learning_rate):
        """Keras' decoupled weight decay (if `decays`, applied as Keras does),
        then the base rule's `update_step` on the scaled gradient (a
        `tf.IndexedSlices` for row-sparse gradients, made dense first for
        base rules that are dense by nature: `_row_sparse_base_rule`)."""
        if isinstance(scaled_gradient, tf.IndexedSlices) and not self._row_sparse_base_rule:
            scaled_gradient = tf.convert_to_tensor(scaled_gradient)
        if decays:
            _decay(variable, self.weight_decay, learning_rate)
        self.update_step(tf.cast(scaled_gradient, variable.dtype), variable, learning_rate)

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
    while optimizer is not None and not isinstance(optimizer, GSNRMixin):
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return optimizer


def _rows(variable):
    """The shape of a per-row slot of `variable`, None for a scalar."""
    return (variable.shape[0],) if len(variable.shape) else None


def _float32_rows_or_dense(gradient):
    """`gradient` in float32: row-sparse if it is a `tf.IndexedSlices` of a
    table of rank 2 or more (an embedding), dense otherwise. A rank-1
    table's rows are single numbers (a per-item bias looked up by id), and
    the row path lays a row's sum and square side by side along its last
    axis, which such rows do not have; made dense, it costs one number per
    row of the table."""
    if isinstance(gradient, tf.IndexedSlices) and gradient.values.shape.rank == 1:
        return functional.as_float32(gradient)
    return functional.as_float32_slices(gradient)


def _at_least_one_row(slices):
    """`slices`, or row 0 with zeros where it has no rows: a zero row
    changes no sum, and with TensorFlow 2.21's collectives on CPU, rows
    made by `tf.unique` of nothing on every replica and then all-gathered
    end the process (a segmentation fault; so do Keras' own optimizers
    given an empty `tf.IndexedSlices` on every replica)."""
    missing = tf.cast(tf.equal(tf.size(slices.indices), 0), tf.int32)
    padding = tf.zeros(tf.concat([[missing], tf.shape(slices.values)[1:]], 0), slices.values.dtype)
    return tf.IndexedSlices(
        tf.concat([slices.values, padding], 0),
        tf.concat([slices.indices, tf.zeros([missing], slices.indices.dtype)], 0),
        slices.dense_shape,
    )


def _replica_copy(slot):
    """This replica's own copy of an on-read slot, in replica context: the
    distributed variable takes no scatter (TensorFlow's
    `_get_on_device_or_primary`, which its own reads use; a plain variable
    outside a strategy is its own copy)."""
    variable = _tf_variable(slot)
    local = getattr(variable, "_get_on_device_or_primary", None)
    return local() if local is not None else variable


def _optional(function, value):
    """`function(value)`, or None for a missing slot (None, or a list of
    them)."""
    if value is None or (isinstance(value, list) and value[0] is None):
        return None
    return function(value)


def _optional_tf_variable(slot):
    return None if slot is None else _tf_variable(slot)


def _update_groups(variables, sparse):
    """Positions of `variables` in three groups: large dense (over
    `PACKED_MAX_ELEMENTS` elements), row-sparse (`sparse`), small dense."""
    large, packed = [], []
    for j, variable in enumerate(variables):
        if j not in sparse:
            (packed if variable_size(variable) <= PACKED_MAX_ELEMENTS else large).append(j)
    return tuple(large), tuple(sparse), tuple(packed)


def _grouped(tensors, groups):
    """`tensors` (one per position) in the order of `groups`: the large
    dense ones, the row-sparse ones, then the small dense ones concatenated
    into one flat vector (one message in the collective, one pass on each
    device)."""
    large, sparse, packed = groups
    out = [tensors[j] for j in large + sparse]
    if packed:
        out.append(_flatten([tensors[j] for j in packed]))
    return out


def _flatten(tensors):
    """The elements of `tensors`, one after the other, as one vector."""
    return tf.concat([tf.reshape(t, [-1]) for t in tensors], 0)


def _squares(grads):
    """What the GSNR update reduces beside the gradient sums: the squares
    of dense gradients, and for row-sparse ones the rows' values and their
    squares side by side (one gathered message per variable)."""
    out = []
    for g in grads:
        if isinstance(g, tf.IndexedSlices):
            out.append(_side_by_side(g.values, tf.square(g.values), g))
        else:
            out.append(tf.square(g))
    return out


def _side_by_side(sums, squares, like):
    """Row sums and squares as one `tf.IndexedSlices` (the last axis
    doubled, in its values and its dense shape) at the rows of `like`."""
    shape = tf.cast(like.dense_shape, tf.int64)
    shape = tf.concat([shape[:-1], 2 * shape[-1:]], 0)
    return tf.IndexedSlices(tf.concat([sums, squares], -1), like.indices, shape)


def _empty_like(gradient, doubled=False):
    """An empty stand-in of the kind of `gradient` (for a `tf.cond` branch
    whose value is not read); of `_side_by_side`'s kind if `doubled`."""
    if isinstance(gradient, tf.IndexedSlices):
        values = tf.zeros([0, *gradient.values.shape[1:]], gradient.values.dtype)
        empty = tf.IndexedSlices(
            values, tf.zeros([0], gradient.indices.dtype), gradient.dense_shape
        )
        return _side_by_side(values, values, empty) if doubled else empty
    return tf.zeros([0])


def _assign_split(slots, flat, sizes):
    """Assigns the consecutive pieces of `flat` of `sizes` to `slots`."""
    for slot, value in zip(slots, tf.split(flat, sizes)):
        slot.assign(tf.reshape(value, slot.shape))


def _moments(sum_of_gradients, sum_of_squares, samples, replicas):
    """``(gbar, s)``: from Keras-scaled replica gradients when `samples` is
    None (no accumulation), else from the accumulated samples and their
    count."""
    if samples is None:
        return functional.gradient_moments(sum_of_gradients, sum_of_squares, replicas, 1)
    return functional.sample_moments(sum_of_gradients, sum_of_squares, samples)


class _Untracked:
    """Holds a value out of sight of Keras' and TensorFlow's trackers, so
    that it is neither optimizer state nor saved in checkpoints."""

    def __init__(self, value):
        self.value = value
