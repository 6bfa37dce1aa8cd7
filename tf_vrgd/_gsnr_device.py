"""`DevicePrograms`: the VR hook after the replicas (docs/hook.md): the
collective of an update and, on each device, the program that turns the
reduced sums into the scaled gradient and hands it to the base rule. It
owns the rule's slots and the programs."""

import numpy as np
import tensorflow as tf

from tf_vrgd import _gsnr_slots as slots_
from tf_vrgd import functional
from tf_vrgd._device_trace import OnEveryDevice, TracedOnce
from tf_vrgd._gsnr_slots import GSNRState, rows_shape
from tf_vrgd._keras_adapters import tf_variable
from tf_vrgd.statistics import ROW_WIDTH, variable_size


class DevicePrograms:
    """The device side of the VR hook for the optimizer's `variables`.

    `make_slots(name, **options)` makes one float32 slot per variable (the
    face's); `rule` is the `GSNRRule`, `cadence` the GSNR `Cadence`;
    `base_rule(index)` gives ``apply(scaled_gradient, learning_rate)``, the
    base optimizer's rule for variable `index`; `program_variables()` the
    distributed variables a program may touch (`OnEveryDevice`). `jit`
    compiles the large variables' program; `keep_scale` keeps the last
    scale between GSNR updates; `track_statistics` sums the statistics;
    `make_hint(name)` makes a float32 scalar kept out of `variables` and
    checkpoints (the face's), for the layer means' `masked_hint`.
    """

    def __init__(
        self,
        make_slots,
        variables,
        rule,
        cadence,
        base_rule,
        program_variables,
        *,
        jit,
        keep_scale,
        track_statistics,
        make_hint,
    ):
        self.variables, self.rule, self.cadence = list(variables), rule, cadence
        self._base_rule, self._program_variables, self._jit = base_rule, program_variables, jit
        none = [None] * len(self.variables)
        momentum = rule.beta_3 > 0
        # Made in this order, the order of the optimizer's `variables`.
        momentums = make_slots("gsnr_momentum") if momentum else none
        # The scale of the last GSNR update, applied until the next one
        # (without a GSNR momentum); 1, the base rule, before any.
        scales = make_slots("gsnr_scale", initializer="ones") if keep_scale else none
        # Per row, the GSNR updates in which the row had a sample: the
        # momentum's bias correction of tables (docs/algorithms.md §3). Which
        # variables arrive row-sparse shows only at the first update, so
        # every one with rows has one.
        row_updates = make_slots("gsnr_row_updates", shape=rows_shape) if momentum else none
        # Diagnostics, not state: kept out of `variables` and checkpoints.
        statistics = none
        if track_statistics:
            statistics = make_slots("gsnr_statistics", shape=(ROW_WIDTH,), track=False)
        self.state = GSNRState(scales, momentums, row_updates, statistics)
        # 1 where the last update's layer means had an unmeasured element:
        # the next one takes the masked means first (`_layer_means`). Only
        # which program runs first depends on it, never a value; a restored
        # or new optimizer starts at 0.
        self.masked_hint = make_hint("gsnr_masked_hint") if jit else None
        self.programs = {}

    @property
    def untracked_variables(self):
        """The variables of these programs outside the optimizer's
        `variables`: the statistics slots and the hint."""
        statistics = [slot for slot in self.state.statistics if slot is not None]
        return statistics + ([self.masked_hint] if self.masked_hint is not None else [])

    def update(self, distribution, layout, sums, squares, samples, learning_rate, iterations):
        """In cross-replica context, once per update: one `batch_reduce_to`
        SUM of `layout`'s messages, then on each device, in its update
        context (`update_non_slot`), that device's program."""

        options = _communication(distribution)

        def update(measure):
            values = layout.collective(sums, squares, samples, measure)
            reduced = distribution.extended.batch_reduce_to(
                tf.distribute.ReduceOp.SUM, values, options=options
            )
            devices = [tf_variable(v) for v in layout.variables]
            distribution.extended.update_non_slot(
                distribution.extended.non_slot_devices(devices),
                self._program(layout, measure, samples is not None),
                args=(
                    list(reduced),
                    learning_rate,
                    self.cadence.measured_updates(iterations),
                    distribution.num_replicas_in_sync,
                ),
                group=False,
            )

        self.cadence.choose(iterations, lambda: update(True), lambda: update(False))

    def slots(self, indices, rows=False):
        """The `GSNRState` of the variables at `indices` (tf.Variables),
        with the row counts only for a table's `rows`."""

        def pick(slots):
            if not indices or slots[indices[0]] is None:
                return None
            return [tf_variable(slots[i]) for i in indices]

        picked = GSNRState(*(pick(slots) for slots in self.state))
        return picked if rows else picked._replace(row_updates=None)

    def _program(self, layout, measure, has_samples):
        """The device program of `layout` at a GSNR update (`measure`) or
        between, made once and traced once for every device: the large
        dense variables in one XLA program (unless `jit` is False), the
        small ones as one flat vector, the row-sparse ones at their rows.

        Each part captures the variables and slots rather than taking them
        as arguments: traced in the first device's update context, a
        captured mirrored variable is that device's copy, and
        `OnEveryDevice` runs the one trace on every device with the
        captures rebound to its copies."""
        key = (measure, has_samples, layout.key)
        if key in self.programs:
            return self.programs[key]
        large, sparse, packed = layout.key
        layer_means = self._layer_means(large) if measure and large else None
        fused = self._large_update(large, measure)
        if self._jit:
            fused = tf.function(fused, jit_compile=True, autograph=False)
        packed_update = self._packed_update(packed, measure)
        row_update = self._row_update(sparse, measure)

        # Plain Python over fixed lists, kept from autograph (converted in a
        # process that converted other optimizers' updates, the closure
        # fails to find `fused`).
        @tf.autograph.experimental.do_not_convert
        def device_update(reduced, learning_rate, step, replicas):
            reduced = layout.unpack(reduced, measure, has_samples)
            scalars = (reduced.samples, learning_rate, step, replicas)
            if large:
                sums, squares = reduced.large_sums, reduced.large_squares
                means = None
                if measure:
                    means = layer_means(sums, squares, reduced.samples, replicas)
                fused(sums, squares, *scalars, means)
            if packed:
                packed_update(reduced.packed_sum, reduced.packed_square, *scalars)
            if sparse:
                row_update(reduced.rows, *scalars)

        program = OnEveryDevice(device_update, self._program_variables)
        # The compiled program, whose traces the tests count, and the
        # programs every device shares.
        program.compiled = fused if large and self._jit else None
        program.shared = () if layer_means is None else layer_means.shared
        self.programs[key] = program
        return program

    def _layer_means(self, indices):
        """The layer means (eq. 8) of the large variables at `indices` as
        one tensor, from their reduced sums.

        With XLA, one of two ways, both exact, each a program that takes
        tensors only so that one trace serves every device (`TracedOnce`):
        the masked means (`functional.masked_gsnr_totals`: selects and a
        count), or first one reduction per variable with no select
        (`functional.gsnr_element_sums`), which is cheaper and gives every
        mean when every element is measured, and the masked means after it
        when one is not. The masked means go first after an update that
        had an unmeasured element (`masked_hint`): a unit no sample reaches
        (a dead ReLU channel, the outer taps of a 3 x 3 kernel on a 1 x 1
        map) stays so for many updates, and the element sums are then paid
        for nothing (ResNet-50 on 32 x 32 inputs, 2 CPU replicas: the
        training step 0.90 of its time; docs/RESULTS.md).

        Without XLA the masked means alone, with no conditional: each op is
        a kernel of its own either way, and the conditional made the step
        dearer (ResNet-50, 2 CPU replicas: 0.854 of its time, control
        1.028; docs/RESULTS.md)."""
        sizes = [variable_size(tf_variable(self.variables[i])) for i in indices]
        epsilon = self.rule.epsilon

        def moments_of(sums, squares, samples, replicas):
            return [slots_.reduced_moments(*pair, samples, replicas) for pair in zip(sums, squares)]

        def masked_totals(sums, squares, samples, replicas):
            totals, counts = functional.masked_gsnr_totals(
                moments_of(sums, squares, samples, replicas), epsilon
            )
            return tf.stack(totals), tf.stack(counts)

        if not self._jit:

            def selected_means(sums, squares, samples, replicas):
                totals, counts = masked_totals(sums, squares, samples, replicas)
                return tf.math.divide_no_nan(totals, counts)

            selected_means.shared = ()
            return selected_means

        def element_sums(sums, squares, samples, replicas):
            return functional.gsnr_element_sums(
                moments_of(sums, squares, samples, replicas), epsilon
            )

        element_sums = TracedOnce(element_sums, jit_compile=True)
        masked_program = TracedOnce(masked_totals, jit_compile=True)
        hint = tf_variable(self.masked_hint)

        def layer_means(sums, squares, samples, replicas):
            def masked():
                totals, counts = masked_program(sums, squares, samples, replicas=replicas)
                every_element = tf.reduce_all(counts == tf.constant(sizes, tf.float32))
                return tf.math.divide_no_nan(totals, counts), every_element

            def element_sums_first():
                totals = element_sums(sums, squares, samples, replicas=replicas)
                means = functional.mean_gsnrs_of_element_sums(
                    totals, sizes, lambda: tf.unstack(masked()[0])
                )
                return tf.stack(means), tf.reduce_all(tf.math.is_finite(tf.stack(totals)))

            means, every_element = tf.cond(hint.read_value() > 0.0, masked, element_sums_first)
            hint.assign(tf.where(every_element, 0.0, 1.0))
            return means

        layer_means.shared = (element_sums, masked_program)
        return layer_means

    def _large_update(self, indices, measure):
        """The update of the large variables at `indices`, one after the
        other: each one's `scaled_gradient` (given its layer mean at a GSNR
        update), then its base rule."""
        appliers = [self._base_rule(i) for i in indices]
        slots = [self.slots([i]) for i in indices]
        rule = self.rule

        def update(sums, squares, samples, learning_rate, step, replicas, means):
            constants, correction = rule.in_program(step, measure)
            squares = squares or [None] * len(sums)
            means = [None] * len(sums) if means is None else tf.unstack(means)
            for apply, kept, total, square, mean in zip(appliers, slots, sums, squares, means):
                view = slots_.WholeVariable(mean)
                scaled = slots_.scaled_gradient(
                    view, kept, constants, total, square, samples, replicas, step, correction
                )
                apply(scaled, learning_rate)

        return update

    def _packed_update(self, indices, measure):
        """The update of the small variables at `indices` from their reduced
        sums as one flat vector: the rule element-wise on the whole, the
        layer means by one segment sum (in float64), the scaled gradient
        split back to each variable's base rule, outside XLA. The ops do not
        grow with the number of variables, except the splits and writes."""
        if not indices:
            return None
        appliers = [self._base_rule(i) for i in indices]
        kept = self.slots(list(indices))
        shapes = [self.variables[i].shape for i in indices]
        sizes = [variable_size(tf_variable(self.variables[i])) for i in indices]
        segment_ids = np.repeat(np.arange(len(sizes), dtype=np.int32), sizes)
        rule = self.rule

        def packed_update(total, squares, samples, learning_rate, step, replicas):
            constants, correction = rule.in_program(step, measure)
            view = slots_.PackedVariables(tf.constant(segment_ids), sizes)
            scaled = slots_.scaled_gradient(
                view, kept, constants, total, squares, samples, replicas, step, correction
            )
            for apply, shape, gradient in zip(appliers, shapes, tf.split(scaled, sizes)):
                apply(tf.reshape(gradient, shape), learning_rate)

        return packed_update

    def _row_update(self, indices, measure):
        """The update of the row-sparse variables at `indices`, on one
        device, at the cost of the rows: every replica's reduced rows
        (duplicates across replicas summed), the rule at those rows (the
        layer mean over the measured elements: rows no sample touched have
        none), the slots written there, and the base rule given the scaled
        rows as a `tf.IndexedSlices` (as Keras applies an embedding's
        gradient; docs/algorithms.md §5). Runs outside XLA: the number of
        rows is known only at run time."""
        appliers = [self._base_rule(i) for i in indices]
        slots = [self.slots([i], rows=True) for i in indices]
        shapes = [self.variables[i].shape.as_list() for i in indices]
        rule = self.rule

        def row_update(reduced, samples, learning_rate, step, replicas):
            for apply, kept, shape, gradient in zip(appliers, slots, shapes, reduced):
                shape = tf.constant(shape, tf.int64)
                # Each replica's rows are unique already: only rows from
                # several replicas repeat. (One replica under XLA must not
                # call `tf.unique` on them either: on the run-time-sized list
                # of accumulated rows it takes XLA's padding for rows.)
                if replicas > 1:
                    gradient = functional.sum_duplicate_rows(gradient)
                sums, squares = gradient.values, None
                if measure:
                    sums, squares = tf.split(gradient.values, 2, axis=-1)
                # The rule in Python numbers, as the rows have always been
                # computed (a constant's 1 - beta_3 rounds differently).
                view = slots_.TableRows(gradient.indices)
                scaled = slots_.scaled_gradient(
                    view, kept, rule, sums, squares, samples, replicas, None, None
                )
                apply(tf.IndexedSlices(scaled, gradient.indices, shape), learning_rate)

        return row_update


