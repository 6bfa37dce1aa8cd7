"""Model Garden's own trainer (`official.core.train_lib.run_experiment`,
through `python -m tf_vrgd.model_garden.train`) trains the package's
experiment from the config files in `configs/model_garden/` on 2 logical
CPU replicas, with VR-LAMB and with LARC around VR-Momentum, writes
checkpoints holding the optimizer's state, and resumes from them to the
weights (and optimizer state) of an uninterrupted run."""

import functools
import os
import subprocess
import sys

import numpy as np
import pytest
import tensorflow as tf

pytest.importorskip("tf_keras")
pytest.importorskip("official")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIGS = {
    name: os.path.join(ROOT, "configs", "model_garden", f"regression_{name}.yaml")
    for name in ("vr_lamb", "larc_momentum")
}


def _train(config, model_dir, steps):
    command = [
        sys.executable,
        "-m",
        "tf_vrgd.model_garden.train",
        "--experiment=vrgd_regression",
        f"--config_file={config}",
        "--mode=train",
        f"--model_dir={model_dir}",
        "--cpu_replicas=2",
        # One batch of examples, repeated: Model Garden's checkpoints do not
        # hold the input's position, so a resumed run reads from the start.
        f"--params_override=trainer.train_steps={steps},task.train_data.examples=64",
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return done.stdout + done.stderr


def _losses(output):
    return [
        float(line.split("'training_loss': np.float32(")[1].split(")")[0])
        for line in output.splitlines()
        if line.startswith("train | step:") and "training_loss" in line
    ]


def _checkpoint(model_dir, step):
    reader = tf.train.load_checkpoint(os.path.join(model_dir, f"ckpt-{step}"))
    return {name: reader.get_tensor(name) for name in reader.get_variable_to_shape_map()}


@pytest.mark.parametrize("name", CONFIGS)
def test_model_garden_trains_checkpoints_and_resumes(name, tmp_path):
    train = functools.partial(_train, CONFIGS[name])
    uninterrupted = tmp_path / "uninterrupted"
    losses = _losses(train(uninterrupted, 30))
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
