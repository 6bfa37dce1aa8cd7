"""Model Garden is written for `tf.keras` being tf_keras: as the launcher
(`tf_vrgd.model_garden.train`) does, the tests here set
TF_USE_LEGACY_KERAS=1 before `tf.keras` is first read (TensorFlow reads the
variable then, not at its import). TensorFlow Recommenders (the DLRM
experiment) refuses to import without it; the package's faces are the same
either way."""

import os

os.environ.setdefault("TF_USE_LEGACY_KERAS", "1")
