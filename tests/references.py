"""Independent numpy references of the update rules (docs/algorithms.md).

Written from the rules' statements, not from the package's code; every
comparison goes through `assert_close`, which records the worst relative
error per reference for the summary printed at the end of the test run.
"""

from collections.abc import Callable
import dataclasses

import numpy as np

WORST_RELATIVE_ERRORS = {}


def relative_error(actual, expected):
    """max |actual - expected| / max |expected| (inf-norm relative error)."""
    actual = np.asarray(actual, dtype=np.float64)
    expected = np.asarray(expected, dtype=np.float64)
    scale = max(np.max(np.abs(expected)), 1e-30)
    return float(np.max(np.abs(actual - expected)) / scale)


def assert_close(actual, expected, name, rtol=2e-5, start=None):
    """Asserts inf-norm relative closeness and records the error.

    With `start` (the weights before the updates), the updates are compared:
    ``actual - start`` against ``expected - start``, relative to the
    expected update, not to the weights (an error of 1% of the update may
    be 1e-5 of the weights)."""
    actual = np.asarray(actual, np.float64 if start is not None else None)
    expected = np.asarray(expected, np.float64 if start is not None else None)
    assert actual.shape == expected.shape, (name, actual.shape, expected.shape)
    assert np.all(np.isfinite(actual)), f"{name}: non-finite values"
    if start is not None:
        start = np.asarray(start, np.float64)
        actual, expected = actual - start, expected - start
        assert np.max(np.abs(expected)) > 0, f"{name}: the expected update is zero"
    error = relative_error(actual, expected)
    WORST_RELATIVE_ERRORS[name] = max(WORST_RELATIVE_ERRORS.get(name, 0.0), error)
    assert error <= rtol, f"{name}: relative error {error:.3e} > {rtol:.1e}"


def assert_all_close(actual, expected, name, rtol=2e-5, start=None):
    """`assert_close` on each pair of two equally long lists of arrays (and
    of `start`, a list of the weights before, when given)."""
    assert len(actual) == len(expected), (name, len(actual), len(expected))
    starts = [None] * len(actual) if start is None else list(start)
    assert len(starts) == len(actual), (name, len(starts), len(actual))
    for a, e, s in zip(actual, expected, starts):
        assert_close(a, e, name, rtol, start=s)


def norm(x):
    return np.sqrt(np.sum(np.square(x, dtype=np.float64)))


# --- LARS (docs/algorithms.md §4, Model Garden classic momentum) ---------------


def lars_step(
    w,
    g,
    v,
    lr,
    momentum=0.9,
    nesterov=False,
    trust_coefficient=0.001,
    weight_decay_rate=0.0,
    decay=True,
    adapt=True,
):
    """One LARS step; returns (new_w, new_v). float64 throughout."""
    w, g, v = (np.asarray(x, np.float64) for x in (w, g, v))
    u = g + weight_decay_rate * w if decay else g
    trust = 1.0
    if adapt and norm(w) > 0 and norm(u) > 0:
        trust = trust_coefficient * norm(w) / norm(u)
    new_v = momentum * v + lr * trust * u
    step = momentum * new_v + lr * trust * u if nesterov else new_v
    return w - step, new_v


# --- LARC (docs/algorithms.md §5, Apex) -----------------------------------------


def larc_gradient(w, g, lr, trust_coefficient=0.02, clip=True, epsilon=1e-8, weight_decay=0.0):
    w, g = np.asarray(w, np.float64), np.asarray(g, np.float64)
    w_norm, g_norm = norm(w), norm(g)
    if not (w_norm > 0 and g_norm > 0):
        return g
    a = trust_coefficient * w_norm / (g_norm + weight_decay * w_norm + epsilon)
    factor = min(a / lr, 1.0) if clip else a
    return (g + weight_decay * w) * factor


# --- Keras base optimizers ---------------------------------------------------


def keras_sgd_step(w, g, m, lr, momentum=0.0, nesterov=False):
    """keras.optimizers.SGD: m <- momentum*m - lr*g; w <- w + m (nesterov:
    w <- w + momentum*m - lr*g)."""
    w, g, m = (np.asarray(x, np.float64) for x in (w, g, m))
    if momentum == 0:
        return w - lr * g, m
    m = momentum * m - lr * g
    if nesterov:
        return w + momentum * m - lr * g, m
    return w + m, m


