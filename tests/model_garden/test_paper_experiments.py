"""The files of `configs/paper/` train through Model Garden's own trainer
and task definitions (`tf_vrgd.model_garden.paper_experiments`), made
small by `--params_override` (the model's size, the data's files, the
steps), on 2 logical CPU replicas: ImageNet ResNet with VR-LARS and with
LARC around momentum, BERT pretraining's two phases with VR-LAMB (the
second with gradient accumulation)."""

import math
import os

import numpy as np
import pytest

pytest.importorskip("tf_keras")
pytest.importorskip("official.vision")
pytest.importorskip("official.nlp")

from official.core import exp_factory, task_factory

from tests import helpers, task_data
from tf_vrgd.model_garden import paper_experiments

IMAGENET = os.path.join(task_data.PAPER, "imagenet_resnet50_vr_lars_32k.yaml")
TINY_RESNET = {
    "task.model.resnet.model_id": 10,
    "task.model.input_size": "[32,32,3]",
    "task.model.num_classes": 10,
    "task.train_data.global_batch_size": 8,
    "trainer.steps_per_loop": 1,
    "trainer.summary_interval": 1,
    "trainer.checkpoint_interval": 2,
}
LARC_MOMENTUM = {
    "trainer.optimizer_config.optimizer.type": "larc",
    "trainer.optimizer_config.optimizer.larc.optimizer.type": "sgd",
    "trainer.optimizer_config.optimizer.larc.optimizer.sgd.momentum": 0.9,
}
TINY_BERT = {
    **{key: value for key, value in task_data.TINY_BERT.items() if "global_batch" not in key},
    "task.model.cls_heads": "[{inner_dim: 32, num_classes: 2, name: next_sentence}]",
    "task.train_data.global_batch_size": 8,
    "trainer.steps_per_loop": 2,
    "trainer.summary_interval": 2,
    "trainer.checkpoint_interval": 2,
}


def _optimizer_steps(model_dir, step):
    """The twin's step counter in the checkpoint (Keras 3 counts micro-steps
    there; its `iterations`, the update count the schedules read, is that
    count // gradient_accumulation_steps), and the checkpoint."""
    state = helpers.checkpoint_values(os.path.join(model_dir, f"ckpt-{step}"))
    counts = [
        value
        for name, value in state.items()
        if name.startswith("optimizer/keras_optimizer/")
        and name.endswith("_iterations/.ATTRIBUTES/VARIABLE_VALUE")
    ]
    return max(counts), state


@pytest.mark.parametrize("optimizer", ["vr_lars", "larc_momentum"])
def test_the_imagenet_paper_config_trains_in_model_garden(optimizer, tmp_path):
    records = tmp_path / "train-00000-of-00001"
    task_data.write_imagenet_records(str(records), 32, num_classes=10)
    overrides = {**TINY_RESNET, "task.train_data.input_path": records, "trainer.train_steps": 2}
    if optimizer == "larc_momentum":
        overrides.update(LARC_MOMENTUM)
    output = helpers.model_garden_train(
        "vrgd_resnet_imagenet", IMAGENET, tmp_path / "run", overrides
    )
    losses = helpers.model_garden_logs(output, "training_loss")
    assert len(losses) == 2 and np.all(np.isfinite(losses)), output[-2000:]
    # The file's schedule at steps 1 and 2: linear warm-up over 547 steps to
    # the cosine decay's value there (28, over 3519 steps).
    peak = 28.0 * 0.5 * (1 + math.cos(math.pi * 547 / 3519))
    np.testing.assert_allclose(
        helpers.model_garden_logs(output, "learning_rate"),
        [peak * 1 / 547, peak * 2 / 547],
        rtol=1e-5,
    )
    steps, state = _optimizer_steps(tmp_path / "run", 2)
    assert steps == 2
    kernels = [name for name in state if not name.startswith("optimizer/") and "kernel" in name]
    # ResNet-10 (task.model.resnet.model_id, not the experiment's 50): the
    # stem, 4 stages of one block of 2 convolutions with a projection
    # shortcut each, and the classifier.
    assert len(kernels) == 1 + 4 * (2 + 1) + 1, kernels


