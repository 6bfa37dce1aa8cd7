"""The part every wrapper optimizer of the package shares (`LARC`,
`NoiseScale`): it owns an inner Keras 3 optimizer, whose state, learning
rate and step counter are the wrapper's, and applies through it."""

import keras


class InnerOptimizerWrapper(keras.optimizers.Optimizer):
    """Delegates the optimizer's face to `inner_optimizer`; a subclass adds
    its rule by rewriting one of the inner optimizer's own methods.

    The state is the inner optimizer's. Keras' `save_own_variables`,
    `load_own_variables` and `get_weights` act on `variables`, so they save
    and restore it; `set_weights` is rewritten because Keras' walks the
    wrapper's own (unused) counter instead. Like Keras' `LossScaleOptimizer`,
    a `.keras` file then holds the inner state twice: under the wrapper and
    under its inner optimizer, both restored to the same values.
    """

    def __init__(self, optimizer: keras.optimizers.Optimizer, name: str | None = None) -> None:
        self.check_inner(optimizer)
        super().__init__(learning_rate=0.0, name=name)
        self.inner_optimizer = optimizer

    @staticmethod
    def check_inner(optimizer):
        """Refuses anything but a Keras 3 optimizer instance."""
        if not isinstance(optimizer, keras.optimizers.Optimizer):
            raise ValueError(
                "`optimizer` must be a Keras 3 optimizer instance "
                f"(keras.optimizers.Optimizer). Received: optimizer={optimizer!r}"
            )

    def build(self, var_list):
        if self.built:
            return
        self.inner_optimizer.build(var_list)
        super().build(var_list)

    def apply(self, grads, trainable_variables=None):
        if not self.built:
            if trainable_variables is None:
                raise ValueError(
                    "When passing `grads` without `variables`, the optimizer "
                    "must already be built on a list of variables. "
                    "Call `optimizer.build(trainable_variables)` first."
                )
            with keras.name_scope(self.name, caller=self):
                self.build(list(trainable_variables))
        self.inner_optimizer.apply(grads, trainable_variables)

    @property
    def variables(self):
        return self.inner_optimizer.variables

    @property
    def learning_rate(self):
        return self.inner_optimizer.learning_rate

    @learning_rate.setter
    def learning_rate(self, learning_rate):
        self.inner_optimizer.learning_rate = learning_rate

    @property
    def iterations(self):
        return self.inner_optimizer.iterations

    def set_weights(self, weights):
        self.inner_optimizer.set_weights(weights)

    def scale_loss(self, loss):
        return self.inner_optimizer.scale_loss(loss)

    def finalize_variable_values(self, var_list):
        self.inner_optimizer.finalize_variable_values(var_list)

    def rule_config(self) -> dict:
        """The wrapper's own constructor arguments, besides the optimizer
        and the name."""
        raise NotImplementedError

    def get_config(self):
        return {
            "name": self.name,
            "optimizer": keras.saving.serialize_keras_object(self.inner_optimizer),
            **self.rule_config(),
        }

    @classmethod
    def from_config(cls, config, custom_objects=None):
        config = dict(config)
        optimizer = keras.saving.deserialize_keras_object(
            config.pop("optimizer"), custom_objects=custom_objects
        )
        return cls(optimizer, **config)


def find_inner(optimizer, cls):
    """The first optimizer of class `cls` along `optimizer` and the
    `inner_optimizer`s it wraps (LossScaleOptimizer, LARC, NoiseScale), or
    None."""
    while optimizer is not None and not isinstance(optimizer, cls):
        optimizer = getattr(optimizer, "inner_optimizer", None)
    return optimizer
