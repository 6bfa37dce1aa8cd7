"""VR optimizers under `MultiWorkerMirroredStrategy`: two worker processes
on 127.0.0.1 ports, against a numpy reference and against one process with
four replicas applying the same samples."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from tests import helpers, rows
from tests import multiworker_worker as worker
from tests import references as ref
import tf_vrgd

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKERS = 2
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def worker_results(tmp_path_factory):
    """Runs the two workers once; returns each one's final weights."""
    directory = tmp_path_factory.mktemp("multiworker")
    cluster = {"worker": [f"127.0.0.1:{port}" for port in helpers.free_ports(WORKERS)]}
    processes, outputs = [], []
    for index in range(WORKERS):
        output = directory / f"worker{index}.npz"
        env = dict(
            os.environ,
            TF_CONFIG=json.dumps({"cluster": cluster, "task": {"type": "worker", "index": index}}),
            PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]),
        )
        # The child keeps its own copy of the file descriptor.
        with open(directory / f"worker{index}.log", "w") as log:
            processes.append(
                subprocess.Popen(
                    [sys.executable, "-m", "tests.multiworker_worker", str(output)],
                    cwd=ROOT,
                    env=env,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                )
            )
        outputs.append(output)
    try:
        codes = [p.wait(timeout=TIMEOUT_S) for p in processes]
    finally:
        for p in processes:
            if p.poll() is None:
                p.kill()
    logs = "\n".join((directory / f"worker{i}.log").read_text()[-3000:] for i in range(WORKERS))
    assert codes == [0] * WORKERS, f"worker exit codes {codes}:\n{logs}"
    return [dict(np.load(output)) for output in outputs]


def _weights(results, name):
    count = len([key for key in results if key.startswith(f"{name}_")])
    return [results[f"{name}_{i}"] for i in range(count)]


def test_workers_agree(worker_results):
    first, *others = worker_results
    for other in others:
        assert first.keys() == other.keys()
        for key in first:
            np.testing.assert_array_equal(first[key], other[key])


def test_two_workers_match_the_numpy_reference(worker_results):
    stream = worker.two_worker_stream()
    initial = helpers.make_model().get_weights()
    momentum = worker.VR_MOMENTUM["momentum"]

    rule = ref.sgd(worker.VR_MOMENTUM["learning_rate"], momentum)
    reference = ref.VRReference(
        initial,
        rule,
        worker.VR_MOMENTUM["gamma"],
        beta_3=0.0,
        epsilon=worker.VR_MOMENTUM["gsnr_epsilon"],
    )
    for samples in helpers.samples_per_update(stream, 1):
        expected = reference.update(samples)
    # (worker.VR_MOMENTUM's variance floor keeps the float32 error of the
    # raw GSNR, ~1e-7 * s / var, to 1e-4 of it.)
    got = _weights(worker_results[0], "momentum")
    ref.assert_all_close(got, expected, "VR-Momentum, 2 workers", rtol=8e-5, start=initial)


def test_two_workers_with_accumulation_match_four_replicas(strategy, worker_results):
    stream = worker.four_replica_stream()
    initial, single_process, _ = helpers.run_mirrored(
        strategy, lambda: tf_vrgd.VRAdam(**worker.VR_ADAM), stream
    )
    got = _weights(worker_results[0], "adam")
    label = "VR-Adam, 2 workers x 2 micro-steps"
    ref.assert_all_close(got, single_process, f"{label} vs 4 replicas", rtol=5e-5, start=initial)
    reference = ref.VRReference(
        initial, ref.adam(worker.VR_ADAM["learning_rate"]), worker.VR_ADAM["gamma"], beta_3=0.9
    )
    for samples in helpers.samples_per_update(stream, 1):
        expected = reference.update(samples)
    ref.assert_all_close(got, expected, label, rtol=5e-5, start=initial)


@pytest.mark.parametrize(
    "name, stream, steps",
    [
        ("noise_scale", worker.two_worker_stream(), 1),
        (
            "noise_scale_accumulation",
            worker.two_worker_micro_steps(worker.four_replica_stream()),
            2,
        ),
    ],
)
def test_two_workers_sum_the_noise_scale_terms_of_the_samples(worker_results, name, stream, steps):
    """`NoiseScale`'s sums on each worker (what `GSNRMonitor` turns into the
    logged noise scale): per variable, |mean of the k samples|^2 and the
    mean of their |sample|^2 over the updates (k = 2 workers, and 2 x 2
    micro-steps), against numpy."""
    expected = ref.noise_scale_sums(helpers.samples_per_update(stream, steps))
    for results in worker_results:
        ref.assert_close(results[f"{name}_sums"], expected, f"{name} sums, 2 workers", rtol=2e-5)


@pytest.mark.parametrize("name", worker.ROW_RUNS)
def test_two_workers_apply_rows_as_the_numpy_reference(worker_results, name):
    case, _, accumulation = worker.ROW_RUNS[name]
    stream = worker.row_stream(accumulation)
    initial = rows.initial_weights()
    expected = rows.reference(
        rows.CASES[case], initial, rows.dense_samples(stream, accumulation=accumulation)
    )
    label = f"{case} rows, 2 workers x {accumulation}"
    ref.assert_all_close(
        _weights(worker_results[0], name), expected, label, rtol=3e-4, start=initial
    )


@pytest.mark.parametrize("name", worker.ADASCALE_RUNS)
def test_two_workers_scale_the_rate_by_the_gain_of_the_samples(worker_results, name):
    """`AdaScale` on 2 workers (k = 2, and 2 x 2 micro-steps with S = 16):
    the gain, tau and the weights on each worker, against numpy."""
    accumulation = worker.ADASCALE_RUNS[name][1]
    stream = worker.adascale_stream(accumulation)
    if accumulation > 1:
        scale, decay, rule_at, rate = 16, 0.9, lambda r: ref.sgd(r, momentum=0.9), 0.05
    else:
        scale, decay, rule_at, rate = None, 0.5, ref.sgd, 0.1
    updates = helpers.samples_per_update(stream, accumulation)
    gains = ref.adascale_gains(updates, scale, decay)
    assert min(g for g, _ in gains) > 1.1  # the gain applied at every update
    initial = helpers.make_model().get_weights()
    expected = ref.adascale_weights(initial, updates, gains, rule_at, lambda step: rate)
    for results in worker_results:
        gain, tau = results[f"gain_and_tau_of_{name}"]
        np.testing.assert_allclose([gain, tau], [gains[-1][0], sum(g for g, _ in gains)], rtol=2e-5)
        label = f"AdaScale, 2 workers x {accumulation}"
        ref.assert_all_close(_weights(results, name), expected, label, rtol=6e-4, start=initial)
