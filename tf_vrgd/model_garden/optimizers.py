"""tf_keras faces of the package's optimizers, for TF Model Garden's trainer.

Model Garden (`official`, from tf-models-official or tf-models-nightly)
still builds its optimizers with tf_keras (Keras 2): its factory takes
`tf_keras.optimizers.legacy.Optimizer` classes, and its `Task.train_step`
calls `optimizer.apply_gradients` in replica context. The package's
optimizers are Keras 3 classes.

Each face here is a `tf_keras.optimizers.legacy.Optimizer` that owns the
Keras 3 optimizer of the same name (its twin, built with the same
arguments) and hands it the gradients. The rule is therefore written once,
in the Keras 3 class and `tf_vrgd.functional`; a face holds argument
names, the learning rate and the state's tracking, nothing of the rule. It
works because a Keras 3 optimizer updates the `tf.Variable`s of a tf_keras
model directly, and because the VR twins gather their per-replica moments
inside `apply`, in the replica context where Model Garden calls it (under
`MirroredStrategy` and `MultiWorkerMirroredStrategy` alike).

- Learning rate: a float or a tf_keras `LearningRateSchedule` (what Model
  Garden's factory passes), read at the twin's `iterations`, which the
  face's `iterations` is.
- State: the twin is tracked as ``keras_optimizer``, so a
  `tf.train.Checkpoint` of the face (Model Garden's checkpoints) saves and
  restores the whole state, slots, accumulators and the update count, under
  the twin's names (``optimizer/keras_optimizer/...``), not tf_keras'
  per-variable slot names. A checkpoint restored before the first step is
  applied when the twin builds its slots (deferred restoration).
- `get_config` gives the twin's arguments and the learning rate as tf_keras
  serializes it; `from_config` rebuilds the face.
- tf_keras' `LossScaleOptimizer` (Model Garden's under float16) wraps a
  face: the face keeps each replica's gradients apart where the wrapper
  would reduce them, and makes an overflow on any replica visible to the
  wrapper's check of the first one, so that every replica skips the update.
- `LARC` wraps a face, or any other tf_keras legacy optimizer; either way
  the object is a `LARC` (a `FaceLARC` or a `TFKerasLARC`, which applies
  `tf_vrgd.functional.larc_gradient` inside that optimizer's own
  per-variable update).
- tf_keras' `model.save` and `load_model`: in HDF5, where tf_keras keeps
  its own optimizers' state, a face's whole state is kept too (tf_keras
  asks the face to make its weights, which builds the twin, then sets
  them); in `.keras` and SavedModel, where tf_keras 2.21 keeps no legacy
  optimizer's state, neither is a face's.
- Not taken: tf_keras' `gradient_aggregator` and `gradient_transformers`
  (the twin reduces the gradients itself; transformers would change them
  after the VR moments are taken), and tf_keras' `decay`.
"""

import copy
import inspect

import tensorflow as tf
import tf_keras

import tf_vrgd
from tf_vrgd import larc


