"""Model Garden's training driver with the package's optimizers and
experiments registered:

    python -m tf_vrgd.model_garden.train --experiment=vrgd_regression \
        --config_file=configs/model_garden/regression_vr_lamb.yaml \
        --mode=train --model_dir=/tmp/run

(or `--experiment=vrgd_resnet_imagenet` / `vrgd_bert_pretraining` with a
file of `configs/paper/`, `tf_vrgd.model_garden.paper_experiments`; and
`vrgd_dlrm_criteo`, `tf_vrgd.model_garden.dlrm_experiment`, where
TensorFlow Recommenders is installed).

The flags are Model Garden's (`official.common.flags`); the run is
`official.core.train_lib.run_experiment`, as in Model Garden's
`official/vision/train.py`, without that driver's import of every vision
task. One flag is added: `--cpu_replicas=N` splits the CPU into N logical
devices and trains under `MirroredStrategy` over them (a machine without
GPUs: a VR optimizer needs k >= 2 gradient samples).

Model Garden is written for `tf.keras` being tf_keras (Keras 2): the
driver sets TF_USE_LEGACY_KERAS=1 unless it is set already. The package's
optimizers are tf_keras faces either way; TensorFlow Recommenders (the
DLRM experiment) refuses to import without it.
"""

import importlib.util
import os

from absl import app, flags

FLAGS = flags.FLAGS


def main(_):
    import tensorflow as tf

    if FLAGS.cpu_replicas:
        tf.config.set_logical_device_configuration(
            tf.config.list_physical_devices("CPU")[0],
            [tf.config.LogicalDeviceConfiguration()] * FLAGS.cpu_replicas,
        )
    import gin
    from official.common import distribute_utils
    from official.core import task_factory, train_lib, train_utils
    from official.modeling import performance

    import tf_vrgd.model_garden  # noqa: F401  (registers the optimizers)
    from tf_vrgd.model_garden import experiments, paper_experiments  # noqa: F401

    if importlib.util.find_spec("tensorflow_recommenders") is not None:
        from tf_vrgd.model_garden import dlrm_experiment  # noqa: F401

    gin.parse_config_files_and_bindings(FLAGS.gin_file, FLAGS.gin_params)
    params = train_utils.parse_configuration(FLAGS)
    if "train" in FLAGS.mode:
        train_utils.serialize_config(params, FLAGS.model_dir)
    if params.runtime.mixed_precision_dtype:
        performance.set_mixed_precision_policy(params.runtime.mixed_precision_dtype)
    if FLAGS.cpu_replicas:
        strategy = tf.distribute.MirroredStrategy([f"/cpu:{i}" for i in range(FLAGS.cpu_replicas)])
    else:
        strategy = distribute_utils.get_distribution_strategy(
            distribution_strategy=params.runtime.distribution_strategy,
            all_reduce_alg=params.runtime.all_reduce_alg,
            num_gpus=params.runtime.num_gpus,
            tpu_address=params.runtime.tpu,
        )
    with strategy.scope():
        task = task_factory.get_task(params.task, logging_dir=FLAGS.model_dir)
    train_lib.run_experiment(
        distribution_strategy=strategy,
        task=task,
        mode=FLAGS.mode,
        params=params,
        model_dir=FLAGS.model_dir,
    )


def run():
    os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
    from official.common import flags as tfm_flags

    tfm_flags.define_flags()
    flags.DEFINE_integer(
        "cpu_replicas", 0, "split the CPU into N logical devices and train on them (0: off)"
    )
    flags.mark_flags_as_required(["experiment", "mode", "model_dir"])
    app.run(main)


if __name__ == "__main__":
    run()
