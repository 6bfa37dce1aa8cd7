"""Model Garden's own trainer (`official.core.train_lib.run_experiment`,
through `python -m tf_vrgd.model_garden.train`) trains the package's
experiment from the config files in `configs/model_garden/` on 2 logical
CPU replicas, with VR-LAMB and with LARC around VR-Momentum, writes
checkpoints holding the optimizer's state, and resumes from them to the
weights (and optimizer state) of an uninterrupted run."""

import functools
import json
import os
import subprocess

import numpy as np
import pytest

pytest.importorskip("tf_keras")
pytest.importorskip("official")

from tests import helpers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = {
    name: os.path.join(ROOT, "configs", "model_garden", f"regression_{name}.yaml")
    for name in ("vr_lamb", "larc_momentum")
}


def _train(config, model_dir, steps, **options):
    # One batch of examples, repeated: Model Garden's checkpoints do not
    # hold the input's position, so a resumed run reads from the start.
    overrides = {"trainer.train_steps": steps, "task.train_data.examples": 64}
    overrides.update(options.pop("overrides", {}))
    return helpers.model_garden_train("vrgd_regression", config, model_dir, overrides, **options)


def _checkpoint(model_dir, step):
    return helpers.checkpoint_values(os.path.join(model_dir, f"ckpt-{step}"))


@pytest.mark.parametrize("name", CONFIGS)
def test_model_garden_trains_checkpoints_and_resumes(name, tmp_path):
    train = functools.partial(_train, CONFIGS[name])
    uninterrupted = tmp_path / "uninterrupted"
    losses = helpers.model_garden_logs(train(uninterrupted, 30), "training_loss")
    assert len(losses) == 6 and losses[-1] < 0.7 * losses[0], losses
    interrupted = tmp_path / "interrupted"
    train(interrupted, 20)
    state = _checkpoint(interrupted, 20)
    optimizer = {k: v for k, v in state.items() if k.startswith("optimizer/keras_optimizer/")}
    # The update count and a slot per variable at least (VR-LAMB: m, v and
    # the GSNR momentum of each of the 6 variables; VR-Momentum: momentum).
    counts = [
        v for k, v in optimizer.items() if k.endswith("_iterations/.ATTRIBUTES/VARIABLE_VALUE")
    ]
    # (Keras 3's LARC keeps a counter of its own, unused, beside its inner
    # optimizer's.)
    assert max(counts) == 20, sorted(optimizer)
    assert len(optimizer) >= 1 + 6, sorted(optimizer)
    train(interrupted, 30)
    resumed, expected = _checkpoint(interrupted, 30), _checkpoint(uninterrupted, 30)
    assert resumed.keys() == expected.keys()
    for name, value in expected.items():
        if name.startswith(("model/", "optimizer/")):
            np.testing.assert_allclose(resumed[name], value, rtol=1e-5, atol=1e-6, err_msg=name)


def test_model_garden_trains_on_two_workers_as_on_two_replicas(tmp_path):
    """`MultiWorkerMirroredStrategy` over two local worker processes (one
    CPU replica each): the VR-LAMB run ends at the weights and optimizer
    state of one process with two replicas fed the same batches."""
    config = CONFIGS["vr_lamb"]
    _train(config, tmp_path / "mirrored", 10)
    cluster = {"worker": [f"127.0.0.1:{port}" for port in helpers.free_ports(2)]}
    runs = []
    for index in range(2):
        tf_config = {"cluster": cluster, "task": {"type": "worker", "index": index}}
        runs.append(
            subprocess.Popen(
                helpers.model_garden_command(
                    "vrgd_regression",
                    config,
                    tmp_path / f"worker{index}",
                    {
                        "trainer.train_steps": 10,
                        "task.train_data.examples": 64,
                        "runtime.distribution_strategy": "multi_worker_mirrored",
                    },
                    cpu_replicas=0,
                ),
                env=helpers.model_garden_env(TF_CONFIG=json.dumps(tf_config)),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outputs = [run.communicate(timeout=600)[0] for run in runs]
    assert [run.returncode for run in runs] == [0, 0], "\n".join(o[-3000:] for o in outputs)
    # The chief writes the checkpoints.
    workers, mirrored = (
        _checkpoint(tmp_path / "worker0", 10),
        _checkpoint(tmp_path / "mirrored", 10),
    )
    compared = sorted(name for name in mirrored if name.startswith(("model/", "optimizer/")))
    assert compared == sorted(n for n in workers if n.startswith(("model/", "optimizer/")))
    # The update count and VR-LAMB's m, v and GSNR momentum of 6 variables.
    assert len([name for name in compared if name.startswith("optimizer/")]) >= 1 + 3 * 6
    for name in compared:
        np.testing.assert_allclose(
            workers[name], mirrored[name], rtol=1e-5, atol=1e-6, err_msg=name
        )
