"""Reading an experiment's input files: the training stream (every record
once per pass, in an order fixed by the seed, resumable at any record), the
files once in order for evaluation, and checks of TFRecord files."""

import tensorflow as tf


def tfrecord_problem(name, problem_of):
    """The first problem of TFRecord file `name`: a record that does not
    read (a truncated or corrupted file) or one for which
    `problem_of(tf.train.Example)` says what is wrong."""
    index = 0
    try:
        for index, record in enumerate(tf.data.TFRecordDataset([name]).as_numpy_iterator()):
            try:
                example = tf.train.Example.FromString(record)
            except Exception:  # protobuf's DecodeError
                return f"record {index}: not a tf.train.Example."
            problem = problem_of(example)
            if problem:
                return f"record {index}: {problem}"
    except (tf.errors.DataLossError, tf.errors.OutOfRangeError) as error:
        return f"the record after record {index} does not read ({error.message.splitlines()[0]})"
    return ""


def labels_in_range(name, labels, count, field):
    """A check in the input pipeline: every one of `labels` in [0, count)."""
    labels = tf.convert_to_tensor(labels)
    valid = tf.reduce_all((labels >= 0) & (labels < count))
    check = tf.debugging.Assert(valid, [f"{name} out of range [0, {count}) ({field}):", labels])
    with tf.control_dependencies([check]):
        return tf.identity(labels)


def first_example(path):
    """The first `tf.train.Example` of a TFRecord file; None if it has none."""
    for record in tf.data.TFRecordDataset([path]).take(1):
        return tf.train.Example.FromString(record.numpy())
    return None


def read_in_order(files, reader, shard):
    """`reader(files)` in file order (evaluation), or with `shard = (count,
    index)` input pipeline `index` of `count`: every count-th file from
    `index` where there are at least `count` files, else every count-th
    record."""
    if shard is None:
        return reader(files)
    count, index = shard
    if len(files) >= count:
        return reader(files[index::count])
    return reader(files).shard(count, index)


# Consecutive records of a pass that a training stream puts in a random
# order together (the memory a shuffle buffer of this size would take).
SHUFFLE_BLOCK = 10000


def count_records(files, reader):
    """The number of records `reader` reads from each of `files` (each file
    read through once, several at a time)."""
    counts = tf.data.Dataset.from_tensor_slices(list(files)).map(
        lambda name: reader(name).reduce(tf.constant(0, tf.int64), lambda n, _: n + 1),
        num_parallel_calls=tf.data.AUTOTUNE,
        deterministic=True,
    )
    return [int(n) for n in counts.as_numpy_iterator()]


def training_records(files, reader, seed, start=0, shard=None, block=SHUFFLE_BLOCK):
    """The training stream of the records `reader` reads from `files`, from
    its record `start` on: a deterministic function of the files and `seed`.

    Pass p (p = 0, 1, ...) reads the files in an order drawn from (seed, p),
    and puts each block of `block` consecutive records of the pass in an
    order drawn from (seed, p, the block's index): every record once per
    pass, mixed with its neighbours as a shuffle buffer of `block` records
    mixes them. Every iterator reads the same stream, and the stream from
    `start` is the one from 0 less its first `start` records, so a run
    resumed after `start` records reads exactly what the uninterrupted run
    reads next. Reaching `start` reads each file's record count once
    (`count_records`) and then at most one file up to one block: never the
    records before it.

    `shard = (count, index)`: input pipeline `index` of `count` (a worker of
    a multi-worker run) reads every count-th file from `index` where there
    are at least `count` files, else every count-th record of each pass;
    `start` counts this pipeline's records.
    """
    files = list(files)
    if shard is not None:
        count, index = shard
        if len(files) >= count:
            files, shard = files[index::count], None
    names = tf.constant(files)
    seed = tf.constant(seed, tf.int64)

    def pass_seed(epoch):
        return tf.stack([seed, tf.cast(epoch, tf.int64)])

    def order(epoch):
        return tf.random.experimental.stateless_shuffle(
            tf.range(len(files), dtype=tf.int64), seed=pass_seed(epoch)
        )

    def shuffled(seed_of_pass, index, records):
        size = tf.shape(tf.nest.flatten(records)[0], out_type=tf.int64)[0]
        permutation = tf.random.experimental.stateless_shuffle(
            tf.range(size), seed=tf.random.experimental.stateless_fold_in(seed_of_pass, index)
        )
        return tf.data.Dataset.from_tensor_slices(
            tf.nest.map_structure(lambda r: tf.gather(r, permutation), records)
        )

    def one_pass(epoch, skip_files=0, skip_records=0, first_block=0):
        records = reader(tf.gather(names, order(epoch)[skip_files:]))
        if shard is not None:
            records = records.shard(*shard)
        blocks = records.skip(skip_records).batch(block).enumerate(start=first_block)
        seed_of_pass = pass_seed(epoch)
        return blocks.flat_map(lambda i, records: shuffled(seed_of_pass, i, records))

    epoch = skip_files = skip_records = first_block = within = 0
    if start:
        counts = count_records(files, reader)
        total = sum(counts)
        per_pass = total if shard is None else len(range(shard[1], total, shard[0]))
        if per_pass == 0:
            raise ValueError(f"{', '.join(files)}: no records to train on.")
        epoch, offset = divmod(start, per_pass)
        first_block, within = divmod(offset, block)
        skip_records = first_block * block
        if shard is None:  # whole files first, without reading them
            for i in order(epoch).numpy():
                if skip_records < counts[i]:
                    break
                skip_records -= counts[i]
                skip_files += 1
    first = one_pass(tf.constant(epoch, tf.int64), skip_files, skip_records, first_block)
    later = tf.data.Dataset.range(epoch + 1, 2**62).flat_map(one_pass)
    return first.skip(within).concatenate(later)


def split_records(split, files, reader, seed, start, shard):
    """The records of a split: the training stream, or the files once."""
    if split == "train":
        return training_records(files, reader, seed, start, shard)
    return read_in_order(files, reader, shard)


def input_files(pattern):
    """The files of a Model Garden `input_path`: comma-separated globs
    (through `tf.io.gfile`, so cloud storage paths work too)."""
    if not pattern:
        raise ValueError(
            "The task reads files but task.train_data.input_path is not set: pass "
            "--override task.train_data.input_path=PATH, or --synthetic."
        )
    found = sorted(f for part in str(pattern).split(",") for f in tf.io.gfile.glob(part.strip()))
    if not found:
        raise FileNotFoundError(f"No file matches input_path {pattern!r}.")
    return found