# On the CPUs of one process, the collective's packs close once they pass
# this size (`_communication`).
PACK_BYTES = 1 << 20


def _communication(distribution):
    """How the collective packs the messages: on the CPUs of one process,
    in packs that close once they pass `PACK_BYTES`, so that a message of
    that size or more mostly travels alone; elsewhere in one pack for all
    (TensorFlow's default, as for Keras' gradients).

    On CPU a pack of many messages is a concatenation and a split of all of
    them, copies as large as the messages, and starts only once the last
    message is made; a pack of one message copies nothing and starts as
    soon as it exists (ResNet-50, 2 CPU replicas: the VR training step
    0.86-0.89 of one pack's, docs/RESULTS.md). But each pack is a
    collective of its own, set up at its first run: a pack per message made
    a file of short fits of small models 7% longer, which the size bound
    takes back (their messages share one pack). On GPUs NCCL launches each
    pack in turn, and over the network each pack pays a round trip:
    neither is measured here, so both keep one pack."""
    local_cpus = isinstance(distribution, tf.distribute.MirroredStrategy) and all(
        tf.DeviceSpec.from_string(device).device_type == "CPU"
        for device in distribution.extended.worker_devices
    )
    return tf.distribute.experimental.CommunicationOptions(
        bytes_per_pack=PACK_BYTES if local_cpus else 0
    )
