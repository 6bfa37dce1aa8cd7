"""The VR family against numpy references of Algorithms 1, 3, 5, VR-Momentum
and VR-LARS (docs/algorithms.md §1-4), on distinct data per replica, with
gradient accumulation, and the properties of §2."""

import functools

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests import helpers
from tests import references as ref
from tests.vr_cases import (  # the fixture: every test here picks its update path
    CASES,
    PACKING,
    SCALES,
    update_path,  # noqa: F401
)
import tf_vrgd
from tf_vrgd import _device_trace

UPDATES = 5


def _reference(case, initial, samples_per_update):
    case = CASES[case]
    reference = ref.VRReference(initial, case.rule, case.gamma, case.beta_3)
    for samples in samples_per_update:
        weights = reference.update(samples)
    return weights


def _make(case, **extra):
    return CASES[case].make(**extra)


@pytest.mark.parametrize("path", PACKING)
@pytest.mark.parametrize("case", CASES)
def test_vr_matches_reference_on_four_replicas(strategy, case, path):
    stream = helpers.model_stream(UPDATES, 4, SCALES, seed=11)
    reference = functools.partial(_reference, case)
    _, _, optimizer = helpers.run_mirrored_against(
        strategy, lambda: _make(case), stream, 1, reference, f"{case} (4 replicas)"
    )
    assert int(optimizer.iterations.numpy()) == UPDATES


@pytest.mark.parametrize("case", ["VR-Momentum", "VR-Adam", "VR-LAMB"])
def test_vr_matches_reference_with_accumulation_on_four_replicas(strategy, case):
    steps = 2
    stream = helpers.model_stream(UPDATES * steps, 4, SCALES, seed=12)
    make = functools.partial(_make, case, gradient_accumulation_steps=steps)
    label = f"{case} (4 replicas x 2 micro-steps)"
    _, _, optimizer = helpers.run_mirrored_against(
        strategy, make, stream, steps, functools.partial(_reference, case), label
    )
    assert int(optimizer.iterations.numpy()) == UPDATES


@pytest.mark.parametrize("case", ["VR-SGD", "VR-Adam", "VR-LARS", "VR-LAMB"])
def test_vr_matches_reference_with_accumulation_on_one_device(case):
    steps = 3
    stream = helpers.model_stream(UPDATES * steps, 1, SCALES, seed=13)
    model = helpers.make_model()
    initial = model.get_weights()
    optimizer = _make(case, gradient_accumulation_steps=steps)
    helpers.apply_stream(optimizer, model.trainable_variables, stream, compiled=True)
    expected = _reference(case, initial, helpers.samples_per_update(stream, steps))
    for g, e, w0 in zip(model.get_weights(), expected, initial):
        ref.assert_close(g, e, f"{case} (1 device x 3 micro-steps)", rtol=1e-4, start=w0)


def _clipped(stream, kind, limit):
    """`stream` as the hook's moments see it when Keras clips (`kind`, at
    `limit`) each replica's gradients, which Keras has scaled by 1/R, before
    the collective: clipped, then scaled back."""
    out = []
    for step in stream:
        replicas = len(step)
        clipped_step = []
        for grads in step:
            scaled = [np.asarray(g, np.float64) / replicas for g in grads]
            if kind == "clipvalue":
                scaled = [np.clip(g, -limit, limit) for g in scaled]
            elif kind == "clipnorm":
                scaled = [g * limit / max(ref.norm(g), limit) for g in scaled]
            else:
                total = np.sqrt(sum(ref.norm(g) ** 2 for g in scaled))
                scaled = [g * limit / max(total, limit) for g in scaled]
            clipped_step.append([g * replicas for g in scaled])
        out.append(clipped_step)
    return out


