"""The collective and the per-device programs of the VR hook
(`tf_vrgd._gsnr`), mixed into `GSNRMixin` as `DevicePrograms`.

In cross-replica context, once per update: one `batch_reduce_to` SUM of
every variable's sums (and, at a GSNR update, squares), then once per
device, inside `extended.update_non_slot`, the device's program
(`_device_update`, traced once and run on each device's copies:
`OnEveryDevice`): per layout (large dense variables fused in one XLA
program, small dense ones packed into one flat vector, row-sparse ones at
their rows) the moments, the rule (`functional.gsnr_scale` at a GSNR
update, `functional.scale_between_gsnr_updates` between), the slot writes,
and the base rule's `update_step`.
"""

import numpy as np
import tensorflow as tf

from tf_vrgd import functional
from tf_vrgd._device_trace import OnEveryDevice, TracedOnce
from tf_vrgd._gsnr_intake import flatten
from tf_vrgd._gsnr_rows import RowSparsePrograms, reduced_moments, row_bundles
from tf_vrgd._keras_adapters import decay as _decay
from tf_vrgd._keras_adapters import tf_variable as _tf_variable
from tf_vrgd.statistics import variable_size


class DevicePrograms(RowSparsePrograms):
    """The cross-replica update of `GSNRMixin` and the programs it runs on
    each device (the slots are made by its `build`; the program of the
    row-sparse variables is `RowSparsePrograms`'s)."""

    def _cross_replica_update(
        self, distribution, sums, squares, samples, variables, indices, groups
    ):
        # `sums` and `squares` in `grouped`'s order: the large dense
        # variables, the row-sparse ones (as `bundled_rows`), then the small
        # dense ones as one flat vector.
        large, sparse, packed = groups
        tf_variables = [_tf_variable(v) for v in variables]
        # Where each message goes (a variable's devices); the flat vector
        # goes where the first small variable lives.
        # (The row-sparse ones as `row_bundles`: one message per bundle,
        # sent where its first table lives.)
        bundles = row_bundles([variables[j].shape for j in sparse])
        firsts = tuple(sparse[positions[0]] for positions, _ in bundles)
        targets = [tf_variables[j] for j in large + firsts] + [tf_variables[j] for j in packed[:1]]
        dense = list(range(len(large))) + ([len(sums) - 1] if packed else [])
        rows_of = range(len(large), len(large) + len(bundles))
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
            device_update = self._device_update(
                measure, large_indices, packed_indices, sparse_indices
            )
            # `fn` runs once per device holding the variables, inside that
            # device's update context: one program, traced once, updates all
            # of that device's copies (XLA compiles its fused part there).
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
                    reduced[rows_start : rows_start + len(bundles)],
                    sample_count,
                    learning_rate,
                    self._gsnr_update_count(),
                    distribution.num_replicas_in_sync,
                ),
                group=False,
            )

        def gsnr_or_scale_update():
            self._on_cadence(lambda: update(True), lambda: update(False))

        if not self.gradient_accumulation_steps:
            gsnr_or_scale_update()
        else:
            # In cross-replica context, so that no merge_call sits in a cond.
            tf.cond(self._is_update_step(), gsnr_or_scale_update, lambda: None)

    def _device_update(self, measure, indices, packed_indices=(), sparse_indices=()):
        """The update on one device of the large dense variables at
        `indices`, the small ones at `packed_indices` (their reduced sums as
        one flat vector) and the row-sparse ones at `sparse_indices`, made
        once per cadence and set of variables and traced once for every
        device.
        At a GSNR update (`measure`) each measures the GSNR from the reduced
        sums and squares; between GSNR updates each applies the last scale
        to the mean gradient. Then the base rule.

        The large variables (over `PACKED_MAX_ELEMENTS` elements) are
        updated by one XLA program (unless `jit_update` is False), fused
        per variable. The small ones (biases, normalisation scales: most of
        the variables of a ResNet or a transformer, a few percent of its
        parameters) travel and are measured as one flat vector
        (`_packed_update`), since compiling, launching kernels or sending a
        message per variable costs more than their bytes. Row-sparse
        variables take `_row_sparse_update`.

        Each part captures the variables and slots rather than taking them
        as arguments, like `ReplicaIntake._moment_accumulation`: traced in
        the first device's update context, a captured mirrored variable is
        that device's copy. The whole is traced once (`OnEveryDevice`) and
        run on every device with its captures rebound to that device's
        copies, whatever the number of variables and devices.
        """
        key = (measure, indices, packed_indices, sparse_indices)
        if key in self._variable_updates:
            return self._variable_updates[key]
        layer_means = None
        if measure:
            layer_means, fused_update = self._fused_update(indices)
            packed_update = self._packed_update(packed_indices)
        else:
            fused_update = self._fused_scale_update(indices)
            packed_update = self._packed_scale_update(packed_indices)
        if self.jit_update:
            fused_update = tf.function(fused_update, jit_compile=True, autograph=False)
        row_update = self._row_sparse_update(sparse_indices, measure)
        count = len(indices)

        # Plain Python over fixed lists, kept from autograph: converted inside
        # a one-device tf.function, in a process that has converted other
        # optimizers' updates, the closure fails to find `fused_update`.
        @tf.autograph.experimental.do_not_convert
        def device_update(sums, squares, row_messages, *scalars):
            if indices and layer_means is not None:
                samples, replicas = scalars[0], scalars[-1]
                means = layer_means(sums[:count], squares[:count], samples, replicas)
                fused_update(sums[:count], squares[:count], *scalars, means)
            elif indices:
                fused_update(sums[:count], squares and squares[:count], *scalars)
            if packed_indices:
                packed_update(sums[count], squares and squares[count], *scalars)
            if sparse_indices:
                row_update(row_messages, *scalars)

        program = OnEveryDevice(device_update, self._device_program_variables)
        # The compiled program, whose traces the tests count, and the
        # programs every device shares.
        program.compiled = fused_update if indices and self.jit_update else None
        program.shared = () if layer_means is None else layer_means.shared
        self._variable_updates[key] = program
        return program

    def _device_program_variables(self):
        """The tf.Variables a device's update may touch: the model's
        trainable ones, the optimizer's (slots, counters) and the GSNR
        statistics."""
        statistics = [slot for slot in self._gsnr_monitor.value if slot is not None]
        keras_variables = [*self._trainable_variables, *self.variables, *statistics]
        return [_tf_variable(v) for v in keras_variables]

    def _fused_update(self, indices):
        """The GSNR update of the large variables at `indices`, as a pair
        ``(layer_means, update)``.

        `layer_means` runs in the device's graph: one reduction per variable
        (`functional.gsnr_element_sums`), then one conditional for all
        (`functional.mean_gsnrs_of_element_sums`) whose masked branch is a
        program of its own. Both programs take tensors only, so that one
        trace serves every device (`TracedOnce`), and the masked one is
        compiled on a device only when it first runs there. `update` is the
        device's program given those means: each variable's
        `_variable_update` (GSNR, its momentum, the base rule), one after
        the other.

        Without XLA (`jit_update=False`) the layer means are the masked
        means alone, by selects and a count in the graph, with no
        conditional: each op there is a kernel of its own either way, and
        the conditional (with its element sums) made the training step
        dearer, not cheaper (ResNet-50, 2 CPU replicas: 0.854 of the
        conditional's time, control 1.028; docs/RESULTS.md).
        """
        updates = [self._variable_update(i) for i in indices]
        sizes = [variable_size(_tf_variable(self._trainable_variables[i])) for i in indices]
        epsilon = self.gsnr_epsilon

        def moments_of(sums, squares, samples, replicas):
            return [reduced_moments(*pair, samples, replicas) for pair in zip(sums, squares)]

        def masked_means(sums, squares, samples, replicas):
            return functional.masked_mean_gsnrs(
                moments_of(sums, squares, samples, replicas), epsilon
            )

        if self.jit_update:

            def element_sums(sums, squares, samples, replicas):
                return functional.gsnr_element_sums(
                    moments_of(sums, squares, samples, replicas), epsilon
                )

            element_sums = TracedOnce(element_sums, jit_compile=True)
            masked_program = TracedOnce(masked_means, jit_compile=True)

            def layer_means(sums, squares, samples, replicas):
                return tf.stack(
                    functional.mean_gsnrs_of_element_sums(
                        element_sums(sums, squares, samples, replicas=replicas),
                        sizes,
                        lambda: masked_program(sums, squares, samples, replicas=replicas),
                    )
                )

            layer_means.shared = (element_sums, masked_program)
        else:

            def layer_means(sums, squares, samples, replicas):
                return tf.stack(masked_means(sums, squares, samples, replicas))

            layer_means.shared = ()

        def update(sums, squares, samples, learning_rate, step, replicas, means):
            hyper = self._shared_scalars(step)
            moments = moments_of(sums, squares, samples, replicas)
            for update, (gradient_mean, second_moment), layer_mean in zip(
                updates, moments, tf.unstack(means)
            ):
                update(gradient_mean, second_moment, layer_mean, learning_rate, hyper)

        return layer_means, update

    def _fused_scale_update(self, indices):
        """The update between GSNR updates of the large variables at
        `indices`: the mean gradient from the reduced sums times the scale
        of the last GSNR update (`functional.scale_between_gsnr_updates`),
        then the base rule."""
        variables, decays, _ = self._update_targets(indices)
        scale_slots = [self._gsnr_scales[i] for i in indices]
        momentum_slots = [self._gsnr_momentums[i] for i in indices]
        targets = list(zip(variables, decays, scale_slots, momentum_slots))

        def fused_update(sums, squares, samples, learning_rate, gsnr_updates, replicas):
            for (variable, decays, scale_slot, momentum_slot), total in zip(targets, sums):
                gradient_mean, applied = functional.scale_between_gsnr_updates(
                    total, samples, scale_slot, momentum_slot, self.beta_3, gsnr_updates
                )
                self._apply_base_rule(variable, decays, applied * gradient_mean, learning_rate)

        return fused_update

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
        reduced sums as one flat vector each (`grouped`'s order).

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
            gradient_mean, second_moment = reduced_moments(sums, squares, samples, replicas)
            new = functional.gsnr_scale(
                gradient_mean,
                second_moment,
                **hyper,
                previous_scale=_optional(flatten, scale_slots),
                previous_momentum=_optional(flatten, momentum_slots),
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

        def packed_update(total, squares, samples, learning_rate, gsnr_updates, replicas):
            gradient_mean, applied = functional.scale_between_gsnr_updates(
                total,
                samples,
                _optional(flatten, scale_slots),
                _optional(flatten, momentum_slots),
                self.beta_3,
                gsnr_updates,
            )
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

    def _variable_update(self, index):
        """The VR update of one variable, as a Python function of its moments
        and layer mean: GSNR, its momentum, then the base rule's
        `update_step`."""
        keras_variable = self._trainable_variables[index]
        variable = _tf_variable(keras_variable)
        decays = self._decays_decoupled(keras_variable)
        gsnr_momentum_slot = self._gsnr_momentums[index]
        scale_slot = self._gsnr_scales[index]
        statistics_slot = self._gsnr_monitor.value[index]

        def vr_update(gradient_mean, second_moment, layer_mean, learning_rate, hyper):
            new = functional.gsnr_scale(
                gradient_mean,
                second_moment,
                **hyper,
                previous_scale=scale_slot,
                previous_momentum=gsnr_momentum_slot,
                statistics=statistics_slot is not None,
                layer_mean=layer_mean,
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


def _optional(function, value):
    """`function(value)`, or None for a missing slot (None, or a list of
    them)."""
    if value is None or (isinstance(value, list) and value[0] is None):
        return None
    return function(value)


def _assign_split(slots, flat, sizes):
    """Assigns the consecutive pieces of `flat` of `sizes` to `slots`."""
    for slot, value in zip(slots, tf.split(flat, sizes)):
        slot.assign(tf.reshape(value, slot.shape))
