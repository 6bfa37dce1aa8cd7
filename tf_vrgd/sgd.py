"""`tf_vrgd.SGD`: Keras SGD whose gradient accumulation runs under
`tf.distribute` strategies."""

import keras

from tf_vrgd._accumulation import ReplicaAccumulationMixin


@keras.saving.register_keras_serializable(package="tf_vrgd")
class SGD(ReplicaAccumulationMixin, keras.optimizers.SGD):
    """`keras.optimizers.SGD` whose `gradient_accumulation_steps` also runs
    under MirroredStrategy (the `sgd` type of `tf_vrgd.config`)."""
