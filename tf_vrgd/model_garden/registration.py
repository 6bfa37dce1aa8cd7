"""The VR optimizers in TF Model Garden's optimizer factory and configs.

Registers, under the names the package's configs use (`vr_sgd`,
`vr_adam`, `vr_lamb`, `vr_lars`), a tf_keras face (`optimizers`) built by
`tf_vrgd.config.optimizer_from_fields` from the type's fields, and
defines Model Garden config dataclasses with those fields:
`OptimizerConfig` (Model Garden's one-of, plus the four VR types) and
`OptimizationConfig` (using it), the pattern of Model Garden's own
project-specific optimizers. An experiment whose
`trainer.optimizer_config` is an `OptimizationConfig` of this module reads
a config file's ``optimizer: {type: vr_lamb, vr_lamb: {...}}`` block.

The fields of each dataclass are `tf_vrgd.config.OPTIMIZER_TYPES[kind]`'s,
with their defaults, so that a config block means the same under
`vrgd-train` and under Model Garden's trainer. `lars` and `lamb` keep
Model Garden's own optimizers: the package's `lars` and `lamb` types
implement Model Garden's rules with Model Garden's field names, so a
config naming them trains the same rule under either trainer.

The package's own learning-rate type, `delayed_polynomial` (the paper's
DLRM schedule, `tf_vrgd.schedules.DelayedPolynomialDecay`), is registered
in Model Garden's schedule table and in `LrConfig`, the learning-rate
one-of of `OptimizationConfig`.
"""

import dataclasses

from official.modeling import optimization
from official.modeling.hyperparams import base_config
from official.modeling.optimization import optimizer_factory
from official.modeling.optimization.configs import optimizer_config
import tensorflow as tf
import tf_keras

from tf_vrgd import config
from tf_vrgd.model_garden.optimizers import KerasOptimizerFace, refuse_tf_keras_arguments

#: The VR optimizer types this module registers (and `larc`, `adascale`).
VR_TYPES = ("vr_sgd", "vr_adam", "vr_lamb", "vr_lars")


def _dataclass(name, fields, base, doc):
    """A config dataclass of this module: `fields` as (name, type, field)."""
    namespace = {"__doc__": doc, "__module__": __name__}
    return dataclasses.make_dataclass(name, fields, bases=(base,), namespace=namespace)


def _one_of(name, base, classes, doc):
    """Model Garden's one-of `base` with a field per `classes` item."""
    fields = [(kind, cls, dataclasses.field(default_factory=cls)) for kind, cls in classes.items()]
    return _dataclass(name, fields, base, doc)


def _annotation(name, default):
    """The dataclass type of a field (Model Garden's configs check
    assignments against it)."""
    if name.startswith(("exclude_", "include_")):
        return list[str] | None
    if name == "name":
        return str | None
    if name == "gradient_accumulation_steps":
        return int | None
    if isinstance(default, bool | int):
        return type(default)
    return float | None


def _config_class(kind):
    table = config.OPTIMIZER_TYPES[kind].fields
    left_out = {f.name for f in dataclasses.fields(optimizer_config.BaseOptimizerConfig)}
    if "eeta" in table:
        # Model Garden's factory passes every field, and the LARS types
        # take one of `eeta` (Model Garden's name, the configs') and
        # `trust_coefficient`.
        left_out.add("trust_coefficient")
    fields = [
        (name, _annotation(name, default), dataclasses.field(default=default))
        for name, default in table.items()
        if name not in left_out
    ]
    camel = "".join(part.upper() if part == "vr" else part.title() for part in kind.split("_"))
    return _dataclass(
        f"{camel}Config",
        fields,
        optimizer_config.BaseOptimizerConfig,
        f"Fields of the `{kind}` optimizer type "
        f"(`tf_vrgd.config.OPTIMIZER_TYPES['{kind}']`, Model Garden's names).",
    )


def _factory_class(kind):
    """The class Model Garden's factory calls with a `kind` config's fields
    and the learning rate: a face whose twin `tf_vrgd.config` builds from
    those fields."""

    def __init__(self, learning_rate=0.001, **fields):
        refuse_tf_keras_arguments(type(self).__name__, fields)
        self._fields = fields
        twin = config.optimizer_from_fields(kind, fields, self._current_learning_rate)
        self._wrap(twin, learning_rate)

    def get_config(self):
        return {
            "learning_rate": self._serialize_hyperparameter("learning_rate"),
            **self._fields,
        }

    return type(
        f"ModelGarden_{kind}",
        (KerasOptimizerFace,),
        {
            "__init__": __init__,
            "get_config": get_config,
            "__doc__": f"The `{kind}` type in Model Garden's factory (Model Garden's field names).",
            "__module__": __name__,
        },
    )


CONFIG_CLASSES = {kind: _config_class(kind) for kind in VR_TYPES}
FACTORY_CLASSES = {kind: _factory_class(kind) for kind in VR_TYPES}

# What LARC wraps: Model Garden's one-of with the VR types (not LARC).
InnerOptimizerConfig = _one_of(
    "InnerOptimizerConfig",
    optimization.OptimizerConfig,
    CONFIG_CLASSES,
    "Model Garden's optimizer one-of with the VR types added.",
)


@dataclasses.dataclass
class LARCConfig(optimizer_config.BaseOptimizerConfig):
    """Fields of the `larc` type (`tf_vrgd.LARC`'s arguments) and the
    optimizer it wraps."""

    name: str | None = None
    trust_coefficient: float = config.LARC_FIELDS["trust_coefficient"]
    clip: bool = config.LARC_FIELDS["clip"]
    epsilon: float = config.LARC_FIELDS["epsilon"]
    weight_decay: float = config.LARC_FIELDS["weight_decay"]
    optimizer: InnerOptimizerConfig = dataclasses.field(default_factory=InnerOptimizerConfig)


