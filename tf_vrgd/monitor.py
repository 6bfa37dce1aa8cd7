"""`GSNRMonitor`: a Keras callback that puts the VR optimizers' GSNR
statistics and the gradient noise scale into the training logs (so into
`History`, the progress bar and Keras' own `TensorBoard` callback)."""

import warnings

import keras
import numpy as np

from tf_vrgd import _gsnr, noise_scale, noise_scale_optimizer, replica_noise, statistics, validation
from tf_vrgd.adascale import AdaScale, find_adascale


class GSNRMonitor(keras.callbacks.Callback):
    """Logs the GSNR statistics of a VR optimizer during `fit`, or the
    gradient noise scale of any optimizer wrapped in `tf_vrgd.NoiseScale`.

    The optimizer (constructed with ``track_gsnr_statistics=True``) sums,
    on the device and at every update, each variable's
    mean raw GSNR (``gbar^2 / var``) and the fractions of its elements whose
    normalised GSNR was clipped to `gamma` or to 1. This callback reads those
    sums in one transfer at the end of each epoch (and, with an integer
    `update_freq`, every `update_freq` batches) and adds their averages over
    the updates since the previous read to `logs`:

    - ``gsnr_mean``, ``gsnr_at_gamma``, ``gsnr_at_one``, ``gsnr_scale``
      (the mean factor applied to the gradient: the effective learning-rate
      multiplier): over all elements of all trainable variables (variables
      weighted by their size; `tf_vrgd.statistics` defines them);
    - with `per_variable`, ``gsnr_mean/<variable path>`` and so on for each
      variable;
    - given `batch_size`, ``noise_scale``: the gradient noise scale B_simple
      of the whole model, in examples (`tf_vrgd.noise_scale`), and with
      `per_variable` ``noise_scale/<variable path>``. Each read adds the
      span's estimates of tr(Sigma) and |G|^2 (averaged over its GSNR
      updates) to bias-corrected moving averages (`noise_scale_decay`),
      whose ratio is logged; NaN while the |G|^2 average is not positive.
      The samples of an update are the replicas times the optimizer's
      `gradient_accumulation_steps`; B_small, the examples of one, is
      `batch_size` over the replicas.

    Around a `tf_vrgd.NoiseScale`, only ``noise_scale`` (and per variable)
    is logged, from the squared norms that wrapper sums (`batch_size` is
    then required); its samples are the replicas. Around a
    `tf_vrgd.AdaScale`, ``adascale_gain``, ``adascale_learning_rate`` and
    ``scale_invariant_steps`` are logged: the gain of the last update, the
    rate it applied and tau after it; given `batch_size`, ``noise_scale``
    too, from AdaScale's own moving averages (`AdaScale.noise_scale`: its
    `decay`, not `noise_scale_decay`; the whole model only).

    List it before `keras.callbacks.TensorBoard` (callbacks see `logs` in list
    order); TensorBoard then writes ``epoch_gsnr_mean`` and the rest.
    The statistics describe GSNR updates only (with ``gsnr_interval = N``,
    one update in N): batch logs get no GSNR entries for a span without a
    GSNR update (nothing was measured, so nothing is written, rather than
    NaN); epoch logs get NaN for an epoch without one (so that `History`
    keeps one value per epoch), e.g. when a `LossScaleOptimizer` skipped
    every step.

    Args:
        update_freq: `"epoch"`, or log into batch logs every this many
            batches too (one device read each time).
        per_variable: also log each variable's statistics.
        batch_size: the global batch of one `fit` step, in examples (what
            `fit` is given), for the noise scale; None logs none.
        noise_scale_decay: in [0, 1), the decay of the noise scale's moving
            averages, per read (0: each read's span alone).
    """

    def __init__(
        self,
        update_freq: str | int = "epoch",
        per_variable: bool = True,
        batch_size: int | None = None,
        noise_scale_decay: float = 0.0,
    ) -> None:
        super().__init__()
        if batch_size is not None:
            batch_size = validation.check_integer("batch_size", batch_size, low=1)
        self.batch_size = batch_size
        self.noise_scale_decay = validation.check_number(
            "noise_scale_decay", noise_scale_decay, low=0.0, high=1.0, high_open=True
        )
        if update_freq != "epoch" and not (
            isinstance(update_freq, int) and not isinstance(update_freq, bool) and update_freq > 0
        ):
            raise ValueError(
                "`update_freq` must be 'epoch' or a positive integer. "
                f"Received: update_freq={update_freq!r}"
            )
        self.update_freq = update_freq
        self.per_variable = bool(per_variable)
        self._last_sums = None

    def _measured_optimizer(self):
        """The VR optimizer, else the `NoiseScale` or the `AdaScale`, the
        model trains with."""
        optimizer = _gsnr.find_vr_optimizer(self.model.optimizer)
        if optimizer is not None:
            return optimizer
        optimizer = noise_scale_optimizer.find_noise_scale(self.model.optimizer)
        if optimizer is None:
            optimizer = find_adascale(self.model.optimizer)
            if optimizer is not None:
                return optimizer
            raise ValueError(
                "GSNRMonitor needs a VR optimizer (tf_vrgd.VRSGD, VRAdam, "
                "VRLARS, VRLAMB, possibly wrapped in LARC or "
                "LossScaleOptimizer) or an optimizer wrapped in tf_vrgd.NoiseScale "
                f"or tf_vrgd.AdaScale. Received: {type(self.model.optimizer).__name__}"
            )
        if self.batch_size is None:
            raise ValueError(
                "GSNRMonitor logs the noise scale of a tf_vrgd.NoiseScale, which needs "
                "`batch_size` (the global batch of one fit step)."
            )
        return optimizer

    def on_train_begin(self, logs=None):
        optimizer = self._optimizer = self._measured_optimizer()
        self._gsnr = isinstance(optimizer, _gsnr.GSNRMixin)
        # An update's examples (a VR optimizer accumulates itself; a
        # wrapper's inner optimizer does).
        applying = optimizer if self._gsnr else optimizer.inner_optimizer
        steps = applying.gradient_accumulation_steps or 1
        self._update_examples = None if self.batch_size is None else self.batch_size * steps
        if isinstance(optimizer, AdaScale):
            self._read = self._reset = None
            return
        # The running sums' reader and their noise-scale columns: a VR
        # optimizer's statistics rows, or NoiseScale's own.
        if self._gsnr:
            self._read, self._reset = optimizer.gsnr_statistic_sums, optimizer.reset_gsnr_statistics
            self._noise_terms = statistics.noise_terms
        else:
            self._read, self._reset = optimizer.noise_scale_sums, optimizer.reset_noise_scale_sums
            self._noise_terms = noise_scale_optimizer.noise_terms
        if self._gsnr and not optimizer.track_gsnr_statistics:
            raise ValueError(
                f"GSNRMonitor reads the statistics that "
                f"{type(self._optimizer).__name__} sums only when constructed "
                "with track_gsnr_statistics=True."
            )

        replicas = self.model.distribute_strategy.num_replicas_in_sync
        self._samples = replicas * steps  # an update's gradient samples
        self._noise_scales = (
            noise_scale.MovingNoiseScale(self.noise_scale_decay),  # model-wide
            noise_scale.MovingNoiseScale(self.noise_scale_decay),  # per variable
        )
        shared = replica_noise.shared_streams(self.model)
        if replicas > 1 and shared:
            warnings.warn(
                f"{shared} random layer(s) of the model (dropout...) draw the same values on "
                f"all {replicas} replicas, so the GSNR's variance misses their noise. Call "
                "tf_vrgd.independent_replica_noise(model) after building the model.",
                stacklevel=2,
            )

    def on_epoch_begin(self, epoch, logs=None):
        if self._reset is not None:
            self._reset()
        self._last_sums = None

    def on_train_batch_end(self, batch, logs=None):
        if self.update_freq == "epoch" or (batch + 1) % self.update_freq:
            return
        self._log(logs)

    def on_epoch_end(self, epoch, logs=None):
        if logs is not None:
            self._log(logs, since_epoch_start=True)

    def _log(self, logs, since_epoch_start=False):
        if self._read is None:  # AdaScale
            if logs is not None:
                logs["adascale_gain"] = self._optimizer.gain
                logs["adascale_learning_rate"] = self._optimizer.applied_learning_rate
                if self._update_examples is not None:
                    logs["noise_scale"] = self._optimizer.noise_scale(self._update_examples)
                logs["scale_invariant_steps"] = self._optimizer.scale_invariant_steps
            return
        sums = self._read()
        if sums is None or logs is None:
            return
        since_last = sums if self._last_sums is None else sums - self._last_sums
        self._last_sums = sums
        measured = self._update_noise_scale(since_last)
        span = sums if since_epoch_start else since_last
        if not since_epoch_start and not (span[:, -1] > 0).any():
            return  # the update counts: no GSNR update since the last read
        if self._gsnr:
            logs.update(self.statistics_logs(span))
        if self._update_examples is not None:
            measured = measured or (since_epoch_start and (span[:, -1] > 0).any())
            logs.update(self._noise_scale_logs(measured))

    def _update_noise_scale(self, span):
        """Adds the GSNR updates of `span` (the running sums since the
        previous read) to the noise scale's moving averages; whether there
        were any."""
        if self._update_examples is None:
            return False
        if not (span[:, -1] > 0).all():
            return False
        trace, squared_norm = noise_scale.estimates(
            *self._noise_terms(span), self._update_examples, self._samples
        )
        model_wide, per_variable = self._noise_scales
        model_wide.update(trace.sum(), squared_norm.sum())
        per_variable.update(trace, squared_norm)
        return True

    def _noise_scale_logs(self, measured):
        """``noise_scale`` (and per variable): the moving estimates, NaN
        where nothing was measured since the epoch began."""
        model_wide, per_variable = self._noise_scales
        if not measured:
            values = np.full(len(self._optimizer.trainable_variables_in_order()), np.nan)
            entries = {"noise_scale": float("nan")}
        else:
            values = per_variable.value
            entries = {"noise_scale": float(model_wide.value)}
        if self.per_variable:
            for variable, value in zip(self._optimizer.trainable_variables_in_order(), values):
                entries[f"noise_scale/{statistics.variable_path(variable)}"] = float(value)
        return entries

    def statistics_logs(self, sums):
        """Log entries from ``[variables, statistics.ROW_WIDTH]`` running
        sums (`tf_vrgd.statistics.log_entries`)."""
        variables = self._optimizer.trainable_variables_in_order()
        return statistics.log_entries(
            sums,
            [statistics.variable_path(v) for v in variables],
            [statistics.variable_size(v) for v in variables],
            self.per_variable,
        )

    def get_config(self):
        return {
            "update_freq": self.update_freq,
            "per_variable": self.per_variable,
            "batch_size": self.batch_size,
            "noise_scale_decay": self.noise_scale_decay,
        }
