"""The paper's DLRM files train through Model Garden's own trainer on its
ranking task (`tf_vrgd.model_garden.dlrm_experiment`), made small by
`--params_override`, on 2 logical CPU replicas, with VR-SGD over the
embedding tables (row-sparse gradients) and the MLPs."""

import os

import numpy as np
import pytest

pytest.importorskip("tf_keras")
pytest.importorskip("tensorflow_recommenders")
pytest.importorskip("official.recommendation")

from official.core import exp_factory, task_factory

from tests import helpers, task_data
from tf_vrgd.experiments import dlrm_task
from tf_vrgd.model_garden import dlrm_experiment

VOCAB = 40
TINY_DLRM = {
    "task.model.embedding_dim": 4,
    "task.model.vocab_sizes": "[" + ",".join([str(VOCAB)] * 26) + "]",
    "task.model.bottom_mlp": "[16,4]",
    "task.model.top_mlp": "[16,1]",
    "task.train_data.global_batch_size": 16,
    "trainer.steps_per_loop": 1,
    "trainer.summary_interval": 1,
    "trainer.checkpoint_interval": 2,
}


def _tiny_task():
    params = exp_factory.get_exp_config("vrgd_dlrm_criteo")
    params.override(
        {
            "task": {
                "model": {
                    "embedding_dim": 4,
                    "vocab_sizes": [VOCAB] * 26,
                    "bottom_mlp": [16, 4],
                    "top_mlp": [16, 1],
                }
            }
        },
        is_strict=True,
    )
    return task_factory.get_task(params.task)


def _restored(path):
    """(tables, other weights) of a model restored from the checkpoint at
    `path` through the object graph, as a Model Garden evaluation job
    restores it."""
    import tensorflow as tf

    model = _tiny_task().build_model()
    tf.train.Checkpoint(model=model).read(str(path)).expect_partial()
    tables = [v.numpy() for v in model.embedding_trainable_variables]
    return tables, [v.numpy() for v in model.dense_trainable_variables]


def test_the_dlrm_paper_config_trains_in_model_garden_and_resumes(tmp_path):
    data = tmp_path / "train.tsv"
    task_data.write_preprocessed_criteo(str(data), 256, VOCAB)
    config_file = os.path.join(task_data.PAPER, "dlrm_vr_sgd_64k.yaml")
    overrides = {**TINY_DLRM, "task.train_data.input_path": data, "trainer.train_steps": 4}
    output = helpers.model_garden_train(
        "vrgd_dlrm_criteo", config_file, tmp_path / "run", overrides
    )
    losses = helpers.model_garden_logs(output, "training_loss")
    assert len(losses) == 4 and np.all(np.isfinite(losses)), output[-2000:]
    # The file's schedule: linear warm-up over 8002 updates to the held
    # peak of 16 (`delayed_polynomial`).
    np.testing.assert_allclose(
        helpers.model_garden_logs(output, "learning_rate"),
        [16.0 * step / 8002 for step in (1, 2, 3, 4)],
        rtol=1e-5,
    )
    # Model Garden's controller writes after the first step, then every 2.
    first, last = _restored(tmp_path / "run" / "ckpt-1"), _restored(tmp_path / "run" / "ckpt-4")
    assert len(last[0]) == 26 and all(table.shape == (VOCAB, 4) for table in last[0])
    # Restored, not freshly initialised: each restored variable holds one of
    # the file's own tensors of its shape (the model's variables are saved
    # under the optimizer's object path too), and not a fresh model's values.
    saved = helpers.checkpoint_values(tmp_path / "run" / "ckpt-4")
    fresh = _tiny_task().build_model()
    fresh = [
        v.numpy() for v in fresh.embedding_trainable_variables + fresh.dense_trainable_variables
    ]
    for value, initial in zip(last[0] + last[1], fresh, strict=True):
        assert any(
            np.shape(tensor) == value.shape and np.array_equal(value, tensor)
            for tensor in saved.values()
        ), value.shape
        assert not np.array_equal(value, initial)
    # Every table and every MLP variable moved between updates 1 and 4:
    # one optimizer trains the tables (row-sparse) and the MLPs.
    for before, after in zip(first[0] + first[1], last[0] + last[1], strict=True):
        assert not np.array_equal(before, after)
    state = helpers.checkpoint_values(tmp_path / "run" / "ckpt-4")
    # The optimizer's state is in the checkpoint, at update 4.
    counters = [
        value
        for name, value in state.items()
        if name.startswith("optimizer/keras_optimizer/")
        and name.endswith("_iterations/.ATTRIBUTES/VARIABLE_VALUE")
    ]
    assert counters == [4]

    # Resumed for two more updates: it starts from ckpt-4 (the warm-up goes
    # on at update 5) and ends at 6.
    overrides["trainer.train_steps"] = 6
    output = helpers.model_garden_train(
        "vrgd_dlrm_criteo", config_file, tmp_path / "run", overrides
    )
    np.testing.assert_allclose(
        helpers.model_garden_logs(output, "learning_rate"),
        [16.0 * step / 8002 for step in (5, 6)],
        rtol=1e-5,
    )
    state = helpers.checkpoint_values(tmp_path / "run" / "ckpt-6")
    assert state["global_step/.ATTRIBUTES/VARIABLE_VALUE"] == 6


def _task(**model):
    params = exp_factory.get_exp_config("vrgd_dlrm_criteo")
    params.override({"task": {"model": model}}, is_strict=True)
    return task_factory.get_task(params.task)


def test_the_model_defaults_are_the_package_dlrm():
    model = exp_factory.get_exp_config("vrgd_dlrm_criteo").task.model
    assert list(model.vocab_sizes) == dlrm_task.CRITEO_VOCAB_SIZES
    assert model.embedding_dim == 128
    assert list(model.bottom_mlp) == [512, 256, 128]
    assert list(model.top_mlp) == [1024, 1024, 512, 256, 1]
    assert isinstance(_task(), dlrm_experiment.PaperRankingTask)


def test_what_the_experiment_cannot_train_is_refused_by_name():
    with pytest.raises(ValueError, match=r"task.model.type must be 'dlrm'.*'bert'"):
        _task(type="bert")
    with pytest.raises(ValueError, match=r"interaction must be 'dot'.*'cross'"):
        _task(interaction="cross")
    with pytest.raises(ValueError, match=r"use_multi_hot"):
        _task(use_multi_hot=True)