def keras_adam_step(w, g, m, v, t, lr, beta_1=0.9, beta_2=0.999, epsilon=1e-7):
    """keras.optimizers.Adam at step t (from 1): epsilon outside the
    bias-corrected square root, lr folded with the corrections."""
    w, g, m, v = (np.asarray(x, np.float64) for x in (w, g, m, v))
    m = beta_1 * m + (1 - beta_1) * g
    v = beta_2 * v + (1 - beta_2) * g * g
    lr_t = lr * np.sqrt(1 - beta_2**t) / (1 - beta_1**t)
    return w - lr_t * m / (np.sqrt(v) + epsilon), m, v


# --- GSNR (docs/algorithms.md §1-3) ----------------------------------------------


def raw_gsnr(samples, epsilon=1e-6):
    """(raw element-wise GSNR, mean) from the k samples (axis 0) of one
    variable (docs/algorithms.md §2)."""
    samples = np.asarray(samples, np.float64)
    mean = samples.mean(axis=0)
    second = np.square(samples).mean(axis=0)
    variance = np.maximum(second - mean**2, 0.0)
    denominator = np.maximum(variance, epsilon * second)
    raw = np.zeros_like(mean)
    positive = _measured(second)
    raw[positive] = mean[positive] ** 2 / denominator[positive]
    return raw, mean


def _measured(second):
    with np.errstate(invalid="ignore"):
        return (second > 0) & np.isfinite(second)


def measured(samples):
    """The elements with a GSNR: a finite s > 0 (docs/algorithms.md §2)."""
    with np.errstate(invalid="ignore", over="ignore"):
        return _measured(np.square(np.asarray(samples, np.float64)).mean(axis=0))


def gsnr_scale(samples, gamma, epsilon=1e-6):
    """(r of docs/algorithms.md §2, mean) from the k samples of one variable:
    the layer mean over the elements with s > 0."""
    raw, mean = raw_gsnr(samples, epsilon)
    has = measured(samples)
    layer_mean = raw[has].mean() if has.any() else 0.0
    normalized = raw / layer_mean if layer_mean > 0 else np.ones_like(raw)
    return np.clip(normalized, gamma, 1.0), mean


def gsnr_statistics(samples, gamma, applied, epsilon=1e-6):
    """One variable's statistics row of a GSNR update, without the update
    count (`tf_vrgd.statistics.NAMES` then `NOISE_NAMES`) from its k
    samples and the factor `applied` to gbar: averages over the measured
    elements of the raw GSNR, of r at gamma, of r at 1 and of the factor,
    then sums over them of gbar^2 and of s (0 where none is measured)."""
    raw, mean = raw_gsnr(samples, epsilon)
    r, _ = gsnr_scale(samples, gamma, epsilon)
    has = measured(samples)
    second = np.square(np.asarray(samples, np.float64)).mean(axis=0)
    averaged = [raw, r <= gamma, r >= 1.0, np.broadcast_to(applied, raw.shape)]
    averages = [np.asarray(x, np.float64)[has].mean() if has.any() else 0.0 for x in averaged]
    return np.array(averages + [np.sum(mean[has] ** 2), np.sum(second[has])])


def lamb_step(
    w,
    g,
    m,
    v,
    t,
    lr,
    beta_1=0.9,
    beta_2=0.999,
    epsilon=1e-6,
    weight_decay_rate=0.0,
    decay=True,
    adapt=True,
):
    w, g, m, v = (np.asarray(x, np.float64) for x in (w, g, m, v))
    m = beta_1 * m + (1 - beta_1) * g
    v = beta_2 * v + (1 - beta_2) * g * g
    u = (m / (1 - beta_1**t)) / (np.sqrt(v / (1 - beta_2**t)) + epsilon)
    if decay:
        u = u + weight_decay_rate * w
    ratio = 1.0
    if adapt and norm(w) > 0 and norm(u) > 0:
        ratio = norm(w) / norm(u)
    return w - lr * ratio * u, m, v


