"""An experiment config as `vrgd-train` reads it: one lookup of dotted
fields, `--override` values, the rescaling of a schedule to another step
count and rate, the runs of an experiment (its optimizer, then its VR
twin), and `Experiment`, what the command's shared steps read of one."""

import contextlib
import copy
import numbers
from typing import Protocol, runtime_checkable


@runtime_checkable
class Experiment(Protocol):
    """An experiment as `vrgd-train`'s shared steps (`check_runs`,
    `run_folder.check_settings`, `train_each`, `write_summary`) read it.
    `fashion_mnist.Experiment` and `task_runs.TaskExperiment` implement it;
    each adds what its own training loop needs."""

    block: dict  # the optimization block, rescaled to the run
    note: str  # how the config's schedule was changed ("" if not)
    replicas: int

    def settings(self, compare: bool) -> dict:
        """What the run folder's results depend on, checked at a resume."""
        ...

    def runs(self, compare: bool) -> list:
        """[(run name, optimization block)]: the config's, then its twin."""
        ...


def lookup(cfg, path, default=None):
    """The value at the dotted `path` of `cfg`, or `default` where a block
    on the way or the value is missing or null."""
    for key in path.split("."):
        if not isinstance(cfg, dict) or key not in cfg:
            return default
        cfg = cfg[key]
    return default if cfg is None else cfg


def rescale_schedule(block, step_factor, lr_factor):
    """The optimization block with every step count (decay_steps,
    warmup_steps, boundaries, offset, decay_start_steps) multiplied by
    `step_factor` and every learning rate by `lr_factor`."""
    block = copy.deepcopy(block)
    step_keys = ("decay_steps", "warmup_steps", "offset", "decay_start_steps")
    rate_keys = (
        "learning_rate",
        "initial_learning_rate",
        "end_learning_rate",
        "warmup_learning_rate",
    )
    for section in ("learning_rate", "warmup"):
        kind = lookup(block, f"{section}.type")
        fields = lookup(block, f"{section}.{kind}") if kind else None
        if not fields:
            continue
        for key in step_keys:
            if isinstance(fields.get(key), numbers.Real) and fields[key]:
                fields[key] = max(1, round(fields[key] * step_factor))
        if isinstance(fields.get("boundaries"), list):
            fields["boundaries"] = [
                max(1, round(b * step_factor)) if isinstance(b, numbers.Real) else b
                for b in fields["boundaries"]
            ]
        # Values that are not numbers are left to the optimization block's
        # checks, which name the field.
        for key in rate_keys:
            if isinstance(fields.get(key), numbers.Real):
                fields[key] = fields[key] * lr_factor
        if isinstance(fields.get("values"), list):
            fields["values"] = [
                v * lr_factor if isinstance(v, numbers.Real) else v for v in fields["values"]
            ]
    return block


def runs_of(block, compare):
    """[(run name, optimization block)]: the config's, then its twin."""
    from tf_vrgd.experiments import twins

    runs = [(block["optimizer"]["type"], block)]
    if compare:
        twin = twins.twin_block(block)
        runs.append((twin["optimizer"]["type"], twin))
    return runs


def apply_overrides(cfg, overrides):
    """`cfg` with each ``DOTTED.KEY=VALUE`` set (VALUE read as YAML); the
    missing blocks on the way are created."""
    import yaml

    cfg = copy.deepcopy(cfg)
    for override in overrides:
        path, sep, text = override.partition("=")
        keys = path.strip().split(".")
        if not sep or not all(keys):
            raise ValueError(f"--override takes DOTTED.KEY=VALUE. Received: {override!r}")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as error:
            raise ValueError(f"--override {override!r}: the value is not YAML ({error}).") from None
        node = cfg
        for depth, key in enumerate(keys[:-1]):
            child = node.get(key)
            if child is None:
                child = node[key] = {}
            if not isinstance(child, dict):
                raise ValueError(
                    f"--override {override!r}: {'.'.join(keys[: depth + 1])} is a value, "
                    "not a block."
                )
            node = child
        node[keys[-1]] = value
    return cfg


@contextlib.contextmanager
def config_errors_exit():
    """A config or its files that cannot train (ValueError,
    FileNotFoundError) end the command with the message, not a traceback."""
    try:
        yield
    except (ValueError, FileNotFoundError) as error:
        raise SystemExit(f"vrgd-train: {error}") from None


def check_runs(experiment: Experiment, compare):
    """Builds each run's optimizer before anything trains, so that a run
    that cannot train (a VR optimizer with k < 2 samples per update)
    stops the command before the first run, not after it."""
    from tf_vrgd import config, find_vr_optimizer

    for name, block in experiment.runs(compare):
        try:
            optimizer = config.optimizer_from_config(block)
        except ValueError as error:
            raise SystemExit(f"vrgd-train: run {name!r}: {error}") from None
        vr = find_vr_optimizer(optimizer)
        if vr is not None:
            try:
                vr.check_sample_count(experiment.replicas)
            except ValueError as error:
                raise SystemExit(f"vrgd-train: run {name!r} cannot train: {error}") from None