@pytest.mark.parametrize(
    "kind, limit", [("clipvalue", 0.1), ("clipnorm", 0.3), ("global_clipnorm", 0.3)]
)
def test_keras_clipping_clips_each_replicas_gradient_before_the_moments(strategy, kind, limit):
    stream = helpers.model_stream(UPDATES, 4, SCALES, seed=14)
    initial, got, _ = helpers.run_mirrored(
        strategy, lambda: _make("VR-Momentum", **{kind: limit}), stream
    )
    clipped = helpers.samples_per_update(_clipped(stream, kind, limit), 1)
    expected = _reference("VR-Momentum", initial, clipped)
    unclipped = _reference("VR-Momentum", initial, helpers.samples_per_update(stream, 1))
    # The limit bites: clipped and unclipped runs end apart.
    assert (
        ref.relative_error(
            np.concatenate([e.ravel() for e in expected]),
            np.concatenate([u.ravel() for u in unclipped]),
        )
        > 1e-2
    )
    ref.assert_all_close(got, expected, f"VR-Momentum, Keras {kind}", rtol=1e-4, start=initial)


BASES = {
    "VRSGD": lambda: keras.optimizers.SGD(0.5, momentum=0.9, nesterov=True),
    "VRAdam": lambda: keras.optimizers.Adam(0.05),
    # At VRLAMB's epsilon (Keras' Lamb defaults to 1e-7).
    "VRLAMB": lambda: keras.optimizers.Lamb(0.05, epsilon=1e-6),
    "VRLARS": lambda: tf_vrgd.LARS(2.0, trust_coefficient=0.01),
}
TWINS = {
    "VRSGD": lambda **k: tf_vrgd.VRSGD(0.5, momentum=0.9, nesterov=True, **k),
    "VRAdam": lambda **k: tf_vrgd.VRAdam(0.05, **k),
    "VRLAMB": lambda **k: tf_vrgd.VRLAMB(0.05, **k),
    "VRLARS": lambda **k: tf_vrgd.VRLARS(2.0, trust_coefficient=0.01, **k),
}


@pytest.mark.parametrize("path", ["packed", "fused"])
@pytest.mark.parametrize("name", TWINS)
def test_gamma_one_equals_base_optimizer(strategy, name, path):
    stream = helpers.model_stream(UPDATES, 4, SCALES, seed=14)
    initial, vr, _ = helpers.run_mirrored(
        strategy, lambda: TWINS[name](gamma=1.0, beta_3=0.5), stream
    )
    _, base, _ = helpers.run_mirrored(strategy, BASES[name], stream)
    rtol = 5e-6  # float32 round-off: at most 1e-6 measured
    ref.assert_all_close(vr, base, f"{name} gamma=1 vs base", rtol=rtol, start=initial)
    if name == "VRLAMB":
        means = [[s.mean(0) for s in samples] for samples in helpers.samples_per_update(stream, 1)]
        plain = ref.run(initial, ref.lamb(0.05), means)
        ref.assert_all_close(vr, plain, "VRLAMB gamma=1 vs numpy LAMB", rtol=1e-5, start=initial)


@pytest.mark.parametrize("path", ["packed", "fused"])
@pytest.mark.parametrize("name", TWINS)
def test_identical_replicas_give_base_optimizer(strategy, name, path):
    one = helpers.model_stream(UPDATES, 1, SCALES, seed=15)
    stream = [[step[0]] * 4 for step in one]
    initial, vr, _ = helpers.run_mirrored(strategy, TWINS[name], stream)
    _, base, _ = helpers.run_mirrored(strategy, BASES[name], stream)
    rtol = 5e-6
    ref.assert_all_close(vr, base, f"{name} identical replicas vs base", rtol=rtol, start=initial)


@pytest.mark.parametrize("name", ["VRSGD", "VRLARS"])
def test_scaling_all_samples_scales_gsnr_invariantly(strategy, name):
    # VR-SGD's first step is linear in ghat and VR-LARS' (no decay) is scale
    # free: a GSNR that changed with the scale would change the step.
    stream = helpers.gradient_stream(helpers.model_shapes(), 1, replicas=4, scales=SCALES, seed=16)
    scaled = [[[g * 8.0 for g in replica] for replica in step] for step in stream]
    initial, a, _ = helpers.run_mirrored(strategy, lambda: TWINS[name](), stream)
    _, b, _ = helpers.run_mirrored(strategy, lambda: TWINS[name](), scaled)
    factor = 8.0 if name == "VRSGD" else 1.0  # LARS: trust * u is scale free
    for w0, x, y in zip(initial, a, b):
        ref.assert_close(y - w0, factor * (x - w0), f"{name} sample-scale invariance", rtol=1e-4)


