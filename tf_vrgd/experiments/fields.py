"""The task, trainer and runtime fields of an experiment config that
`vrgd-train` reads, each with its check: one table, so that every field is
checked by name before anything trains (the optimization block has its own
checks in `tf_vrgd.config`), and so that `--override` can refuse a key that
nothing reads.
"""

import difflib

from tf_vrgd import validation


def _path_or_paths(name, value):
    """Model Garden's `input_path`: a string (comma-separated globs)."""
    if isinstance(value, (list, tuple)) and value:
        return ",".join(validation.non_empty_string(name, v) for v in value)
    return validation.non_empty_string(name, value)


def _as_given(name, value):
    return value


def _true(name, value):
    """Model Garden's `task.losses.one_hot`: the image tasks here train on
    one-hot labels only."""
    if validation.check_bool(name, value) is not True:
        raise ValueError(
            f"`{name}` must be true: vrgd-train's image tasks train on one-hot labels. "
            f"Received: {name}={value!r}"
        )
    return value


# Dotted path -> check(name, value) returning the value to use.
FIELDS = {
    # trainer
    "trainer.train_steps": validation.POSITIVE_INTEGER,
    "trainer.checkpoint_interval": validation.POSITIVE_INTEGER,
    "trainer.validation_steps": validation.POSITIVE_INTEGER,
    "trainer.max_to_keep": validation.POSITIVE_INTEGER,
    # runtime
    "runtime.seed": validation.integer(0),
    "runtime.num_gpus": validation.integer(0),
    "runtime.distribution_strategy": validation.non_empty_string,
    # Checked against their choices where they are read (task_runs).
    "runtime.mixed_precision_dtype": _as_given,
    "runtime.loss_scale": _as_given,
    # data
    "task.init_checkpoint": validation.non_empty_string,
    "task.losses.label_smoothing": validation.UNIT_INTERVAL,
    "task.losses.l2_weight_decay": validation.NON_NEGATIVE_NUMBER,
    "task.losses.one_hot": _true,
    # the Fashion-MNIST CNN
    "task.model.type": validation.non_empty_string,
    "task.model.width": validation.POSITIVE_INTEGER,
    # BERT
    "task.model.encoder.type": validation.non_empty_string,
    "task.model.encoder.bert.vocab_size": validation.POSITIVE_INTEGER,
    "task.model.encoder.bert.hidden_size": validation.POSITIVE_INTEGER,
    "task.model.encoder.bert.num_layers": validation.POSITIVE_INTEGER,
    "task.model.encoder.bert.num_attention_heads": validation.POSITIVE_INTEGER,
    "task.model.encoder.bert.intermediate_size": validation.POSITIVE_INTEGER,
    "task.model.encoder.bert.max_position_embeddings": validation.POSITIVE_INTEGER,
    "task.model.encoder.bert.type_vocab_size": validation.POSITIVE_INTEGER,
    "task.model.encoder.bert.dropout_rate": validation.UNIT_INTERVAL,
    # ResNets
    "task.model.resnet.model_id": validation.POSITIVE_INTEGER,
    "task.model.input_size": validation.list_of(validation.POSITIVE_INTEGER, length=3),
    "task.model.num_classes": validation.integer(2),
    # DLRM
    "task.model.vocab_sizes": validation.list_of(validation.POSITIVE_INTEGER),
    "task.model.embedding_dim": validation.POSITIVE_INTEGER,
    "task.model.bottom_mlp": validation.list_of(validation.POSITIVE_INTEGER),
    "task.model.top_mlp": validation.list_of(validation.POSITIVE_INTEGER),
    "task.model.num_dense_features": validation.POSITIVE_INTEGER,
}
for _split in ("train_data", "validation_data"):
    FIELDS.update(
        {
            f"task.{_split}.global_batch_size": validation.POSITIVE_INTEGER,
            f"task.{_split}.input_path": _path_or_paths,
            f"task.{_split}.drop_remainder": validation.check_bool,
            f"task.{_split}.seq_length": validation.POSITIVE_INTEGER,
            f"task.{_split}.max_predictions_per_seq": validation.POSITIVE_INTEGER,
            f"task.{_split}.tfds_name": validation.non_empty_string,
            f"task.{_split}.tfds_split": validation.non_empty_string,
        }
    )

# Blocks whose fields another reader checks (the optimization block's, by
# `tf_vrgd.config`): an override may add any key under them.
CHECKED_ELSEWHERE = ("trainer.optimizer_config.",)


def _get(cfg, path):
    for key in path.split("."):
        if not isinstance(cfg, dict) or key not in cfg:
            return None
        cfg = cfg[key]
    return cfg


def _set(cfg, path, value):
    *parents, last = path.split(".")
    for key in parents:
        cfg = cfg[key]
    cfg[last] = value


def check(cfg):
    """Checks every field of `FIELDS` that `cfg` sets (None counts as
    unset), in place (a list of input paths becomes Model Garden's
    comma-separated string). Returns `cfg`; raises ValueError naming the
    field and its value."""
    for path, checker in FIELDS.items():
        value = _get(cfg, path)
        if value is None:
            continue
        _set(cfg, path, checker(path, value))
    return cfg


def leaves(tree, prefix=""):
    """{dotted path: value} of the non-mapping values of nested dicts."""
    found = {}
    for key, value in tree.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            found.update(leaves(value, f"{path}."))
        else:
            found[path] = value
    return found


def _unknown(key, known):
    """None if `key` is a field of `known` (dotted paths), one of their
    blocks, or under a block another reader checks; else the hint that
    names the nearest known key ("" if none)."""
    blocks = {path.rsplit(".", i)[0] for path in known for i in range(path.count(".") + 1)}
    if key in blocks or key.startswith(CHECKED_ELSEWHERE):
        return None
    nearest = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.0)
    return f" Did you mean {nearest[0]}?" if nearest else ""


def check_config_keys(cfg, source):
    """Raises ValueError for a key of the config file `source` that is not
    a field `vrgd-train` reads (a misspelt key would otherwise leave its
    field at the default), naming the nearest known key as
    `check_override_keys` does."""
    for key in leaves(cfg):
        hint = _unknown(key, FIELDS)
        if hint is not None:
            raise ValueError(f"{source}: {key}: vrgd-train reads no field by that name.{hint}")


def check_override_keys(cfg, overrides):
    """Raises ValueError for an ``--override KEY=VALUE`` whose KEY is neither
    in `cfg` nor a field `vrgd-train` reads (nor under a block another
    reader checks), naming the nearest known key."""
    known = set(leaves(cfg)) | set(FIELDS)
    for override in overrides:
        key = override.partition("=")[0].strip()
        hint = _unknown(key, known)
        if hint is not None:
            raise ValueError(
                f"--override {key}: the config has no such field and vrgd-train reads none by "
                f"that name.{hint}"
            )
