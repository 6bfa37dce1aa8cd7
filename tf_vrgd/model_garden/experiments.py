"""Experiments registered in Model Garden's experiment factory.

`vrgd_regression`: a small multilayer perceptron fitted to a fixed random
linear-plus-noise target, on inputs made in memory (no files, no
download). It exists to check, in seconds and on CPUs, that an optimizer
of the package trains inside Model Garden's own trainer, writes its
checkpoints and resumes from them (`configs/model_garden/*.yaml`); it is
not one of the paper's tasks. Its `trainer.optimizer_config` is
`tf_vrgd.model_garden.OptimizationConfig`, which takes the VR types.
"""

import dataclasses

from official.core import base_task, config_definitions, exp_factory, task_factory
from official.modeling.hyperparams import base_config
import tensorflow as tf
import tf_keras

from tf_vrgd.model_garden.registration import OptimizationConfig


@dataclasses.dataclass
class RegressionModel(base_config.Config):
    """The MLP: `num_layers` ReLU layers of `hidden_size` units on
    `input_size` inputs, then one output; `seed` seeds its initialisers."""

    input_size: int = 16
    hidden_size: int = 32
    num_layers: int = 2
    seed: int = 1


@dataclasses.dataclass
class RegressionData(config_definitions.DataConfig):
    """The fixed data set: `examples` inputs x drawn from `seed`, read in
    order and repeated, and their targets x . w* plus Gaussian `noise` (w*
    the same for every data set)."""

    global_batch_size: int = 64
    examples: int = 1024
    seed: int = 0
    noise: float = 0.1


@dataclasses.dataclass
class RegressionTaskConfig(config_definitions.TaskConfig):
    model: RegressionModel = dataclasses.field(default_factory=RegressionModel)
    train_data: RegressionData = dataclasses.field(default_factory=RegressionData)
    validation_data: RegressionData = dataclasses.field(
        default_factory=lambda: RegressionData(is_training=False, seed=1)
    )


@task_factory.register_task_cls(RegressionTaskConfig)
class RegressionTask(base_task.Task):
    """Mean squared error of an MLP on y = x . w* + noise."""

    def build_model(self):
        model = self.task_config.model
        layers = [tf_keras.layers.Input((model.input_size,))]
        # Seeded, so that runs compare weight for weight.
        layers += [
            tf_keras.layers.Dense(
                model.hidden_size,
                activation="relu",
                kernel_initializer=tf_keras.initializers.GlorotUniform(seed=model.seed + i),
            )
            for i in range(model.num_layers)
        ]
        output = tf_keras.layers.Dense(
            1, kernel_initializer=tf_keras.initializers.GlorotUniform(seed=model.seed - 1)
        )
        return tf_keras.Sequential([*layers, output])

    def build_inputs(self, params, input_context=None):
        size = self.task_config.model.input_size
        generator = tf.random.Generator.from_seed(params.seed)
        x = generator.normal([params.examples, size])
        target = tf.random.Generator.from_seed(12345).normal([size, 1])
        y = x @ target + params.noise * generator.normal([params.examples, 1])
        batch = params.global_batch_size
        if input_context:
            batch = input_context.get_per_replica_batch_size(batch)
        dataset = tf.data.Dataset.from_tensor_slices((x, y)).repeat()
        dataset = dataset.batch(batch, drop_remainder=True)
        if input_context and input_context.num_input_pipelines > 1:
            # Pipeline i takes the i-th of each run of per-replica batches:
            # the batches MirroredStrategy hands its replicas in turn, so
            # that two workers see what two local replicas see.
            dataset = dataset.shard(
                input_context.num_input_pipelines, input_context.input_pipeline_id
            )
        return dataset

    def build_losses(self, labels, model_outputs, aux_losses=None):
        loss = tf.reduce_mean(tf.square(tf.cast(model_outputs, tf.float32) - labels))
        if aux_losses:
            loss += tf.add_n(aux_losses)
        return loss


@exp_factory.register_config_factory("vrgd_regression")
def regression_experiment():
    """The regression task with VR-LAMB, 20 steps; a config file sets the
    rest."""
    return config_definitions.ExperimentConfig(
        task=RegressionTaskConfig(),
        trainer=config_definitions.TrainerConfig(
            train_steps=20,
            steps_per_loop=5,
            summary_interval=5,
            checkpoint_interval=10,
            validation_interval=10,
            validation_steps=2,
            optimizer_config=OptimizationConfig(
                {
                    "optimizer": {"type": "vr_lamb"},
                    "learning_rate": {"type": "constant", "constant": {"learning_rate": 0.01}},
                }
            ),
        ),
    )
