"""LARC: layer-wise adaptive rate control as a wrapper (NVIDIA Apex semantics).

Described in NVIDIA OpenSeq2Seq's optimizer documentation (clipping rule) and
implemented by the historical Apex wrapper `apex/parallel/LARC.py` (clipping
and scaling modes, coupled weight decay, zero-norm policy). The Apex wrapper
did not save its own settings with the optimizer state; this one does.
"""

import keras
import tensorflow as tf

from tf_vrgd import functional, validation
from tf_vrgd._wrapper import InnerOptimizerWrapper


def check_arguments(trust_coefficient, clip, epsilon, weight_decay):
    """LARC's arguments checked (a clear error on each bad one), in order."""
    return (
        validation.check_number("trust_coefficient", trust_coefficient, low=0.0, low_open=True),
        validation.check_bool("clip", clip),
        validation.check_number("epsilon", epsilon, low=0.0),
        validation.check_number("weight_decay", weight_decay, low=0.0),
    )


def rule_config(wrapper) -> dict:
    """The rule's arguments of a LARC wrapper (this module's or another
    Keras' face), for its `get_config`."""
    return {
        "trust_coefficient": wrapper.trust_coefficient,
        "clip": wrapper.clip,
        "epsilon": wrapper.epsilon,
        "weight_decay": wrapper.weight_decay,
    }


@keras.saving.register_keras_serializable(package="tf_vrgd")
class LARC(InnerOptimizerWrapper):
    """Layer-wise Adaptive Rate Control wrapped around any Keras optimizer.

    Per variable `w`, on the cross-replica reduced gradient `g` (after
    Keras' clipping and gradient accumulation, never on a replica's partial
    gradient), with `lr` the wrapped optimizer's current learning rate and
    `d = weight_decay`:

        if ||w|| > 0 and ||g|| > 0:
            a = trust_coefficient * ||w|| / (||g|| + d * ||w|| + epsilon)
            f = min(a / lr, 1)   (clip=True: effective SGD rate min(a, lr))
            f = a                (clip=False: scaling mode, LARS-like)
            g <- (g + d * w) * f
        else:
            g unchanged (Apex: no decay on this branch either)
        the wrapped optimizer applies g

    With plain SGD (no momentum) and `d = 0`, clipping mode bounds each step
    by `trust_coefficient * ||w||`. With momentum or adaptive optimizers the
    bound applies to the gradient handed over, not to the final step.

    `larc.inner_optimizer` is the wrapped optimizer; `learning_rate`,
    `iterations` and `variables` are its own. LARC owns it: do not apply the
    inner optimizer directly once it is wrapped. To combine with dynamic loss
    scaling, wrap LARC in `keras.optimizers.LossScaleOptimizer` (Keras does
    this itself under the "mixed_float16" policy), not the reverse.

    Args:
        optimizer: The Keras 3 optimizer to wrap (Keras' own or this
            package's).
        trust_coefficient: Float > 0. Defaults to 0.02 (Apex).
        clip: Bool, clipping mode (True) or scaling mode (False). Defaults to
            True.
        epsilon: Float >= 0 added to the denominator. Defaults to 1e-8.
        weight_decay: Float >= 0, Apex's coupled decay `d`. Defaults to 0.0.
            To avoid decaying twice, give the wrapped optimizer no
            `weight_decay` of its own.
        name: String. Defaults to "larc", numbered like Keras' optimizers
            ("larc_1", ...).
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer,
        trust_coefficient: float = 0.02,
        clip: bool = True,
        epsilon: float = 1e-8,
        weight_decay: float = 0.0,
        name: str | None = None,
    ) -> None:
        self.check_inner(optimizer)
        if isinstance(optimizer, (LARC, keras.optimizers.LossScaleOptimizer)):
            raise ValueError(
                "`optimizer` must not be a LARC or a LossScaleOptimizer: "
                "LARC rewrites its optimizer's per-variable update, which "
                "those wrappers delegate. Wrap LARC in a LossScaleOptimizer "
                f"instead. Received: optimizer={optimizer!r}"
            )
        if getattr(optimizer, "_wrapped_by_larc", False):
            raise ValueError(
                f"`optimizer` is already wrapped by another LARC. Received: optimizer={optimizer!r}"
            )
        trust_coefficient, clip, epsilon, weight_decay = check_arguments(
            trust_coefficient, clip, epsilon, weight_decay
        )
        super().__init__(optimizer, name=name)
        self.trust_coefficient = trust_coefficient
        self.clip = clip
        self.epsilon = epsilon
        # Apex's coupled decay, not Keras' decoupled `weight_decay` (LARC
        # never runs the base class' decay: the inner optimizer applies).
        self.weight_decay = weight_decay
        self._install_update_hook()

    def _install_update_hook(self):
        # Every Keras optimizer applies a variable's (reduced) gradient
        # through `update_step`, called per variable and per device inside
        # `distribution.extended.update`. Rewriting the gradient there keeps
        # all of the inner optimizer's own machinery (all-reduce, clipping,
        # accumulation, EMA, iterations) untouched.
        inner = self.inner_optimizer
        inner_update_step = inner.update_step

        def update_step(gradient, variable, learning_rate):
            return inner_update_step(
                self._larc_gradient(gradient, variable, learning_rate),
                variable,
                learning_rate,
            )

        inner.update_step = update_step
        # A flag, not a reference back to LARC: Keras' saving walks the
        # attributes of optimizers, and a cycle would make it recurse.
        inner._wrapped_by_larc = True

    def _larc_gradient(self, gradient, variable, learning_rate):
        weight = tf.cast(variable, tf.float32)
        new_gradient = functional.larc_gradient(
            functional.as_float32(gradient),
            weight,
            learning_rate,
            self.trust_coefficient,
            self.epsilon,
            self.weight_decay,
            self.clip,
        )
        return tf.cast(new_gradient, variable.dtype)

    def rule_config(self):
        return rule_config(self)
