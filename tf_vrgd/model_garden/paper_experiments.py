"""The paper's tasks as Model Garden experiments, on Model Garden's own
task definitions, reading the files of `configs/paper/` as they are.

- `vrgd_resnet_imagenet`: Model Garden's image classification task
  (`official.vision`, ImageNet TFRecords, its ResNet backbone) for the
  `imagenet_resnet50_*.yaml` files.
- `vrgd_bert_pretraining`: Model Garden's masked-LM task
  (`official.nlp`, BERT pretraining TFRecords, its BERT encoder) for the
  `bert_large_*.yaml` files.

The package's configs name the model by `task.model.type` (one file
format for the four tasks), with `task.model.resnet` for the ResNet's
fields where Model Garden's classification model has
`task.model.backbone.resnet`. Each experiment's model config takes those
fields too; the ResNet task builds its backbone from `task.model.resnet`
(`task.model.backbone` is not read). What differs from Model Garden's own
experiments of the same tasks, so that a file means what it means under
`vrgd-train`:

- `trainer.optimizer_config` is `tf_vrgd.model_garden.OptimizationConfig`
  (the VR types and `larc`);
- the ResNet's weight decay is the optimizer's (`losses.l2_weight_decay`
  is 0; Model Garden's ResNet experiment puts 1e-4 in the loss);
- the masked-LM loss is divided by the replicas before the gradient
  (`scale_loss: true`): the summed gradient is the mean over the global
  batch, as the paper's rules are written (Model Garden's default sums
  the replicas' means, which scales an SGD step with the replicas).

CIFAR-10's ResNet-56 is not a Model Garden model (its ResNet has no CIFAR
depth): those files train with `vrgd-train`. DLRM is in `dlrm_experiment`
(TensorFlow Recommenders needs tf_keras as `tf.keras`).
"""

import dataclasses

from official.core import config_definitions, exp_factory, task_factory
from official.nlp.configs import bert as bert_configs
from official.nlp.data import pretrain_dataloader
from official.nlp.tasks import masked_lm
from official.vision.configs import backbones
from official.vision.configs import image_classification as image_configs
from official.vision.modeling.backbones import resnet as resnet_backbone
from official.vision.tasks import image_classification

from tf_vrgd.model_garden.registration import OptimizationConfig

# Model Garden's ImageNet TFRecords: 1,281,167 training images.
_IMAGENET_TRAIN_EXAMPLES = 1_281_167


def _check_type(model, expected):
    if model.type != expected:
        raise ValueError(
            f"task.model.type must be {expected!r} in this experiment. Received: {model.type!r}"
        )


@dataclasses.dataclass
class PaperImageModel(image_configs.ImageClassificationModel):
    """Model Garden's classification model, plus the package's `type` and
    `resnet` fields (the backbone is built from `resnet`)."""

    type: str = "resnet"
    resnet: backbones.ResNet = dataclasses.field(
        default_factory=lambda: backbones.ResNet(model_id=50)
    )


@dataclasses.dataclass
class PaperImageTaskConfig(image_configs.ImageClassificationTask):
    model: PaperImageModel = dataclasses.field(
        default_factory=lambda: PaperImageModel(num_classes=1001, input_size=[224, 224, 3])
    )


@task_factory.register_task_cls(PaperImageTaskConfig)
class PaperImageTask(image_classification.ImageClassificationTask):
    """Model Garden's image classification with the backbone named by
    `task.model.resnet`."""

    def __init__(self, params, logging_dir=None, name=None):
        _check_type(params.model, "resnet")
        model_id = params.model.resnet.model_id
        if model_id not in resnet_backbone.RESNET_SPECS:
            raise ValueError(
                f"task.model.resnet.model_id {model_id} is not a depth of Model Garden's "
                f"ResNet ({sorted(resnet_backbone.RESNET_SPECS)}); the CIFAR ResNets "
                "(6n + 2) train with vrgd-train."
            )
        backbone = {"type": "resnet", "resnet": params.model.resnet.as_dict()}
        super().__init__(
            params.replace(model={"backbone": backbone}), logging_dir=logging_dir, name=name
        )


@exp_factory.register_config_factory("vrgd_resnet_imagenet")
def resnet_imagenet():
    """ResNet-50 on ImageNet TFRecords (`task.train_data.input_path`),
    with the VR optimizers; a paper config sets the batch, the steps and
    the optimization."""
    batch = 4096
    steps_per_epoch = _IMAGENET_TRAIN_EXAMPLES // batch
    return config_definitions.ExperimentConfig(
        task=PaperImageTaskConfig(
            losses=image_configs.Losses(l2_weight_decay=0.0),
            train_data=image_configs.DataConfig(is_training=True, global_batch_size=batch),
            validation_data=image_configs.DataConfig(is_training=False, global_batch_size=batch),
        ),
        trainer=config_definitions.TrainerConfig(
            train_steps=90 * steps_per_epoch,
            steps_per_loop=100,
            summary_interval=100,
            checkpoint_interval=steps_per_epoch,
            validation_interval=steps_per_epoch,
            optimizer_config=OptimizationConfig(
                {"optimizer": {"type": "vr_lars"}, "learning_rate": {"type": "constant"}}
            ),
        ),
        restrictions=[
            "task.train_data.is_training != None",
            "task.validation_data.is_training != None",
        ],
    )


@dataclasses.dataclass
class PaperBertModel(bert_configs.PretrainerConfig):
    """Model Garden's BERT pretrainer, plus the package's `type` field."""

    type: str = "bert"


@dataclasses.dataclass
class PaperMaskedLMConfig(masked_lm.MaskedLMConfig):
    model: PaperBertModel = dataclasses.field(
        default_factory=lambda: PaperBertModel(
            cls_heads=[
                bert_configs.ClsHeadConfig(
                    inner_dim=768, num_classes=2, dropout_rate=0.1, name="next_sentence"
                )
            ]
        )
    )
    scale_loss: bool = True


@task_factory.register_task_cls(PaperMaskedLMConfig)
class PaperMaskedLMTask(masked_lm.MaskedLMTask):
    """Model Garden's masked-LM and next-sentence pretraining."""

    def __init__(self, params, logging_dir=None, name=None):
        _check_type(params.model, "bert")
        super().__init__(params, logging_dir=logging_dir, name=name)


@exp_factory.register_config_factory("vrgd_bert_pretraining")
def bert_pretraining():
    """BERT pretraining on `create_pretraining_data` TFRecords
    (`task.train_data.input_path`), with the VR optimizers; a paper config
    sets the model's size, the batch, the sequence and the optimization."""
    return config_definitions.ExperimentConfig(
        task=PaperMaskedLMConfig(
            train_data=pretrain_dataloader.BertPretrainDataConfig(),
            validation_data=pretrain_dataloader.BertPretrainDataConfig(is_training=False),
        ),
        trainer=config_definitions.TrainerConfig(
            steps_per_loop=100,
            summary_interval=100,
            checkpoint_interval=1000,
            optimizer_config=OptimizationConfig(
                {"optimizer": {"type": "vr_lamb"}, "learning_rate": {"type": "constant"}}
            ),
        ),
        restrictions=[
            "task.train_data.is_training != None",
            "task.validation_data.is_training != None",
        ],
    )
