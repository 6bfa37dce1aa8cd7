"""The GSNR statistics of the VR optimizers: what they hold, their names in
Python and in Keras logs, and how they are averaged.

A VR optimizer constructed with ``track_gsnr_statistics=True`` keeps, per
trainable variable, one float32 row of running sums, updated on the device
at every update: one column per entry of `COLUMNS` (each the per-update
value, summed), one per entry of `NOISE_COLUMNS` (the gradient noise
scale's terms, summed likewise), then the number of updates. `summarize`
turns a row into averages, `model_wide` averages rows over all elements of
all variables, `log_entries` names them for Keras logs
(`tf_vrgd.GSNRMonitor`, `vrgd-train`), and `noise_terms` gives the noise
scale's terms per update.
"""

from collections.abc import Sequence

import numpy as np

# Column -> (meaning, key in Keras logs). The order is the order of the sums
# in a row, followed by the update count.
COLUMNS = {
    "mean_gsnr": ("mean over the variable's elements of the raw GSNR gbar^2 / var", "gsnr_mean"),
    "fraction_at_gamma": (
        "fraction of elements whose normalised GSNR was clipped to gamma",
        "gsnr_at_gamma",
    ),
    "fraction_at_one": (
        "fraction of elements whose normalised GSNR was clipped to 1",
        "gsnr_at_one",
    ),
    "mean_scale": (
        "mean of the factor applied to gbar (after the clip and the GSNR momentum): "
        "the variable's effective learning-rate multiplier",
        "gsnr_scale",
    ),
}
NAMES = tuple(COLUMNS)
LOG_KEYS = {name: key for name, (_, key) in COLUMNS.items()}
# After them, the terms of the gradient noise scale (`tf_vrgd.noise_scale`):
# sums over the variable's measured elements, not averages over them.
NOISE_COLUMNS = {
    "squared_norm_of_mean": "|G_big|^2: sum of gbar^2, the squared norm of the samples' mean",
    "mean_squared_norm": "|G_small|^2: sum of s, the mean of the samples' squared norms",
}
NOISE_NAMES = tuple(NOISE_COLUMNS)
# Sums, then the update count.
ROW_WIDTH = len(NAMES) + len(NOISE_NAMES) + 1


def summarize(row: Sequence[float]) -> dict[str, float]:
    """A row of running sums -> ``{name: average over updates, "updates": n}``;
    the averages are NaN when no update has run."""
    row = np.asarray(row, np.float64)
    updates = float(row[-1])
    averages = row[: len(NAMES)] / updates if updates > 0 else np.full(len(NAMES), np.nan)
    return {**{name: float(a) for name, a in zip(NAMES, averages)}, "updates": int(updates)}


def model_wide(sums: np.ndarray, sizes: Sequence[int]) -> dict[str, float]:
    """Averages over all elements of all variables: each variable's averages
    weighted by its number of elements (empty variables take no part).

    Args:
        sums: ``[variables, ROW_WIDTH]`` running sums.
        sizes: the variables' element counts.

    Returns:
        ``{name: average}``, NaN where no update has run.
    """
    sums = np.asarray(sums, np.float64)
    sizes = np.asarray(sizes, np.float64)
    nonempty = sizes > 0
    with np.errstate(invalid="ignore", divide="ignore"):
        averages = sums[nonempty, : len(NAMES)] / sums[nonempty, -1:]
        overall = (averages * sizes[nonempty, None]).sum(axis=0) / sizes.sum()
    return {name: float(value) for name, value in zip(NAMES, overall)}


def log_entries(
    sums: np.ndarray, paths: Sequence[str], sizes: Sequence[int], per_variable: bool = True
) -> dict[str, float]:
    """Keras log entries from ``[variables, ROW_WIDTH]`` running sums: the
    model-wide `LOG_KEYS`, and with `per_variable`, ``<key>/<path>`` for
    each variable."""
    entries = {LOG_KEYS[name]: value for name, value in model_wide(sums, sizes).items()}
    if per_variable:
        for path, row in zip(paths, sums):
            summary = summarize(row)
            for name in NAMES:
                entries[f"{LOG_KEYS[name]}/{path}"] = summary[name]
    return entries


def noise_terms(sums: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(|G_big|^2, |G_small|^2)`` per variable, averaged over the updates
    of ``[variables, ROW_WIDTH]`` running sums (NaN for a variable without
    one): the inputs of `tf_vrgd.noise_scale.estimates`."""
    sums = np.asarray(sums, np.float64)
    start = len(NAMES)
    with np.errstate(invalid="ignore", divide="ignore"):
        means = sums[:, start : start + len(NOISE_NAMES)] / sums[:, -1:]
    return means[:, 0], means[:, 1]


def variable_path(variable) -> str:
    """A variable's path, the key of its statistics (a Keras variable's
    `path`; a plain `tf.Variable`'s name without its ":0")."""
    path = getattr(variable, "path", None)
    return path if path is not None else variable.name.split(":")[0]


def variable_size(variable) -> int:
    """A variable's number of elements, the weight of its statistics in
    model-wide averages (its shape is fully defined)."""
    return int(np.prod(variable.shape, dtype=np.int64))