class KerasOptimizerFace(tf_keras.optimizers.legacy.Optimizer):
    """A tf_keras optimizer that applies the gradients with a Keras 3
    optimizer of class `keras_class` (set by each subclass), built from
    the face's arguments.

    Args:
        learning_rate: Float or a tf_keras `LearningRateSchedule`. Defaults
            to the Keras 3 class' default.
        name: The optimizer's name. Defaults to the Keras 3 class' default.
        **kwargs: The Keras 3 class' arguments, with its names and defaults
            (checked there).
    """

    keras_class = None

    def __init__(self, learning_rate=None, name=None, **kwargs):
        refuse_tf_keras_arguments(type(self).__name__, kwargs)
        if learning_rate is None:
            learning_rate = _default(self.keras_class, "learning_rate")
        # The twin checks the arguments and names itself as the Keras 3
        # class does.
        self._wrap(
            self.keras_class(learning_rate=self._current_learning_rate, name=name, **kwargs),
            learning_rate,
        )

    def _wrap(self, twin, learning_rate):
        """Makes this face the tf_keras side of `twin`, built with the
        face's `_current_learning_rate` as its learning rate, which reads
        `learning_rate` (a float or a tf_keras schedule) at the twin's
        update count. (Called before the face is initialised: the twin
        calls that method only when it applies gradients.)"""
        super().__init__(twin.name)
        self._set_hyper("learning_rate", learning_rate)
        self._keras_optimizer = twin
        self._track_trackable(twin, name="keras_optimizer")

    @property
    def keras_optimizer(self):
        """The Keras 3 optimizer that applies the updates."""
        return self._keras_optimizer

    @property
    def learning_rate_argument(self):
        """The learning rate the face was given: a float or a tf_keras
        schedule (tf_keras' `learning_rate` attribute makes a variable of a
        float)."""
        return self._hyper["learning_rate"]

    @property
    def iterations(self):
        """The number of updates (not micro-steps, with gradient
        accumulation): the twin's. Without accumulation it is the twin's
        counter itself, a `tf.Variable` (tf_keras' LossScaleOptimizer adds a
        skipped step to it, as tf_keras counts one)."""
        iterations = self._keras_optimizer.iterations
        return getattr(iterations, "value", iterations)

    def _current_learning_rate(self):
        rate = self.learning_rate_argument
        if isinstance(rate, tf_keras.optimizers.schedules.LearningRateSchedule):
            return tf.cast(rate(self._schedule_step()), tf.float32)
        return tf.cast(rate, tf.float32)

    def _schedule_step(self):
        """The step a tf_keras schedule is read at: the update count (Keras
        3's `iterations` counts updates under accumulation too, as Model
        Garden's schedules do), as int64, the type tf_keras' own optimizers
        pass."""
        return tf.cast(self._keras_optimizer.iterations, tf.int64)

    def apply_gradients(self, grads_and_vars, name=None, experimental_aggregate_gradients=True):
        """Applies each replica's gradients with the twin, in replica
        context (the twin reduces them across replicas). Returns `_done()`.

        `experimental_aggregate_gradients=False` is how tf_keras'
        LossScaleOptimizer calls it, after `_aggregate_gradients` (below),
        which leaves each replica's gradients its own: they are reduced
        here all the same. Gradients already reduced by the caller would be
        reduced twice.
        """
        del experimental_aggregate_gradients  # see the docstring
        grads_and_vars = [(g, v) for g, v in grads_and_vars if g is not None]
        if not grads_and_vars:
            return _done()
        grads, variables = (list(x) for x in zip(*grads_and_vars))
        if not self._keras_optimizer.built:
            replica_context = tf.distribute.get_replica_context()
            if tf.distribute.has_strategy() and replica_context is not None:
                # In cross-replica context: built in one replica's thread, a
                # checkpoint restored before the first step (deferred
                # restoration) reached the first device's copies of the
                # slots only.
                replica_context.merge_call(lambda _: self._build(variables))
            else:
                self._build(variables)
        self._keras_optimizer.apply(grads, variables)
        return _done()

    def _aggregate_gradients(self, grads_and_vars):
        """What tf_keras' LossScaleOptimizer calls before it checks the
        gradients and calls `apply_gradients`: each replica's gradients stay
        its own (the twin reduces them, and the VR twins need them apart),
        but where any replica's are non-finite, every replica's become NaN
        (one scalar all-reduced). The wrapper decides from the first
        replica's gradients; so every replica skips the same update, and
        the loss scale falls."""
        if self._keras_optimizer.gradient_accumulation_steps:
            raise ValueError(
                f"{type(self).__name__} with gradient_accumulation_steps cannot run in tf_keras' "
                "LossScaleOptimizer, which counts a skipped step as an update: train float16 "
                "without accumulation, or accumulate in float32 or bfloat16."
            )
        grads_and_vars = list(grads_and_vars)
        context = tf.distribute.get_replica_context()
        if context is None or context.num_replicas_in_sync == 1:
            return grads_and_vars
        values = [getattr(g, "values", g) for g, _ in grads_and_vars if g is not None]
        finite = tf.reduce_all([tf.reduce_all(tf.math.is_finite(v)) for v in values])
        spoiled = context.all_reduce("sum", 1.0 - tf.cast(finite, tf.float32))
        offset = tf.where(spoiled > 0.0, float("nan"), 0.0)
        return [(_plus(g, offset), v) for g, v in grads_and_vars]

    def _build(self, variables):
        # Outside the step function, as tf_keras' own optimizers make their
        # slots.
        with tf.init_scope():
            self._keras_optimizer.build(variables)

    def _create_all_weights(self, var_list):
        """What tf_keras calls to make an optimizer's state before it sets
        the saved values (`load_model` of an HDF5 file, then
        `set_weights`): the twin's slots, which are the face's weights."""
        if not self._keras_optimizer.built:
            self._build(var_list)

    def minimize(self, loss, var_list, grad_loss=None, name=None, tape=None):
        grads_and_vars = self._compute_gradients(loss, var_list, grad_loss=grad_loss, tape=tape)
        return self.apply_gradients(grads_and_vars, name=name)

    def variables(self):
        """The twin's variables: every slot and the update count."""
        return self._keras_optimizer.variables

    @property
    def weights(self):
        return self.variables()

    def get_config(self):
        config = {
            k: v
            for k, v in self._keras_optimizer.get_config().items()
            if k not in ("learning_rate", "name")
        }
        return {
            "name": self._name,
            "learning_rate": self._serialize_hyperparameter("learning_rate"),
            **config,
        }

    def _resource_apply_dense(self, grad, handle, apply_state):
        raise NotImplementedError("The face applies its gradients through its Keras 3 twin.")

    def _resource_apply_sparse(self, grad, handle, indices, apply_state):
        raise NotImplementedError("The face applies its gradients through its Keras 3 twin.")


