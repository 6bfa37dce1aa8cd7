"""Fashion-MNIST, offline: built by tensorflow-datasets from local IDX files.

The Debian package `dataset-fashion-mnist` installs the four IDX .gz files
under `/usr/share/datasets/fashion-mnist/`. Those files were recompressed,
so their .gz checksums differ from the ones tensorflow-datasets registered;
the builder records their checksums in its own cache instead, and the
decoded content is verified (60000/10000 examples, 28x28x1 uint8 images,
labels 0-9, every class equally frequent) before anything trains on it.
"""

import gzip
import os
import shutil
import struct
import zlib

import numpy as np
import tensorflow as tf

DEFAULT_DATA_DIR = "/usr/share/datasets/fashion-mnist"
IDX_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
EXPECTED_EXAMPLES = {"train": 60000, "test": 10000}
NUM_CLASSES = 10
# Where the builder records the checksums of the local files, in the cache.
CHECKSUMS_FILE = "fashion_mnist_local_checksums.tsv"


def default_cache_dir():
    """Where the prepared dataset is kept (`TFDS_DATA_DIR` if set)."""
    return os.environ.get(
        "TFDS_DATA_DIR",
        os.path.join(os.path.expanduser("~"), ".cache", "tf_vrgd", "tensorflow_datasets"),
    )


def check_idx_files(data_dir):
    """Raises FileNotFoundError, saying how to get them, if any file is missing."""
    missing = [f for f in IDX_FILES if not os.path.isfile(os.path.join(data_dir, f))]
    if missing:
        raise FileNotFoundError(
            f"Fashion-MNIST files missing from {data_dir}: {missing}. Install them "
            "with `sudo apt-get install dataset-fashion-mnist` (Debian/Ubuntu; they "
            f"go to {DEFAULT_DATA_DIR}), or pass --data-dir with a folder holding "
            f"the four IDX files {list(IDX_FILES)}."
        )


def check_idx_file(path):
    """Raises ValueError naming `path` unless it is a readable gzip holding
    an IDX file (uint8 data, a big-endian header of dimensions) whose data
    has exactly the bytes its header promises."""
    try:
        with gzip.open(path, "rb") as f:
            content = f.read()
    except (OSError, EOFError, zlib.error) as error:
        raise ValueError(f"{path}: not a readable gzip file ({error}).") from None
    if len(content) < 4 or content[:3] != b"\x00\x00\x08" or not 1 <= content[3] <= 4:
        raise ValueError(f"{path}: not an IDX file of uint8 data (header {content[:4]!r}).")
    ndim = content[3]
    header = 4 + 4 * ndim
    if len(content) < header:
        raise ValueError(f"{path}: truncated IDX header.")
    dims = struct.unpack(f">{ndim}I", content[4:header])
    expected = int(np.prod(dims))
    if len(content) - header != expected:
        raise ValueError(
            f"{path}: the header promises {dims} = {expected} bytes of data, the file "
            f"holds {len(content) - header} (truncated or corrupt; reinstall it with "
            "`apt-get install --reinstall dataset-fashion-mnist`)."
        )


def _builder_class():
    import tensorflow_datasets as tfds

    class LocalFashionMNIST(tfds.image_classification.FashionMNIST, skip_registration=True):
        """tfds' Fashion-MNIST builder reading the IDX files from `manual_dir`,
        recording their checksums in the dataset cache instead of checking
        them against tfds' registered ones (see the module docstring)."""

        name = "fashion_mnist"

        @classmethod
        def _checksums_file(cls, cache_dir):
            path = os.path.join(cache_dir, CHECKSUMS_FILE)
            os.makedirs(cache_dir, exist_ok=True)
            open(path, "a").close()
            return path

    return LocalFashionMNIST


def prepare(data_dir=None, cache_dir=None):
    """Builds the tfds dataset once (later calls reuse it); returns the builder."""
    from etils import epath
    import tensorflow_datasets as tfds

    data_dir = data_dir or DEFAULT_DATA_DIR
    cache_dir = cache_dir or default_cache_dir()
    check_idx_files(data_dir)
    cls = _builder_class()
    builder = cls(data_dir=cache_dir)
    if not builder.is_prepared():
        # Checked here, so that tensorflow-datasets never records the
        # checksums of a bad file nor prepares a dataset from it.
        for name in IDX_FILES:
            check_idx_file(os.path.join(data_dir, name))
        print(
            f"Preparing Fashion-MNIST from {data_dir} into {cache_dir} "
            "(tensorflow-datasets, once)...",
            flush=True,
        )
        tfds.disable_progress_bar()
        # tfds writes the recorded checksums to the builder's `_checksums_path`;
        # they are recorded afresh at each preparation.
        checksums = cls._checksums_file(cache_dir)
        open(checksums, "w").close()
        cls._checksums_path = epath.Path(checksums)
        try:
            builder.download_and_prepare(
                download_config=tfds.download.DownloadConfig(
                    manual_dir=data_dir, register_checksums=True
                )
            )
        except BaseException:
            discard(builder)
            raise
    return builder


