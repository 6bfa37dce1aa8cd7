"""The paper's tasks, built from an experiment's `task` block (Model Garden
field names): the model, its loss and metrics, and its input pipelines,
from files in the formats the public tools write or, with `synthetic`,
from random tensors of the same shapes made on the device.

- `bert`: BERT pretraining, masked-LM and next-sentence heads on KerasHub's
  `BertBackbone`, reading the TFRecords of BERT's `create_pretraining_data`.
- `resnet`: ResNet-50 v1.5 on ImageNet TFRecords (`image/encoded`,
  `image/class/label`), or ResNet-56 (`resnet.model_id: 56`) on CIFAR-10's
  binary or python batches.
- `dlrm`: DLRM (bottom MLP, embedding tables, dot interaction from Keras-RS,
  top MLP) on Criteo's TSV lines.

Every task returns its datasets batched by the per-step (global) batch,
repeating without end; `vrgd-train` sizes the steps. Each task has its
module (`bert_task`, `image_task`, `dlrm_task`) implementing `task.Task`;
`records` reads their files.
"""

from tf_vrgd.experiments.bert_task import BertPretraining
from tf_vrgd.experiments.dlrm_task import Dlrm
from tf_vrgd.experiments.experiment_config import lookup
from tf_vrgd.experiments.image_task import ImageClassification

TASKS = {"bert": BertPretraining, "resnet": ImageClassification, "dlrm": Dlrm}

# Overrides that shrink each task's model (the layer structure kept) to one
# that builds and steps in about a second on a CPU: for checks of the code
# paths (the tests, `scripts/check_paper_configs.py`, the device check's
# dry run), not for training. `resnet` takes the CIFAR ResNet-8, on CIFAR's
# images and classes whatever the config's.
TINY_SIZES = {
    "bert": {
        "task.model.encoder.bert.num_layers": 2,
        "task.model.encoder.bert.hidden_size": 32,
        "task.model.encoder.bert.num_attention_heads": 2,
        "task.model.encoder.bert.intermediate_size": 64,
        "task.model.encoder.bert.vocab_size": 200,
        "task.train_data.seq_length": 16,
        "task.train_data.max_predictions_per_seq": 4,
    },
    "dlrm": {
        "task.model.embedding_dim": 4,
        "task.model.vocab_sizes": [40] * 26,
        "task.model.bottom_mlp": [16, 4],
        "task.model.top_mlp": [16, 1],
    },
    "resnet": {
        "task.model.resnet.model_id": 8,
        "task.model.input_size": [32, 32, 3],
        "task.model.num_classes": 10,
    },
}


def from_config(cfg):
    """The task of an experiment, by `task.model.type`."""
    kind = lookup(cfg, "task.model.type")
    if kind not in TASKS:
        raise ValueError(
            f"task.model.type must be one of {sorted(TASKS)} or fashion_mnist_cnn. "
            f"Received: {kind!r}"
        )
    return TASKS[kind](cfg)