def refuse_tf_keras_arguments(face_name, kwargs):
    """Removes tf_keras' own arguments from `kwargs` when unset (Model
    Garden's factory may pass them), and refuses them when set."""
    for unsupported in ("gradient_aggregator", "gradient_transformers", "decay"):
        if kwargs.get(unsupported):
            raise ValueError(
                f"{face_name} does not take tf_keras' `{unsupported}`: the Keras 3 "
                "optimizer it wraps reduces and uses the gradients itself."
            )
        kwargs.pop(unsupported, None)


def _done():
    """What `apply_gradients` returns: one value for every replica, made in
    cross-replica context as tf_keras' optimizers make theirs (tf_keras'
    LossScaleOptimizer puts it in a `tf.cond` whose other branch returns
    such a value)."""
    context = tf.distribute.get_replica_context()
    if tf.distribute.has_strategy() and context is not None:
        return context.merge_call(lambda _: tf.constant(True))
    return tf.constant(True)


def _plus(gradient, offset):
    """`gradient` + the scalar `offset` (a `tf.IndexedSlices` on its rows)."""
    if gradient is None:
        return None
    if isinstance(gradient, tf.IndexedSlices):
        values = gradient.values + tf.cast(offset, gradient.values.dtype)
        return tf.IndexedSlices(values, gradient.indices, gradient.dense_shape)
    return gradient + tf.cast(offset, gradient.dtype)


def _default(cls, argument):
    """`argument`'s default in `cls`' constructor, or None."""
    parameter = inspect.signature(cls.__init__).parameters.get(argument)
    if parameter is None or parameter.default is inspect.Parameter.empty:
        return None
    return parameter.default


def _face(keras_class):
    return type(
        keras_class.__name__,
        (KerasOptimizerFace,),
        {
            "keras_class": keras_class,
            "__doc__": f"tf_keras face of `tf_vrgd.{keras_class.__name__}` "
            "(`KerasOptimizerFace`): the same arguments, defaults and config.",
            "__module__": __name__,
        },
    )


LARS = _face(tf_vrgd.LARS)
LAMB = _face(tf_vrgd.LAMB)
AdamWeightDecay = _face(tf_vrgd.AdamWeightDecay)
VRSGD = _face(tf_vrgd.VRSGD)
VRAdam = _face(tf_vrgd.VRAdam)
VRLARS = _face(tf_vrgd.VRLARS)
VRLAMB = _face(tf_vrgd.VRLAMB)