@dataclasses.dataclass
class AdaScaleConfig(optimizer_config.BaseOptimizerConfig):
    """Fields of the `adascale` type (`tf_vrgd.AdaScale`'s arguments) and
    the optimizer it wraps (not a VR type: `tf_vrgd.AdaScale` refuses
    them)."""

    name: str | None = None
    scale: float | None = config.ADASCALE_FIELDS["scale"]
    decay: float | None = config.ADASCALE_FIELDS["decay"]
    optimizer: InnerOptimizerConfig = dataclasses.field(default_factory=InnerOptimizerConfig)


@dataclasses.dataclass
class OptimizerConfig(InnerOptimizerConfig):
    """Model Garden's optimizer one-of with the VR types, `larc` and
    `adascale`."""

    larc: LARCConfig = dataclasses.field(default_factory=LARCConfig)
    adascale: AdaScaleConfig = dataclasses.field(default_factory=AdaScaleConfig)


class _ModelGardenWrapper(KerasOptimizerFace):
    """A wrapper type (`kind`, of `tf_vrgd.config.WRAPPER_TYPES`) in Model
    Garden's factory, around any type the package reads (the VR types, and
    Model Garden's `sgd`, `adam`, `adamw`, `lamb`, `lars` as
    `tf_vrgd.config` builds them)."""

    kind = None
    # The type's fields that share a name with one of tf_keras' arguments.
    own_fields = ()

    def __init__(self, learning_rate=0.001, optimizer=None, **fields):
        own = {name: fields.pop(name) for name in self.own_fields if name in fields}
        refuse_tf_keras_arguments(type(self).__name__, fields)
        fields.update(own)
        # Model Garden passes the whole inner one-of: keep the chosen type.
        kind = (optimizer or {}).get("type")
        inner = {"type": kind, kind: (optimizer or {}).get(kind) or {}}
        self._fields = {**fields, "optimizer": inner}
        twin = config.optimizer_from_fields(self.kind, self._fields, self._current_learning_rate)
        self._wrap(twin, learning_rate)

    def get_config(self):
        return {
            "learning_rate": self._serialize_hyperparameter("learning_rate"),
            **self._fields,
        }


class ModelGardenLARC(_ModelGardenWrapper):
    """The `larc` type in Model Garden's factory: `tf_vrgd.LARC`."""

    kind = "larc"


class ModelGardenAdaScale(_ModelGardenWrapper):
    """The `adascale` type in Model Garden's factory: `tf_vrgd.AdaScale`,
    whose base rate is Model Garden's schedule read at floor(tau), the
    scale-invariant step, in place of the update count."""

    kind = "adascale"
    own_fields = ("decay",)  # the moving averages', not tf_keras' rate decay

    def _schedule_step(self):
        tau = self._keras_optimizer.scale_invariant_steps_variable
        return tf.cast(tf.floor(tau), tf.int64)


FACTORY_CLASSES["larc"] = ModelGardenLARC
FACTORY_CLASSES["adascale"] = ModelGardenAdaScale


def _schedule_config_class(kind):
    fields = [
        (name, str if name == "name" else float | int | None, dataclasses.field(default=default))
        for name, default in config.LEARNING_RATE_TYPES[kind].fields.items()
    ]
    camel = "".join(part.title() for part in kind.split("_"))
    return _dataclass(
        f"{camel}LrConfig",
        fields,
        base_config.Config,
        f"Fields of the `{kind}` learning-rate type "
        f"(`tf_vrgd.config.LEARNING_RATE_TYPES['{kind}']`).",
    )


class ModelGardenDelayedPolynomialDecay(tf_keras.optimizers.schedules.LearningRateSchedule):
    """The `delayed_polynomial` type in Model Garden's schedule table: a
    tf_keras schedule computing with the package's Keras 3 one
    (`tf_vrgd.schedules.DelayedPolynomialDecay`), built by `tf_vrgd.config`
    from the same fields."""

    def __init__(self, **fields):
        super().__init__()
        self._fields = fields
        self._schedule = config.learning_rate_from_config(
            {"learning_rate": {"type": "delayed_polynomial", "delayed_polynomial": fields}}
        )

    def __call__(self, step):
        return self._schedule(step)

    def get_config(self):
        return dict(self._fields)


#: The package's learning-rate types that Model Garden lacks.
SCHEDULE_CLASSES = {"delayed_polynomial": ModelGardenDelayedPolynomialDecay}

LrConfig = _one_of(
    "LrConfig",
    optimization.LrConfig,
    {kind: _schedule_config_class(kind) for kind in SCHEDULE_CLASSES},
    "Model Garden's learning-rate one-of with the package's types added.",
)


@dataclasses.dataclass
class OptimizationConfig(optimization.OptimizationConfig):
    """Model Garden's optimization config whose `optimizer` takes the VR
    types too, and whose `learning_rate` takes `delayed_polynomial`."""

    optimizer: OptimizerConfig = dataclasses.field(default_factory=OptimizerConfig)
    learning_rate: LrConfig = dataclasses.field(default_factory=LrConfig)


def register():
    """Registers every VR type, `larc` and `adascale` in Model Garden's factory (for tf_keras'
    legacy optimizers, which Model Garden builds by default), and the
    package's learning-rate types in its schedule table; a second call
    does nothing."""
    for kind, cls in FACTORY_CLASSES.items():
        if optimizer_factory.LEGACY_OPTIMIZERS_CLS.get(kind) is not cls:
            optimizer_factory.register_optimizer_cls(kind, cls, use_legacy_optimizer=True)
    optimizer_factory.LR_CLS.update(SCHEDULE_CLASSES)
