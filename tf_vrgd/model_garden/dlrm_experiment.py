"""The paper's DLRM files (`configs/paper/dlrm_*.yaml`) as a Model Garden
experiment, `vrgd_dlrm_criteo`, on Model Garden's ranking task
(`official.recommendation.ranking`: TensorFlow Recommenders' `Ranking`
model, Model Garden's Criteo input pipeline).

Model Garden's own ranking task builds its optimizers inside `build_model`
(an SGD for the embedding tables and an Adam for the rest, each with the
schedule of its own `lr_config`) and trains through its own
`ranking/train.py`. This experiment's task keeps the model and the input
pipeline and takes the optimizer from `trainer.optimizer_config`, as Model
Garden's other tasks do: one optimizer (the files' VR-SGD or SGD) for the
tables and the MLPs, as `vrgd-train` trains the same file. It runs under
Model Garden's generic trainer (`official.core.train_lib.run_experiment`,
through `tf_vrgd.model_garden.train`).

The model's defaults are the package's DLRM (`vrgd-train`'s, NVIDIA's DLRM
on Criteo Terabyte: 128-wide embeddings, bottom MLP 512-256-128, top MLP
1024-1024-512-256-1), where Model Garden's `dlrm_criteo` has 8, 64-32-8 and
64-32-1. What differs from `vrgd-train` on the same file:

- the input is Model Garden's preprocessed Criteo TSV (integer features
  already log(1 + x), categories as integer ids below each table's size),
  where `vrgd-train` reads Criteo's raw lines (hexadecimal categories,
  hashed into the tables);
- the model is Model Garden's (a sigmoid output and the dot interaction's
  full matrix with its upper triangle zeroed, `skip_gather`), the same
  function as `vrgd-train`'s logit and Keras-RS's gathered triangle.

TensorFlow Recommenders needs `tf.keras` to be tf_keras: the environment
variable TF_USE_LEGACY_KERAS=1 before `tf.keras` is first read (the
launcher sets it). The tables of a TPU embedding engine are updated by
that engine's own optimizer, not by the experiment's, so a TPU strategy is
refused.
"""

import dataclasses

from official.core import base_task, config_definitions, exp_factory, task_factory
from official.recommendation.ranking import task as ranking_task
from official.recommendation.ranking.configs import config as ranking_config
import tensorflow as tf
import tensorflow_recommenders as tfrs
import tf_keras

from tf_vrgd.experiments import dlrm_task
from tf_vrgd.model_garden.registration import OptimizationConfig


@dataclasses.dataclass
class PaperRankingModel(ranking_config.ModelConfig):
    """Model Garden's ranking model config, plus the package's `type`
    field, with the package's DLRM sizes as defaults."""

    type: str = "dlrm"
    vocab_sizes: list[int] = dataclasses.field(
        default_factory=lambda: list(dlrm_task.CRITEO_VOCAB_SIZES)
    )
    embedding_dim: int = dlrm_task.EMBEDDING_DIM
    bottom_mlp: list[int] = dataclasses.field(default_factory=lambda: list(dlrm_task.BOTTOM_MLP))
    top_mlp: list[int] = dataclasses.field(default_factory=lambda: list(dlrm_task.TOP_MLP))


@dataclasses.dataclass
class PaperRankingTaskConfig(ranking_config.Task):
    model: PaperRankingModel = dataclasses.field(default_factory=PaperRankingModel)