class LARC(tf_keras.optimizers.legacy.Optimizer):
    """tf_keras face of `tf_vrgd.LARC`: `tf_vrgd.LARC`'s arguments and
    defaults, around a face of this module or around any other tf_keras
    legacy optimizer. The learning rate, slots and update count are those
    of the optimizer it wraps.

    `LARC(optimizer)` is one of two kinds, both `LARC`s (and both named
    LARC in a saved config, so that `custom_objects=FACES` loads either):

    - `FaceLARC` around a face (`VRSGD(...)`, `LAMB(...)`, ...): a face
      whose twin is `tf_vrgd.LARC` around the inner face's twin.
    - `TFKerasLARC` around a tf_keras optimizer without a twin
      (`tf_keras.optimizers.legacy.SGD`, `Adam`, ...): the rule applied
      inside that optimizer's own per-variable update.

    Either way the rule is `tf_vrgd.functional.larc_gradient`, on the
    cross-replica mean gradient after the wrapped optimizer's clipping, at
    its current learning rate.

    Args:
        optimizer: A face of this module other than LARC, or a tf_keras
            legacy optimizer other than a LARC or a LossScaleOptimizer.
        **kwargs: `tf_vrgd.LARC`'s other arguments (`trust_coefficient`,
            `clip`, `epsilon`, `weight_decay`, `name`).
    """

    def __new__(cls, optimizer=None, *args, **kwargs):
        if cls is LARC:
            if not isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer):
                raise ValueError(
                    "`optimizer` must be a face of tf_vrgd.model_garden.optimizers (e.g. "
                    "VRSGD(0.1)) or another tf_keras legacy optimizer; LARC around a Keras 3 "
                    f"optimizer is tf_vrgd.LARC. Received: optimizer={optimizer!r}"
                )
            cls = FaceLARC if isinstance(optimizer, KerasOptimizerFace) else TFKerasLARC
        return super().__new__(cls)

    @property
    def inner_optimizer(self):
        """The wrapped tf_keras optimizer."""
        raise NotImplementedError

    def get_config(self):
        return {
            "name": self._name,
            "optimizer": tf_keras.optimizers.serialize(
                self.inner_optimizer, use_legacy_format=True
            ),
            **larc.rule_config(self),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        """Rebuilds either kind: the wrapped optimizer's config decides."""
        config = copy.deepcopy(config)  # tf_keras' deserialize edits its argument
        optimizer = tf_keras.optimizers.deserialize(
            config.pop("optimizer"),
            custom_objects={**FACES, **(custom_objects or {})},
            use_legacy_optimizer=True,
            use_legacy_format=True,
        )
        return LARC(optimizer, **config)


def _attribute_of(holder, name):
    """A property read from and written to `self.<holder>.<name>`."""
    return property(
        lambda self: getattr(getattr(self, holder), name),
        lambda self, value: setattr(getattr(self, holder), name, value),
        doc=f"`{name}` of the wrapped optimizer.",
    )


class FaceLARC(LARC, KerasOptimizerFace):
    """`LARC` around a face of this module: its twin is `tf_vrgd.LARC`
    around the inner face's twin, tracked as ``keras_optimizer``."""

    keras_class = tf_vrgd.LARC

    def __init__(self, optimizer, **kwargs):
        refuse_tf_keras_arguments("LARC", kwargs)
        kwargs.pop("learning_rate", None)  # the inner optimizer's
        if not isinstance(optimizer, KerasOptimizerFace) or isinstance(optimizer, LARC):
            raise ValueError(
                "`optimizer` must be a face of tf_vrgd.model_garden.optimizers other than "
                "LARC (e.g. VRSGD(0.1)) or another tf_keras legacy optimizer. "
                f"Received: optimizer={optimizer!r}"
            )
        self._inner = optimizer
        self._wrap(
            tf_vrgd.LARC(optimizer.keras_optimizer, **kwargs),
            optimizer.learning_rate_argument,
        )

    @property
    def inner_optimizer(self):
        return self._inner

    trust_coefficient = _attribute_of("_keras_optimizer", "trust_coefficient")
    clip = _attribute_of("_keras_optimizer", "clip")
    epsilon = _attribute_of("_keras_optimizer", "epsilon")
    weight_decay = _attribute_of("_keras_optimizer", "weight_decay")


class TFKerasLARC(LARC):
    """`LARC` around a tf_keras legacy optimizer that has no Keras 3 twin
    (`tf_keras.optimizers.legacy.SGD`, `Adam`, `RMSprop`, ...).

    The rule is applied where `tf_vrgd.LARC` applies it: inside the
    wrapped optimizer's per-variable, per-device update
    (`_resource_apply_dense`), so on the cross-replica sum of the gradients
    after the wrapped optimizer's own clipping, at its current learning
    rate. The wrapped optimizer keeps its reduction, slots, `iterations`
    and learning rate; it is tracked as ``inner_optimizer``. A row-sparse
    gradient is made dense first (LARC needs its whole norm). tf_keras'
    `LossScaleOptimizer` may wrap this one.

    Args:
        optimizer: A tf_keras legacy optimizer (not a face of this module,
            a LARC or a LossScaleOptimizer).
        trust_coefficient, clip, epsilon, weight_decay: `tf_vrgd.LARC`'s,
            with its defaults.
        name: Defaults to "LARC".
    """

    def __init__(
        self,
        optimizer,
        trust_coefficient=_default(tf_vrgd.LARC, "trust_coefficient"),
        clip=_default(tf_vrgd.LARC, "clip"),
        epsilon=_default(tf_vrgd.LARC, "epsilon"),
        weight_decay=_default(tf_vrgd.LARC, "weight_decay"),
        name=None,
        **kwargs,
    ):
        refuse_tf_keras_arguments("LARC", kwargs)
        kwargs.pop("learning_rate", None)  # the inner optimizer's
        if kwargs:
            raise TypeError(f"LARC got unexpected arguments: {sorted(kwargs)}")
        if not isinstance(optimizer, tf_keras.optimizers.legacy.Optimizer) or isinstance(
            optimizer,
            KerasOptimizerFace | LARC | tf_keras.mixed_precision.LossScaleOptimizer,
        ):
            raise ValueError(
                "`optimizer` must be a tf_keras legacy optimizer other than a face, a LARC "
                f"or a LossScaleOptimizer. Received: optimizer={optimizer!r}"
            )
        if getattr(optimizer, "_wrapped_by_larc", False):
            raise ValueError(
                f"`optimizer` is already wrapped by another LARC. Received: optimizer={optimizer!r}"
            )
        checked = larc.check_arguments(trust_coefficient, clip, epsilon, weight_decay)
        super().__init__(name or "LARC")
        self._optimizer = optimizer
        self._track_trackable(optimizer, "inner_optimizer")
        self.trust_coefficient, self.clip, self.epsilon, self.weight_decay = checked
        self._install_update_hook()

    def _install_update_hook(self):
        # tf_keras applies each variable's reduced gradient on each device
        # through `_resource_apply_dense` (row-sparse ones through
        # `_resource_apply_sparse_duplicate_indices`): LARC rewrites the
        # gradient there, as `tf_vrgd.LARC` does in Keras 3's `update_step`.
        inner = self._optimizer
        apply_dense = inner._resource_apply_dense

        def larc_apply_dense(gradient, variable, **kwargs):
            return apply_dense(self._larc_gradient(gradient, variable), variable, **kwargs)

        def larc_apply_sparse(values, variable, indices, **kwargs):
            dense = tf.math.unsorted_segment_sum(values, indices, tf.shape(variable)[0])
            return larc_apply_dense(dense, variable, **kwargs)

        inner._resource_apply_dense = larc_apply_dense
        inner._resource_apply_sparse_duplicate_indices = larc_apply_sparse
        inner._wrapped_by_larc = True

    def _larc_gradient(self, gradient, variable):
        new = tf_vrgd.functional.larc_gradient(
            tf.cast(gradient, tf.float32),
            tf.cast(variable, tf.float32),
            tf.cast(self._optimizer._decayed_lr(tf.float32), tf.float32),
            self.trust_coefficient,
            self.epsilon,
            self.weight_decay,
            self.clip,
        )
        return tf.cast(new, variable.dtype)

    @property
    def inner_optimizer(self):
        return self._optimizer

    iterations = _attribute_of("_optimizer", "iterations")
    learning_rate = _attribute_of("_optimizer", "learning_rate")

    def apply_gradients(self, grads_and_vars, name=None, experimental_aggregate_gradients=True):
        return self._optimizer.apply_gradients(
            grads_and_vars,
            name=name,
            experimental_aggregate_gradients=experimental_aggregate_gradients,
        )

    def _create_all_weights(self, var_list):
        # tf_keras' HDF5 loading: the wrapped optimizer's slots, which are
        # this one's weights.
        self._optimizer._create_all_weights(var_list)

    def variables(self):
        return self._optimizer.variables()

    @property
    def weights(self):
        return self._optimizer.weights

    def _create_slots(self, var_list):
        pass

    def _resource_apply_dense(self, grad, handle, apply_state):
        raise NotImplementedError("LARC applies its gradients through its inner optimizer.")

    def _resource_apply_sparse(self, grad, handle, indices, apply_state):
        raise NotImplementedError("LARC applies its gradients through its inner optimizer.")


# tf_keras writes a class' `__name__` as the `class_name` of a saved config:
# both kinds are written as LARC, and `LARC.from_config` picks the kind again.
FaceLARC.__name__ = TFKerasLARC.__name__ = "LARC"


#: Every face, by the class name it shares with its Keras 3 twin.
FACES = {
    cls.__name__: cls for cls in (LARS, LAMB, AdamWeightDecay, VRSGD, VRAdam, VRLARS, VRLAMB, LARC)
}