# --- Rules as data, and the one multi-step driver ----------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    """A base rule for `run` and `VRReference`.

    `step(i, w, g, slots, t)` applies the rule to variable i (weights w,
    gradient g, its `slot_count` slots, update t from 1) and returns
    ``(new_w, new_slots)``.
    """

    step: Callable
    slot_count: int


def sgd(lr, momentum=0.0, nesterov=False, weight_decay=0.0):
    """Keras' SGD; with Keras' decoupled `weight_decay`, ``w -= w * wd * lr``
    first."""

    def step(i, w, g, slots, t):
        w = np.asarray(w, np.float64) * (1.0 - weight_decay * lr)
        w, m = keras_sgd_step(w, g, slots[0], lr, momentum, nesterov)
        return w, [m]

    return Rule(step, 1)


def adam(lr, **hyper):
    def step(i, w, g, slots, t):
        w, m, v = keras_adam_step(w, g, slots[0], slots[1], t, lr, **hyper)
        return w, [m, v]

    return Rule(step, 2)


def lars(lr, decays=None, adapts=None, **hyper):
    """LARS; `decays[i]` / `adapts[i]` for variable i (default True; adapts
    default to decays, as the exclusion lists do)."""
    adapts = adapts or decays

    def step(i, w, g, slots, t):
        w, v = lars_step(
            w,
            g,
            slots[0],
            lr,
            decay=decays[i] if decays else True,
            adapt=adapts[i] if adapts else True,
            **hyper,
        )
        return w, [v]

    return Rule(step, 1)


def lamb(lr, decays=None, adapts=None, **hyper):
    adapts = adapts or decays

    def step(i, w, g, slots, t):
        w, m, v = lamb_step(
            w,
            g,
            slots[0],
            slots[1],
            t,
            lr,
            decay=decays[i] if decays else True,
            adapt=adapts[i] if adapts else True,
            **hyper,
        )
        return w, [m, v]

    return Rule(step, 2)


def larc(rule, lr, **hyper):
    """`rule` applied to LARC's gradient (at the inner rate `lr`, or at
    ``lr(t)`` if `lr` is callable)."""

    def step(i, w, g, slots, t):
        rate = lr(t) if callable(lr) else lr
        return rule.step(i, w, larc_gradient(w, g, rate, **hyper), slots, t)

    return Rule(step, rule.slot_count)


def run(weights, rule, gradients):
    """Applies `rule` for each step of `gradients` ([steps][variable]
    arrays); returns the final weights in float64."""
    weights = [np.asarray(w, np.float64) for w in weights]
    slots = [[np.zeros_like(w) for _ in range(rule.slot_count)] for w in weights]
    for t, grads in enumerate(gradients, start=1):
        for i, g in enumerate(grads):
            weights[i], slots[i] = rule.step(i, weights[i], g, slots[i], t)
    return weights


class VRReference:
    """VR optimizer reference: GSNR scaling, then the base `rule` on ghat.

    With `gsnr_interval = N` (docs/algorithms.md §7) the scale is measured
    at updates 1, N + 1, 2N + 1, ... only, the momentum's bias correction
    counting those; the updates between apply the last measured scale.
    """

    def __init__(self, weights, rule, gamma, beta_3, epsilon=1e-6, gsnr_interval=1, row_sparse=()):
        """`row_sparse`: the variables whose gradients arrive as rows (an
        embedding table): their momentum's bias correction counts, per
        row, the GSNR updates in which the row had a sample."""
        self.weights = [np.asarray(w, np.float64) for w in weights]
        self.slots = [[np.zeros_like(w) for _ in range(rule.slot_count)] for w in self.weights]
        self.p = [np.zeros_like(w) for w in self.weights]
        self.rule, self.gamma, self.beta_3, self.epsilon = rule, gamma, beta_3, epsilon
        self.interval = gsnr_interval
        self.row_sparse = set(row_sparse)
        self.row_counts = [np.zeros(w.shape[:1]) for w in self.weights]
        # 1 (the base rule) where nothing has been measured yet.
        self.last = [np.ones_like(w) for w in self.weights]
        self.t = 0
        self.measured = 0

    def update(self, samples_per_variable):
        """samples_per_variable[i]: array [k, *shape] of variable i."""
        self.t += 1
        measure = (self.t - 1) % self.interval == 0
        self.measured += measure
        for i, samples in enumerate(samples_per_variable):
            mean = np.asarray(samples, np.float64).mean(axis=0)
            if measure:
                r, _ = gsnr_scale(samples, self.gamma, self.epsilon)
                has = measured(samples)
                if self.beta_3 > 0:
                    # Elements without a sample keep their momentum.
                    new = self.beta_3 * self.p[i] + (1 - self.beta_3) * r
                    self.p[i] = np.where(has, new, self.p[i])
                    if i in self.row_sparse:
                        sampled = has.reshape(has.shape[0], -1).any(axis=1)
                        self.row_counts[i] += sampled
                        count = self.row_counts[i].reshape((-1,) + (1,) * (has.ndim - 1))
                        correction = 1 - self.beta_3**count
                        with np.errstate(divide="ignore", invalid="ignore"):
                            # A row never measured takes the base rule.
                            r = np.where(correction > 0, self.p[i] / correction, 1.0)
                    else:
                        r = self.p[i] / (1 - self.beta_3**self.measured)
                    self.last[i] = r
                else:
                    self.last[i] = np.where(has, r, self.last[i])
            self.weights[i], self.slots[i] = self.rule.step(
                i, self.weights[i], self.last[i] * mean, self.slots[i], self.t
            )
        return self.weights


def run_lars(weights, stream, lr, decays=None, adapts=None, **hyper):
    """The weights after LARS applies `stream`."""
    return run(weights, lars(lr, decays, adapts or decays, **hyper), stream)


def run_larc_sgd(weights, stream, lr, momentum=0.0, nesterov=False, **hyper):
    """The weights after LARC around Keras SGD applies `stream`."""
    return run(weights, larc(sgd(lr, momentum, nesterov), lr, **hyper), stream)


def noise_scale_sums(updates, interval=1):
    """`tf_vrgd.NoiseScale.noise_scale_sums` from the samples of each update
    (`helpers.samples_per_update`: per variable an array [k, *shape]), the
    updates 1, N + 1, ... measured: per variable, the sums of |mean of the
    samples|^2 and of the mean |sample|^2, and the count."""
    sums = np.zeros((len(updates[0]), 3))
    for u, samples in enumerate(updates):
        if u % interval:
            continue
        for i, s in enumerate(samples):
            flat = np.asarray(s, np.float64).reshape(len(s), -1)
            sums[i] += [np.sum(flat.mean(0) ** 2), np.mean(np.sum(flat**2, 1)), 1.0]
    return sums


# --- AdaScale (docs/algorithms.md §10) --------------------------------------------


def adascale_gains(updates, scale=None, decay=0.0):
    """AdaScale's gain and scale-invariant step, per update, from the samples
    of each update (`helpers.samples_per_update`): a list of ``(r, tau)``,
    tau the value before the update (the step its rate is read at)."""
    k = len(updates[0][0])
    scale = float(scale or k)
    averages, tau, out = np.zeros(2), 0.0, []
    for count, samples in enumerate(updates, start=1):
        flat = [np.asarray(s, np.float64).reshape(k, -1) for s in samples]
        big = sum(np.sum(f.mean(0) ** 2) for f in flat)
        small = sum(np.mean(np.sum(f**2, 1)) for f in flat)
        new = np.array([scale * (small - big), k * big - small]) / (k - 1)
        averages = decay * averages + (1 - decay) * new
        variance, squared_norm = averages / (1 - decay**count)  # bias-corrected
        gain = 1.0
        if squared_norm > 0:
            ratio = (variance + squared_norm) / (variance / scale + squared_norm)
            gain = float(np.clip(ratio, 1.0, scale))
        out.append((gain, tau))
        tau += gain
    return out


def adascale_noise_scale(updates, update_examples, decay=0.0):
    """B_simple in examples from AdaScale's moving averages after `updates`:
    ``B (|G_small|^2 - |G_big|^2) / (k |G_big|^2 - |G_small|^2)`` with each
    term averaged (decay `decay`); it does not depend on S."""
    k = len(updates[0][0])
    averages = np.zeros(2)
    for samples in updates:
        flat = [np.asarray(s, np.float64).reshape(k, -1) for s in samples]
        big = sum(np.sum(f.mean(0) ** 2) for f in flat)
        small = sum(np.mean(np.sum(f**2, 1)) for f in flat)
        averages = decay * averages + (1 - decay) * np.array([small - big, k * big - small])
    return update_examples * averages[0] / averages[1]


def adascale_weights(initial, updates, gains, rule_at, base_rate):
    """The weights after applying, at each update, `rule_at(rate)` (a
    `Rule`) to the mean of its samples, with rate = r * lr(floor(tau)):
    `gains` as `adascale_gains` gives them, `base_rate(step)` the base
    schedule."""
    weights = [np.asarray(w, np.float64) for w in initial]
    slots = [[np.zeros_like(w) for _ in range(rule_at(1.0).slot_count)] for w in weights]
    for t, (samples, (gain, tau)) in enumerate(zip(updates, gains), start=1):
        rule = rule_at(gain * base_rate(int(np.floor(tau))))
        for i, s in enumerate(samples):
            weights[i], slots[i] = rule.step(i, weights[i], s.mean(0), slots[i], t)
    return weights
