"""Per-variable exclusion from weight decay and from layer adaptation.

Shared by every layer-wise optimizer of the package (LARS, and the VR
family's LARS and LAMB). Two forms select variables, as in docs/algorithms.md §4:

- Model Garden form: constructor lists of regular expressions, searched
  (`re.search`) in the variable's path (e.g. ``"dense_1/bias"``). They are
  saved by `get_config`.
- Keras form: ``optimizer.exclude_from_weight_decay(var_list=..., var_names=...)``
  and ``optimizer.exclude_from_layer_adaptation(var_list=..., var_names=...)``
  before the optimizer is built. Names are added to the saved regex lists;
  `var_list` selects variables by identity and, like Keras' own form, cannot
  be saved.

`exclude_from_layer_adaptation` defaults to `exclude_from_weight_decay`
(Model Garden). The decision is made once per variable in `build`, so the
update step branches on Python booleans, not tensors.
"""

import re

from tf_vrgd import validation


class LayerwiseExclusionMixin:
    """Mixin for optimizers with Model Garden exclusion lists.

    The host class must call `_init_exclusions` in `__init__`; `build`
    decides each variable's exclusions once Keras has built the optimizer,
    then makes the host's own slots in `_build_slots(var_list)` (none by
    default: a Keras base class that makes its slots in `build` keeps them).
    """

    def _init_exclusions(
        self, exclude_from_weight_decay, exclude_from_layer_adaptation, weight_decay_rate=None
    ):
        """Checks and keeps the exclusion lists, and the coupled
        `weight_decay_rate` that the layer-wise optimizers take (None: the
        host has none)."""
        if weight_decay_rate is not None:
            self.weight_decay_rate = validation.check_number(
                "weight_decay_rate", weight_decay_rate, low=0.0
            )
        self._weight_decay_patterns = validation.check_regex_list(
            "exclude_from_weight_decay", exclude_from_weight_decay
        )
        self._layer_adaptation_patterns = validation.check_regex_list(
            "exclude_from_layer_adaptation", exclude_from_layer_adaptation
        )
        self._layer_adaptation_var_keys = set()

    # Keras' method of the same name; our version also records the names so
    # that they are saved with the optimizer.
    def exclude_from_weight_decay(self, var_list=None, var_names=None):
        """Excludes variables from weight decay (both Keras' `weight_decay`
        and `weight_decay_rate`). Call before the optimizer is built.

        Args:
            var_list: Variables to exclude (not saved by `get_config`).
            var_names: Regular expressions searched in variable paths; added
                to the saved `exclude_from_weight_decay` list.
        """
        self._check_not_built("exclude_from_weight_decay")
        super().exclude_from_weight_decay(var_list=var_list)
        if var_names:
            self._weight_decay_patterns = list(self._weight_decay_patterns or []) + list(
                validation.check_regex_list("var_names", list(var_names))
            )

    def exclude_from_layer_adaptation(self, var_list=None, var_names=None):
        """Excludes variables from the layer-wise trust ratio. Call before
        the optimizer is built.

        Args:
            var_list: Variables to exclude (not saved by `get_config`).
            var_names: Regular expressions searched in variable paths; added
                to the saved `exclude_from_layer_adaptation` list.
        """
        self._check_not_built("exclude_from_layer_adaptation")
        if var_list:
            self._layer_adaptation_var_keys |= {self._var_key(variable) for variable in var_list}
        if var_names:
            self._layer_adaptation_patterns = list(self._layer_adaptation_patterns or []) + list(
                validation.check_regex_list("var_names", list(var_names))
            )

    def _check_not_built(self, method):
        if self.built:
            raise ValueError(f"`{method}()` can only be called before the optimizer is built.")

    @staticmethod
    def _matches(patterns, variable):
        path = getattr(variable, "path", None) or variable.name
        return any(re.search(pattern, path) for pattern in patterns or ())

    def _use_weight_decay(self, variable):
        # Keras' decoupled `weight_decay` and the coupled `weight_decay_rate`
        # share one exclusion rule.
        if self._matches(self._weight_decay_patterns, variable):
            return False
        return super()._use_weight_decay(variable)

    def _use_layer_adaptation(self, variable):
        if self._var_key(variable) in self._layer_adaptation_var_keys:
            return False
        patterns = self._layer_adaptation_patterns
        if patterns is None:
            # Model Garden: the adaptation list defaults to the decay list,
            # in both of its forms.
            return self._use_weight_decay(variable)
        return not self._matches(patterns, variable)

    def build(self, var_list):
        if self.built:
            return
        super().build(var_list)
        self._decays = [self._use_weight_decay(v) for v in var_list]
        self._adapts = [self._use_layer_adaptation(v) for v in var_list]
        self._build_slots(var_list)

    def _build_slots(self, var_list):
        """Makes the host's optimizer variables (after Keras' `build`)."""

    def _exclusion_config(self):
        return {
            **(
                {"weight_decay_rate": self.weight_decay_rate}
                if hasattr(self, "weight_decay_rate")
                else {}
            ),
            "exclude_from_weight_decay": self._weight_decay_patterns,
            "exclude_from_layer_adaptation": self._layer_adaptation_patterns,
        }
