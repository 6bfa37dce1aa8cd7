"""`tf_vrgd.Adam`: Keras Adam whose gradient accumulation runs under
`tf.distribute` strategies."""

import keras

from tf_vrgd._accumulation import ReplicaAccumulationMixin


@keras.saving.register_keras_serializable(package="tf_vrgd")
class Adam(ReplicaAccumulationMixin, keras.optimizers.Adam):
    """`keras.optimizers.Adam` whose `gradient_accumulation_steps` also runs
    under MirroredStrategy (the `adam` type of `tf_vrgd.config`)."""