def discard(builder):
    """Removes a prepared (or partly prepared) dataset and its recorded
    checksums, so that the next run prepares it anew."""
    shutil.rmtree(builder.data_dir, ignore_errors=True)
    checksums = os.path.join(os.path.dirname(os.path.dirname(builder.data_dir)), CHECKSUMS_FILE)
    if os.path.exists(checksums):
        os.remove(checksums)


def verify(images, labels, split):
    """Checks decoded content: counts, shapes, dtype, labels, class balance."""
    expected = EXPECTED_EXAMPLES[split]
    problems = []
    if images.shape != (expected, 28, 28, 1) or images.dtype != np.uint8:
        problems.append(
            f"images {images.shape} {images.dtype}, expected ({expected}, 28, 28, 1) uint8"
        )
    counts = np.bincount(labels.astype(np.int64), minlength=NUM_CLASSES)
    if labels.shape != (expected,) or len(counts) != NUM_CLASSES:
        problems.append(f"labels {labels.shape} with values up to {labels.max()}")
    elif not np.all(counts == expected // NUM_CLASSES):
        problems.append(f"class counts {counts.tolist()}, expected {expected // NUM_CLASSES} each")
    if images.max() == 0:
        problems.append("all images are blank")
    if problems:
        raise ValueError(f"Fashion-MNIST {split} split failed verification: " + "; ".join(problems))


def load(data_dir=None, cache_dir=None):
    """((x_train, y_train), (x_test, y_test)) as uint8 images [N, 28, 28, 1]
    and int64 labels, verified.

    The decoded, verified arrays are also kept beside the prepared dataset
    (`fashion_mnist_arrays.npz`), so later runs skip decoding.
    """
    import tensorflow_datasets as tfds

    builder = prepare(data_dir, cache_dir)
    cached = os.path.join(builder.data_dir, "fashion_mnist_arrays.npz")
    if os.path.exists(cached):
        with np.load(cached) as f:
            return (f["x_train"], f["y_train"]), (f["x_test"], f["y_test"])
    arrays = {}
    for split in ("train", "test"):
        ds = builder.as_dataset(split=split, batch_size=-1, as_supervised=True)
        images, labels = tfds.as_numpy(ds)
        try:
            verify(images, labels, split)
        except ValueError:
            discard(builder)  # not to be reused by a later run with good files
            raise
        arrays[split] = (images, labels)
    tmp = f"{cached}.tmp{os.getpid()}.npz"
    np.savez(
        tmp,
        x_train=arrays["train"][0],
        y_train=arrays["train"][1],
        x_test=arrays["test"][0],
        y_test=arrays["test"][1],
    )
    os.replace(tmp, cached)
    return arrays["train"], arrays["test"]


def dataset(
    images, labels, global_batch_size, seed=None, epochs=None, initial_epoch=0, drop_remainder=True
):
    """A `tf.data` pipeline: [0, 1] float32 images, int32 labels, batched by
    the global batch and prefetched.

    With `seed`, each epoch e is shuffled by a permutation that depends only
    on (seed, e), so a run resumed at `initial_epoch` sees the same batches
    as an uninterrupted one; epochs `initial_epoch` .. `epochs - 1` follow
    each other in one dataset (use `steps_per_epoch` in `fit`).
    """
    images = tf.constant(images)
    labels = tf.constant(labels.astype(np.int32))
    count = int(labels.shape[0])

    def epoch_order(epoch):
        order = tf.range(count, dtype=tf.int64)
        if seed is not None:
            order = tf.random.experimental.stateless_shuffle(
                order, seed=tf.stack([tf.constant(seed, tf.int64), epoch])
            )
        return tf.data.Dataset.from_tensor_slices(order)

    if epochs is None:
        indices = epoch_order(tf.constant(0, tf.int64))
    else:
        indices = tf.data.Dataset.range(initial_epoch, epochs).flat_map(
            lambda epoch: epoch_order(epoch).batch(global_batch_size, drop_remainder=drop_remainder)
        )
    if epochs is None:
        indices = indices.batch(global_batch_size, drop_remainder=drop_remainder)

    def gather(index):
        x = tf.cast(tf.gather(images, index), tf.float32) / 255.0
        return x, tf.gather(labels, index)

    return indices.map(gather, num_parallel_calls=tf.data.AUTOTUNE).prefetch(tf.data.AUTOTUNE)
