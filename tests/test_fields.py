"""Every task, trainer and runtime field `vrgd-train` reads is checked by
name before anything trains, and an override of a key that nothing reads
is refused with the nearest known key."""

import os

import pytest

from tf_vrgd.experiments import fields, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER = os.path.join(ROOT, "configs", "paper", "dlrm_vr_sgd_64k.yaml")
FASHION = os.path.join(ROOT, "configs", "fashion_mnist", "vr_adam_b1024.yaml")


def _main(config, tmp_path, *overrides):
    command = ["--config", config, "--output", str(tmp_path)]
    if config == PAPER:
        command.append("--synthetic")
    for override in overrides:
        command += ["--override", override]
    with pytest.raises(SystemExit) as raised:
        train.main(command)
    return str(raised.value)


@pytest.mark.parametrize("config", [PAPER, FASHION], ids=["dlrm", "fashion"])
def test_an_unknown_override_key_is_refused_with_the_nearest(config, tmp_path):
    message = _main(config, tmp_path, "task.train_data.global_batchsize=16")
    assert "--override task.train_data.global_batchsize: the config has no such field" in message
    assert "Did you mean task.train_data.global_batch_size?" in message


def test_override_keys_the_config_lacks_but_the_task_reads_are_taken():
    cfg = {"task": {"model": {"type": "dlrm"}}, "trainer": {"train_steps": 10}}
    fields.check_override_keys(
        cfg,
        [
            "task.model.vocab_sizes=[4, 4]",  # read by the DLRM task
            "trainer.checkpoint_interval=5",
            "task.validation_data.input_path=/data/day_1",
            "task.model={}",  # a whole block
            "trainer.optimizer_config.optimizer.vr_sgd.gsnr_interval=4",  # checked there
        ],
    )
    with pytest.raises(ValueError, match=r"Did you mean task\.model\.embedding_dim"):
        fields.check_override_keys(cfg, ["task.model.embeding_dim=8"])


# (config, --override, what the message says)
BAD_VALUES = [
    *(
        ("dlrm", override, said)
        for override, said in [
            (
                "trainer.checkpoint_interval=-1",
                "trainer.checkpoint_interval` must be an integer in [1",
            ),
            (
                "trainer.checkpoint_interval=0",
                "trainer.checkpoint_interval` must be an integer in [1",
            ),
            ("trainer.validation_steps=0", "trainer.validation_steps` must be an integer in [1"),
            ("trainer.validation_steps=-1", "trainer.validation_steps` must be an integer in [1"),
            ("trainer.train_steps=0", "trainer.train_steps` must be an integer in [1"),
            ("task.train_data.global_batch_size=abc", "global_batch_size` must be an integer"),
            ("task.train_data.global_batch_size=0", "global_batch_size` must be an integer in [1"),
            ("task.train_data.global_batch_size=-8", "global_batch_size` must be an integer in [1"),
            ("task.train_data.global_batch_size=16.7", "global_batch_size` must be an integer"),
            ("task.model.embedding_dim=abc", "task.model.embedding_dim` must be an integer"),
            (
                "task.model.vocab_sizes=[4, 0]",
                "task.model.vocab_sizes[1]` must be an integer in [1",
            ),
            ("runtime.seed=-1", "runtime.seed` must be an integer in [0"),
            (
                "trainer.optimizer_config.learning_rate.delayed_polynomial.initial_learning_rate=abc",
                "initial_learning_rate",
            ),
        ]
    ),
    *(
        ("fashion", override, said)
        for override, said in [
            ("task.train_data.global_batch_size=abc", "global_batch_size` must be an integer"),
            ("task.model.width=abc", "task.model.width` must be an integer"),
            ("trainer.train_steps=0", "trainer.train_steps` must be an integer in [1"),
            (
                "trainer.optimizer_config.learning_rate.cosine.initial_learning_rate=abc",
                "initial_learning_rate",
            ),
        ]
    ),
]


@pytest.mark.parametrize("config, override, said", BAD_VALUES)
def test_bad_task_and_trainer_values_are_named(config, override, said, tmp_path):
    message = _main({"dlrm": PAPER, "fashion": FASHION}[config], tmp_path, override)
    assert message.startswith("vrgd-train: ") and said in message, message
    assert "Traceback" not in message


def test_checked_fields_keep_their_values():
    cfg = {
        "task": {
            "train_data": {"global_batch_size": 64, "input_path": ["/a/x", "/b/y"]},
            "model": {"input_size": [32, 32, 3]},
        },
        "trainer": {"train_steps": 10, "checkpoint_interval": None},
    }
    fields.check(cfg)
    assert cfg["task"]["train_data"] == {"global_batch_size": 64, "input_path": "/a/x,/b/y"}
    assert cfg["task"]["model"]["input_size"] == [32, 32, 3]
    assert cfg["trainer"]["checkpoint_interval"] is None  # unset


@pytest.mark.parametrize(
    "extra, key, nearest",
    [
        (
            {"trainer": {"checkpoint_intervall": 2}},
            "trainer.checkpoint_intervall",
            "trainer.checkpoint_interval",
        ),
        ({"trainr": {"train_steps": 2}}, "trainr.train_steps", "trainer.train_steps"),
        (
            {"task": {"train_data": {"shuffle_bufer_size": 10}}},
            "task.train_data.shuffle_bufer_size",
            None,
        ),
    ],
)
def test_an_unknown_key_of_the_config_file_is_refused_with_the_nearest(
    extra, key, nearest, tmp_path
):
    """A misspelt key in the file trained on defaults before; it is refused
    as an unknown --override key is, naming the nearest field."""
    import yaml

    with open(FASHION) as f:
        cfg = yaml.safe_load(f)

    def merge(into, values):
        for name, value in values.items():
            if isinstance(value, dict):
                merge(into.setdefault(name, {}), value)
            else:
                into[name] = value

    merge(cfg, extra)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    message = _main(str(config), tmp_path / "out")
    assert message.startswith(f"vrgd-train: {config}: {key}: vrgd-train reads no field"), message
    assert f"Did you mean {nearest}?" in message if nearest else "Did you mean" in message


def test_every_key_of_the_shipped_configs_is_a_field_vrgd_train_reads():
    import glob

    from tf_vrgd import config

    # Those vrgd-train reads (configs/model_garden is for Model Garden's trainer).
    paths = [
        path
        for folder in ("paper", "fashion_mnist")
        for path in glob.glob(os.path.join(ROOT, "configs", folder, "*.yaml"))
    ]
    assert len(paths) > 100
    for path in paths:
        fields.check_config_keys(config.load(path), path)