@task_factory.register_task_cls(PaperRankingTaskConfig)
class PaperRankingTask(ranking_task.RankingTask):
    """Model Garden's ranking task (DLRM) trained by the experiment's
    optimizer, `trainer.optimizer_config`."""

    def __init__(self, params, logging_dir=None, name=None):
        if params.model.type != "dlrm":
            raise ValueError(
                "task.model.type must be 'dlrm' in this experiment. "
                f"Received: {params.model.type!r}"
            )
        if params.model.interaction != "dot":
            raise ValueError(
                "task.model.interaction must be 'dot' (DLRM) in this experiment. "
                f"Received: {params.model.interaction!r}"
            )
        if params.model.use_multi_hot:
            raise ValueError(
                "task.model.use_multi_hot is not supported here: the paper's DLRM reads "
                "one id per categorical feature."
            )
        # Model Garden's ranking task takes its trainer's config for its own
        # optimizers; this one builds none.
        base_task.Task.__init__(self, params, logging_dir=logging_dir, name=name)

    @classmethod
    def create_optimizer(cls, optimizer_config, runtime_config=None, dp_config=None):
        """The optimizer of `trainer.optimizer_config`, as Model Garden
        builds it for any task (its ranking task returns None here and
        builds two of its own in `build_model`)."""
        return base_task.Task.create_optimizer.__func__(
            cls, optimizer_config, runtime_config, dp_config
        )

    def build_model(self):
        """TensorFlow Recommenders' `Ranking` as Model Garden's ranking task
        builds it (its embedding tables, MLPs and dot interaction), with
        no optimizer inside, called once so that its variables exist before
        a checkpoint is restored."""
        strategy = tf.distribute.get_strategy()
        if isinstance(strategy, tf.distribute.TPUStrategy):
            raise ValueError(
                "vrgd_dlrm_criteo does not run under a TPU strategy: the TPU embedding "
                "engine updates the tables with its own optimizer, not the experiment's."
            )
        model_config = self.task_config.model
        feature_config, _ = ranking_task._get_tpu_embedding_feature_config(
            vocab_sizes=model_config.vocab_sizes, embedding_dim=model_config.embedding_dim
        )
        if model_config.use_partial_tpu_embedding:
            embedding = tfrs.experimental.layers.embedding.PartialTPUEmbedding(
                feature_config, optimizer=None, size_threshold=model_config.size_threshold
            )
        else:
            embedding = tfrs.layers.embedding.TPUEmbedding(feature_config, optimizer=None)
        model = tfrs.experimental.models.Ranking(
            embedding_layer=embedding,
            bottom_stack=tfrs.layers.blocks.MLP(model_config.bottom_mlp, final_activation="relu"),
            feature_interaction=tfrs.layers.feature_interaction.DotInteraction(skip_gather=True),
            top_stack=tfrs.layers.blocks.MLP(model_config.top_mlp, final_activation="sigmoid"),
            concat_dense=model_config.concat_dense,
        )
        # Two examples: the model squeezes each embedding's batch axis away.
        model(
            {
                "dense_features": tf.zeros([2, model_config.num_dense_features]),
                "sparse_features": {
                    str(i): tf.zeros([2], tf.int32) for i in range(len(model_config.vocab_sizes))
                },
            }
        )
        return model

    def train_step(self, inputs, model, optimizer, metrics=None):
        """TensorFlow Recommenders' step (the model's loss, already divided
        by the replicas, plus its regularisation), with `optimizer`: the
        trainer's, not one compiled into the model."""
        with tf.GradientTape() as tape:
            loss = model.compute_loss(inputs, training=True)
            total_loss = loss + tf.reduce_sum([tf.reduce_sum(x) for x in model.losses])
            scaled_loss = total_loss
            if isinstance(optimizer, tf_keras.mixed_precision.LossScaleOptimizer):
                scaled_loss = optimizer.get_scaled_loss(total_loss)
        variables = model.trainable_variables
        gradients = tape.gradient(scaled_loss, variables)
        if isinstance(optimizer, tf_keras.mixed_precision.LossScaleOptimizer):
            gradients = optimizer.get_unscaled_gradients(gradients)
        optimizer.apply_gradients(list(zip(gradients, variables)))
        logs = {metric.name: metric.result() for metric in metrics or []}
        logs[self.loss] = loss
        return logs


@exp_factory.register_config_factory("vrgd_dlrm_criteo")
def dlrm_criteo():
    """DLRM on Model Garden's preprocessed Criteo TSV files
    (`task.train_data.input_path`), with the VR optimizers; a paper config
    sets the batch, the steps and the optimization."""
    batch = 65536
    return config_definitions.ExperimentConfig(
        task=PaperRankingTaskConfig(
            train_data=ranking_config.DataConfig(is_training=True, global_batch_size=batch),
            validation_data=ranking_config.DataConfig(is_training=False, global_batch_size=batch),
        ),
        trainer=config_definitions.TrainerConfig(
            train_steps=ranking_config.NUM_TRAIN_EXAMPLES // batch,
            steps_per_loop=1000,
            summary_interval=1000,
            checkpoint_interval=1000,
            validation_interval=ranking_config.NUM_TRAIN_EXAMPLES // batch,
            validation_steps=ranking_config.NUM_EVAL_EXAMPLES // batch,
            optimizer_config=OptimizationConfig(
                {"optimizer": {"type": "vr_sgd"}, "learning_rate": {"type": "constant"}}
            ),
        ),
        restrictions=[
            "task.train_data.is_training != None",
            "task.validation_data.is_training != None",
        ],
    )