def test_single_sample_raises_with_a_remedy():
    model = helpers.make_model()
    optimizer = tf_vrgd.VRAdam()
    with pytest.raises(ValueError, match=r"k >= 2.*gradient_accumulation_steps >= 2"):
        optimizer.apply(
            [tf.ones_like(v) for v in model.trainable_variables], model.trainable_variables
        )


@pytest.mark.parametrize("cls", [tf_vrgd.VRSGD, tf_vrgd.VRAdam, tf_vrgd.VRLARS, tf_vrgd.VRLAMB])
@pytest.mark.parametrize(
    "kwargs,argument",
    [
        (dict(gamma=0.0), "gamma"),
        (dict(gamma=1.5), "gamma"),
        (dict(beta_3=1.0), "beta_3"),
        (dict(beta_3=-0.1), "beta_3"),
        (dict(gsnr_epsilon=0.0), "gsnr_epsilon"),
        (dict(learning_rate=-1.0), "learning_rate"),
        (dict(learning_rate=float("inf")), "learning_rate"),
        (dict(jit_update="no"), "jit_update"),
        # A bool is no interval, though Python counts True as 1.
        (dict(gsnr_interval=True), "gsnr_interval"),
        (dict(gsnr_interval=2.0), "gsnr_interval"),
    ],
)
def test_bad_hyper_parameters_raise(cls, kwargs, argument):
    with pytest.raises(ValueError, match=f"`{argument}`.*Received: {argument}="):
        cls(**kwargs)


def test_xla_update_equals_non_xla_under_mirrored_strategy(strategy):
    stream = helpers.model_stream(UPDATES, 4, SCALES, seed=17)
    for name in ("VRAdam", "VRLARS"):  # one adaptive and one layer-wise rule
        make = TWINS[name]
        initial, xla, _ = helpers.run_mirrored(
            strategy, functools.partial(make, jit_update=True), stream
        )
        _, plain, _ = helpers.run_mirrored(
            strategy, functools.partial(make, jit_update=False), stream
        )
        ref.assert_all_close(xla, plain, f"{name} XLA vs non-XLA update", rtol=1e-5, start=initial)


def test_accumulators_hold_each_replicas_own_sums(strategy):
    # Two kernels of one shape in each model and three optimizers of one
    # kind: every replica's slots must hold its own gradient and its square
    # after a micro-step, whichever optimizer or variable was traced first.
    shapes = [(6, 6), (6,), (6, 6), (6,)]
    runs = []
    for seed, jit_update in ((20, True), (21, True), (22, False)):
        with strategy.scope():
            model = keras.Sequential(
                [keras.Input((6,)), keras.layers.Dense(6), keras.layers.Dense(6)]
            )
            optimizer = tf_vrgd.VRAdam(gradient_accumulation_steps=2, jit_update=jit_update)
        stream = helpers.gradient_stream(shapes, 2, replicas=4, seed=seed)
        helpers.apply_stream_mirrored(strategy, optimizer, model.trainable_variables, stream[:1])
        runs.append((optimizer, model, stream))
    for optimizer, _, stream in runs:
        for i in range(len(shapes)):
            sums = strategy.experimental_local_results(optimizer._intake.sums[i].value)
            squares = strategy.experimental_local_results(optimizer._intake.squares[i].value)
            for r in range(4):
                g = stream[0][r][i].astype(np.float64)  # the sample, 1/R scaling undone
                np.testing.assert_allclose(sums[r].numpy(), g, rtol=1e-6)
                np.testing.assert_allclose(squares[r].numpy(), g * g, rtol=1e-5)
        counts = strategy.experimental_local_results(optimizer._intake.samples.value)
        assert [float(c.numpy()) for c in counts] == [1.0] * 4
    # The update's micro-step leaves every replica's sums at zero.
    optimizer, model, stream = runs[0]
    helpers.apply_stream_mirrored(strategy, optimizer, model.trainable_variables, stream[1:])
    assert int(optimizer.iterations.numpy()) == 1
    for slot in optimizer._intake.sums + optimizer._intake.squares + [optimizer._intake.samples]:
        for value in strategy.experimental_local_results(slot.value):
            assert not np.any(value.numpy())


