"""Programs of the VR hook traced once and run on every replica device
(`tf_vrgd._gsnr_device`): under `MirroredStrategy` a function called in
each device's update context is otherwise traced once per device."""

from typing import NamedTuple

import tensorflow as tf


class OnEveryDevice:
    """A device's update, traced once and run on every device.

    `function` takes tensors (lists of them, `tf.IndexedSlices`, or None)
    and Python numbers, which are fixed at the trace, and captures the
    variables it reads and writes. In a graph, its first call traces it in
    that device's update context, where a captured distributed variable
    is the device's copy; every call then runs that one program with each
    such capture rebound to the copy of the device whose update context
    calls it. So a device's update costs one trace, not one per device,
    and XLA compiles its compiled part once per device as before.

    The copies are found from `variables()` (the distributed variables the
    program may touch: its optimizer's and the model's). A program that
    captured any other variable is not shared: `function` is then called
    on each device, traced there (as it is eagerly). The program runs with
    its captures replaced through `ConcreteFunction._call_flat`, the
    TensorFlow internal that `ConcreteFunction.__call__` calls with the
    captures of the trace.
    """

    def __init__(self, function, variables):
        self._function = function
        self._variables = variables
        self._programs = {}
        self.compiled = None
        self.shared = ()

    def __call__(self, *args):
        if tf.executing_eagerly():
            return self._function(*args)
        leaves = tf.nest.flatten(args, expand_composites=True)
        at = [i for i, leaf in enumerate(leaves) if tf.is_tensor(leaf)]
        key = repr(tf.nest.map_structure(_spec_or_value, args))
        graph = tf.compat.v1.get_default_graph()
        entry = self._programs.get(key)
        if entry is None or entry.graph not in (None, graph):
            entry = self._trace(args, leaves, at)
            self._programs[key] = entry
        if entry.program is None:
            return self._function(*args)
        # A distributed variable's handle in this device's update context is
        # this device's copy.
        captures = [
            captured if variable is None else variable.handle
            for captured, variable in zip(entry.program.captured_inputs, entry.variables)
        ]
        return entry.program._call_flat([leaves[i] for i in at], captures)

    def _trace(self, args, leaves, at):
        fixed = [None if i in at else leaf for i, leaf in enumerate(leaves)]
        function = self._function

        def program(*tensors):
            values = list(fixed)
            for i, tensor in zip(at, tensors):
                values[i] = tensor
            function(*tf.nest.pack_sequence_as(args, values, expand_composites=True))

        traced = tf.function(program, autograph=False).get_concrete_function(
            *(tf.TensorSpec(leaves[i].shape, leaves[i].dtype) for i in at)
        )
        # Each captured handle's distributed variable (None for a captured
        # constant); a handle of no known one makes the program per device.
        containers = {}
        for variable in self._variables():
            if isinstance(variable, tf.distribute.DistributedValues):
                for copy in variable.values:
                    containers[id(copy.handle)] = variable
        variables = [containers.get(id(captured)) for captured in traced.captured_inputs]
        if any(
            variable is None and captured.dtype == tf.resource
            for captured, variable in zip(traced.captured_inputs, variables)
        ):
            return _Program(None, None, None)
        # A program that captured a tensor of this graph (not a variable's)
        # is traced again in another graph.
        symbolic = any(tf.is_symbolic_tensor(t) for t in traced.captured_inputs)
        return _Program(traced, variables, tf.compat.v1.get_default_graph() if symbolic else None)


class _Program(NamedTuple):
    """A traced device update, the distributed variable of each of its
    captures (or None), and the graph it is bound to (None: any)."""

    program: object
    variables: list
    graph: object


def _spec_or_value(value):
    """A tensor's (or `tf.IndexedSlices`') type spec; anything else itself."""
    return tf.type_spec_from_value(value) if tf.is_tensor(value) else value


class TracedOnce:
    """A function of tensors alone (lists of them, or None), traced once and
    called on every device.

    A `tf.function` called in each device's update context is traced again
    for each; its concrete function, traced once, runs where it is called
    (XLA, with `jit_compile`, compiles it once per device, when it first
    runs there). Keyword arguments are Python values fixed at the trace.
    """

    def __init__(self, function, jit_compile):
        self._function = tf.function(function, jit_compile=jit_compile, autograph=False)
        self._concrete = {}

    def __call__(self, *tensors, **fixed):
        specs = tf.nest.map_structure(
            lambda t: None if t is None else tf.TensorSpec(t.shape, t.dtype), tensors
        )
        key = (tuple(sorted(fixed.items())), tuple(tf.nest.flatten(specs)))
        if key not in self._concrete:
            self._concrete[key] = self._function.get_concrete_function(*specs, **fixed)
        return self._concrete[key](*tensors, **fixed)

    def tracing_count(self):
        return self._function.experimental_get_tracing_count()