@pytest.mark.parametrize("phase", [1, 2])
def test_the_bert_paper_configs_train_in_model_garden(phase, tmp_path):
    records = tmp_path / "bert-00000"
    task_data.write_bert_records(str(records), 64, 16, 4, 200)
    # Phase 2 accumulates 8 micro-steps an update: Model Garden's
    # `train_steps` counts micro-steps (its trainer's step is one
    # `train_step` call), so 16 of them are 2 updates.
    overrides = {**TINY_BERT, "task.train_data.input_path": records, "trainer.train_steps": 16}
    output = helpers.model_garden_train(
        "vrgd_bert_pretraining",
        os.path.join(task_data.PAPER, f"bert_large_vr_lamb_64k_phase{phase}.yaml"),
        tmp_path / "run",
        overrides,
    )
    losses = helpers.model_garden_logs(output, "lm_example_loss")
    assert len(losses) == 8 and np.all(np.isfinite(losses)), output[-2000:]
    steps, _ = _optimizer_steps(tmp_path / "run", 16)
    assert steps == 16
    # The logged rate, read at the update count (Model Garden logs the
    # schedule at `optimizer.iterations`, the face's updates): the file's
    # linear warm-up to its polynomial decay's value at the warm-up's end.
    peak, warmup, decay, accumulation = {1: (0.007, 2000, 7038, 1), 2: (0.0055, 200, 782, 8)}[phase]
    updates = [step // accumulation for step in range(2, 17, 2)]
    np.testing.assert_allclose(
        helpers.model_garden_logs(output, "learning_rate"),
        [peak * (1 - warmup / decay) * u / warmup for u in updates],
        rtol=1e-5,
        atol=1e-12,
    )
    # Checkpoints every 2 micro-steps: phase 2 (A = 8) changes the weights
    # at micro-steps 8 and 16 only, phase 1 at each.
    weights = {step: _weights(tmp_path / "run", step) for step in (10, 14, 16)}
    assert _changed(weights[10], weights[14]) == (phase == 1)
    assert _changed(weights[14], weights[16])


def _weights(model_dir, step):
    state = helpers.checkpoint_values(os.path.join(model_dir, f"ckpt-{step}"))
    return {
        name: value
        for name, value in state.items()
        if not name.startswith(("optimizer/", "global_step", "save_counter", "_CHECKPOINTABLE"))
    }


def _changed(before, after):
    assert before.keys() == after.keys() and len(before) > 10
    return any(not np.array_equal(before[name], after[name]) for name in before)


def _task(experiment, **model):
    params = exp_factory.get_exp_config(experiment)
    params.override({"task": {"model": model}}, is_strict=True)
    return task_factory.get_task(params.task)


def test_the_resnet_depth_is_read_from_the_package_field():
    task = _task(
        "vrgd_resnet_imagenet", resnet={"model_id": 18}, input_size=[32, 32, 3], num_classes=10
    )
    assert task.task_config.model.backbone.resnet.model_id == 18
    model = task.build_model()
    assert model.backbone.get_config()["model_id"] == 18


def test_a_model_the_experiment_cannot_build_is_refused_by_name():
    with pytest.raises(ValueError, match=r"model_id 56 .*vrgd-train"):
        _task("vrgd_resnet_imagenet", resnet={"model_id": 56})
    with pytest.raises(ValueError, match=r"task.model.type must be 'resnet'.*'bert'"):
        _task("vrgd_resnet_imagenet", type="bert")
    with pytest.raises(ValueError, match=r"task.model.type must be 'bert'.*'dlrm'"):
        _task("vrgd_bert_pretraining", type="dlrm")


def test_the_experiments_keep_the_paper_conventions():
    image = exp_factory.get_exp_config("vrgd_resnet_imagenet")
    assert image.task.losses.l2_weight_decay == 0.0
    bert = exp_factory.get_exp_config("vrgd_bert_pretraining")
    assert bert.task.scale_loss is True
    assert isinstance(bert.task, paper_experiments.PaperMaskedLMConfig)