def _update_traces(optimizer):
    """Traces of the optimizer's compiled update programs."""
    return sum(
        f.compiled.experimental_get_tracing_count()
        for f in optimizer._device.programs.values()
        if f.compiled is not None
    )


def test_update_is_traced_once(strategy):
    stream = helpers.model_stream(UPDATES, 4, SCALES, seed=18)
    with strategy.scope():
        model = helpers.make_model()
        optimizer = tf_vrgd.VRAdam()
    helpers.apply_stream_mirrored(strategy, optimizer, model.trainable_variables, stream[:1])
    # One trace of the compiled program for all variables and every replica
    # device (XLA compiles it on each device).
    assert strategy.num_replicas_in_sync == 4
    assert _update_traces(optimizer) == 1
    helpers.apply_stream_mirrored(strategy, optimizer, model.trainable_variables, stream[1:])
    # The same program serves every later step (the step function in the
    # helper is re-created per call, yet nothing is re-traced here).
    assert _update_traces(optimizer) == 1


def test_layer_mean_programs_are_traced_once_for_every_device(strategy):
    # The layer means' two programs (the element sums, and the masked means
    # of the rare branch) take tensors only: one trace serves all devices.
    stream = helpers.model_stream(UPDATES, 4, SCALES, seed=19)
    with strategy.scope():
        model = helpers.make_model()
        optimizer = tf_vrgd.VRAdam()
    helpers.apply_stream_mirrored(strategy, optimizer, model.trainable_variables, stream)
    shared = [p for f in optimizer._device.programs.values() for p in f.shared]
    assert len(shared) == 2
    assert [p.tracing_count() for p in shared] == [1, 1]
    assert _update_traces(optimizer) == 1


def test_a_device_update_is_shared_only_when_it_knows_every_captured_variable(strategy):
    # The device update is traced once and run on every device with each
    # captured variable rebound to that device's copy; a variable it cannot
    # rebind (here one left out of `variables`) makes it run per device.
    with strategy.scope():
        known = tf.Variable(tf.zeros([3]))
        unknown = tf.Variable(tf.zeros([3]))

    def add(value):
        known.assign_add(value)
        unknown.assign_add(2.0 * value)

    # Calls of `update`: the one trace; or that trace (which finds the
    # unknown variable) and one call per device.
    for variables, calls in (([known, unknown], 1), ([known], 5)):
        known.assign(tf.zeros([3]))
        unknown.assign(tf.zeros([3]))
        traced = []

        def update(value, traced=traced):
            traced.append(value)
            add(value)

        shared = _device_trace.OnEveryDevice(update, lambda v=variables: v)

        @tf.function
        def step(shared=shared):
            devices = strategy.extended.non_slot_devices([known])
            strategy.extended.update_non_slot(
                devices, shared, args=(tf.constant([1.0, 2.0, 3.0]),), group=False
            )

        step()
        step()
        assert len(traced) == calls
        for variable, scale in ((known, 1.0), (unknown, 2.0)):
            for copy in strategy.experimental_local_results(variable):
                np.testing.assert_array_equal(copy.numpy(), [2.0 * scale, 4.0 * scale, 6.0 * scale])


