"""Reading `tf_vrgd.config`'s inputs: a dict, a YAML string or a YAML file
(a safe loader that reads ``1e-4`` as Model Garden does, bounded in size),
and the optimization block of a whole experiment (`tf_vrgd.config`
re-exports `load`, `optimization_block` and `MAX_CONFIG_VALUES`)."""

import os
import re

import yaml


class _SafeLoader(yaml.SafeLoader):
    """`yaml.SafeLoader` that also reads ``1e-4`` (no dot) as a float, as
    Model Garden's loader does (YAML 1.1 would make it a string)."""


_SafeLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(
        r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
        |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
        |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
        |[-+]?\.(?:inf|Inf|INF)
        |\.(?:nan|NaN|NAN))$""",
        re.X,
    ),
    list("-+0123456789."),
)


def load(cfg: dict | str | os.PathLike) -> dict:
    """A dict from a dict, a YAML string or a path to a YAML file (safe
    loader only)."""
    if isinstance(cfg, dict):
        return cfg
    if isinstance(cfg, os.PathLike) or (
        isinstance(cfg, str)
        and "\n" not in cfg
        and (os.path.exists(cfg) or cfg.endswith((".yaml", ".yml")))
    ):
        if not os.path.isfile(cfg):
            raise ValueError(f"The config file {os.fspath(cfg)!r} does not exist.")
        with open(cfg) as f:
            cfg = f.read()
    if not isinstance(cfg, str):
        raise ValueError(f"Expected a dict, a YAML string or a path. Received: {cfg!r}")
    try:
        loaded = yaml.load(cfg, Loader=_SafeLoader)
    except yaml.YAMLError as error:
        raise ValueError(f"Invalid YAML: {error}") from error
    if not isinstance(loaded, dict):
        if isinstance(loaded, str) and " " not in loaded and os.sep in loaded:
            raise ValueError(f"The config file {cfg!r} does not exist.")
        raise ValueError(f"The YAML does not hold a mapping. Received: {cfg[:200]!r}")
    _check_expanded_size(loaded)
    return loaded


# The values a config may hold once YAML's aliases are expanded: a whole
# experiment holds a few hundred.
MAX_CONFIG_VALUES = 100_000


def _check_expanded_size(loaded):
    """Raises ValueError if `loaded` holds more than `MAX_CONFIG_VALUES`
    values with its aliases expanded. YAML shares an aliased block instead
    of copying it, so a few lines of aliases of aliases load at once but
    expand exponentially (or forever, for a block that contains itself) in
    any later walk of the config. Counts by walking, stopping at the bound:
    its cost is the bound's, whatever the config."""
    count, stack = 0, [loaded]
    while stack:
        node = stack.pop()
        count += 1
        if count > MAX_CONFIG_VALUES:
            raise ValueError(
                f"The config holds more than {MAX_CONFIG_VALUES:,} values once its YAML "
                "aliases are expanded (aliases of aliases repeat a block exponentially): "
                "refused. Write the repeated values out, or use fewer aliases."
            )
        if isinstance(node, dict):
            stack.extend(node.values())
        elif isinstance(node, list):
            stack.extend(node)


def optimization_block(cfg: dict | str | os.PathLike) -> dict:
    """The `optimization` block of `cfg`: the block itself, or a Model Garden
    experiment's `trainer.optimizer_config`."""
    cfg = load(cfg)
    if "trainer" in cfg:
        trainer = cfg["trainer"] or {}
        if "optimizer_config" not in trainer:
            raise ValueError("The experiment's `trainer` has no `optimizer_config`.")
        return trainer["optimizer_config"]
    return cfg