@pytest.mark.parametrize(
    "accumulation_steps, interval", [(None, 1), (2, 1), (None, 2)], ids=["", "accumulation", "N=2"]
)
def test_compiled_update_count_does_not_grow_with_variables(strategy, accumulation_steps, interval):
    # MLPs of 5 and 16 Dense layers (10 and 32 variables; the kernels go to
    # the XLA program, the biases are packed): the VR update is traced once
    # for every replica device (and XLA-compiled once on each) for either,
    # where a program per kernel and device would make 20 and 64. Each
    # kernel's gradients have a scale of their own, and every kernel's
    # weights are checked against the numpy reference.
    traces = {}
    steps = accumulation_steps or 1
    for layers in (5, 16):
        with strategy.scope():
            model = keras.Sequential(
                [keras.Input((4,))] + [keras.layers.Dense(4) for _ in range(layers)]
            )
            optimizer = tf_vrgd.VRSGD(
                0.1,
                momentum=0.9,
                beta_3=0.5,
                gradient_accumulation_steps=accumulation_steps,
                gsnr_interval=interval,
            )
        initial = model.get_weights()
        shapes = [tuple(v.shape) for v in model.trainable_variables]
        scales = [10.0 ** -(i % 4) for i in range(len(shapes))]
        stream = helpers.gradient_stream(shapes, 3 * steps, 4, scales, seed=layers)
        helpers.apply_stream_mirrored(strategy, optimizer, model.trainable_variables, stream)
        assert int(optimizer.iterations.numpy()) == 3  # updates, not micro-steps
        traces[layers] = _update_traces(optimizer)
        reference = ref.VRReference(initial, ref.sgd(0.1, 0.9), 0.1, 0.5, gsnr_interval=interval)
        for samples in helpers.samples_per_update(stream, steps):
            expected = reference.update(samples)
        ref.assert_all_close(
            model.get_weights(), expected, f"{layers} layers (4 replicas)", rtol=1e-4, start=initial
        )
    # At N = 2 the updates between GSNR updates have a program of their own.
    assert traces == ({5: 1, 16: 1} if interval == 1 else {5: 2, 16: 2})


def test_larc_wraps_a_vr_optimizer(strategy):
    stream = helpers.model_stream(UPDATES, 4, SCALES, seed=19)
    initial, got, _ = helpers.run_mirrored(
        strategy, lambda: tf_vrgd.LARC(tf_vrgd.VRSGD(0.5, momentum=0.9)), stream
    )

    # LARC sees the gradient the base rule sees: ghat.
    reference = ref.VRReference(initial, ref.larc(ref.sgd(0.5, 0.9), 0.5), 0.1, 0.0)
    for samples in helpers.samples_per_update(stream, 1):
        expected = reference.update(samples)
    ref.assert_all_close(got, expected, "LARC(VR-Momentum) (4 replicas)", rtol=1e-4, start=initial)


def test_the_layer_means_go_masked_first_after_an_unmeasured_element(strategy):
    # Element (3, 4) of the large (XLA) variable has no sample at updates 2,
    # 3 and 5 (zero on every replica: s = 0). After such an update the next
    # one takes the masked means first, and after a fully measured one the
    # element sums; every update still matches the reference, whichever
    # program ran first.
    shapes = [(150, 120), (7, 5)]
    stream = helpers.gradient_stream(shapes, steps=5, replicas=4, scales=[2.0, 0.3], seed=23)
    unmeasured = [False, True, True, False, True]
    for step, zero in zip(stream, unmeasured):
        for replica in step:
            if zero:
                replica[0][3, 4] = 0.0
    rng = np.random.default_rng(5)
    initial = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
    with strategy.scope():
        variables = [keras.Variable(w) for w in initial]
        optimizer = tf_vrgd.VRAdam(0.01)
    reference = ref.VRReference(initial, ref.adam(0.01), 0.1, 0.9)
    hints = []
    for step, update in zip(stream, helpers.samples_per_update(stream, 1)):
        before = [v.numpy() for v in variables]
        helpers.apply_stream_mirrored(strategy, optimizer, variables, [step])
        hints.append(float(optimizer._device.masked_hint.numpy()))
        expected = reference.update(update)
        for i, variable in enumerate(variables):
            ref.assert_close(
                variable.numpy(),
                expected[i],
                f"VR-Adam, unmeasured elements, variable {i}",
                rtol=3e-4,
                start=before[i],
            )
            # Compared step by step: from the reference's own weights too.
            variable.assign(expected[i].astype(np.float32))
    assert hints == [float(zero) for zero in unmeasured]
