"""Where `vrgd-train` trains: the devices of one machine (logical CPU
devices where there is no GPU), or several machines: the cluster from
`TF_CONFIG`, the `MultiWorkerMirroredStrategy` Keras' `fit` can use, a
supervisor that can stop a worker waiting for the others, and which worker
writes."""

import json
import os
import sys
import time


def setup_devices(replicas):
    """Splits the CPU into `replicas` logical devices when there is no GPU;
    returns the MirroredStrategy device list. Must run before TF starts."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        if replicas > len(gpus):
            raise ValueError(f"--replicas {replicas} but only {len(gpus)} GPU(s) here.")
        return [f"/gpu:{i}" for i in range(replicas)]
    cpus = tf.config.list_physical_devices("CPU")
    tf.config.set_logical_device_configuration(
        cpus[0], [tf.config.LogicalDeviceConfiguration()] * replicas
    )
    return [f"/cpu:{i}" for i in range(replicas)]


# Under --output, the folders the other workers of a multi-worker run write
# to (removed when their runs end).
WORKER_SCRATCH = ".workers"


def multi_worker_cluster(args):
    """The cluster of a multi-worker run ("2 workers"), from the `TF_CONFIG`
    that `MultiWorkerMirroredStrategy` reads (Model Garden's way); "" on
    one machine."""
    spec = os.environ.get("TF_CONFIG")
    if not spec:
        return ""
    try:
        parsed = json.loads(spec)
        cluster, task = parsed["cluster"], parsed["task"]
    except (ValueError, KeyError, TypeError):
        raise SystemExit(
            "vrgd-train: TF_CONFIG must be JSON with a 'cluster' and a 'task', as "
            "MultiWorkerMirroredStrategy reads it."
        ) from None
    for flag, value in (("--replicas", args.replicas), ("--restart", args.restart)):
        if value:
            raise SystemExit(
                f"vrgd-train: {flag} is for one machine. With TF_CONFIG every worker trains on "
                "its GPUs (one replica each; a CPU-only worker is one replica)"
                + (", and a restart must clear --output first." if flag == "--restart" else ".")
            )
    problem = _cluster_problem(cluster, task)
    if problem:
        raise SystemExit(f"vrgd-train: TF_CONFIG: {problem} (TF_CONFIG={spec})")
    tasks = sum(len(addresses) for addresses in cluster.values())
    return f"{tasks} workers"


def _cluster_problem(cluster, task):
    """What is wrong with TF_CONFIG's `cluster` and `task`; "" if nothing."""
    if not isinstance(cluster, dict) or not cluster:
        return "'cluster' must map task types (chief, worker) to lists of host:port"
    for kind, addresses in cluster.items():
        if kind not in ("chief", "worker", "evaluator"):
            return f"cluster task type {kind!r} is not chief, worker or evaluator"
        if not isinstance(addresses, list) or not all(
            isinstance(a, str) and ":" in a for a in addresses
        ):
            return f"cluster[{kind!r}] must be a list of host:port strings"
    if not isinstance(task, dict) or "type" not in task or "index" not in task:
        return "'task' must be {\"type\": ..., \"index\": ...}, this process's place in 'cluster'"
    kind, index = task["type"], task["index"]
    if kind not in cluster:
        return f"task type {kind!r} is not in the cluster ({', '.join(sorted(cluster))})"
    if not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < len(cluster[kind]):
        return (
            f"task index {index!r} is out of range: cluster[{kind!r}] has "
            f"{len(cluster[kind])} address(es), indexed from 0"
        )
    return ""


def multi_worker_strategy():
    """`MultiWorkerMirroredStrategy` from `TF_CONFIG` (its constructor waits
    until every task of the cluster has connected: see `supervise`), with a
    `reduce` that takes what Keras' `fit` and `evaluate` pass it with more
    than one worker
    (keras-team/keras#20329, #20585): a whole input batch, nested (to build
    the metrics), as `MirroredStrategy`'s `reduce` takes it; and the
    per-replica scalar logs with `axis=0`, which for a scalar means the mean
    over replicas (`axis=None`)."""
    import tensorflow as tf

    class Strategy(tf.distribute.MultiWorkerMirroredStrategy):
        def reduce(self, reduce_op, value, axis):
            if tf.nest.is_nested(value):
                return tf.nest.map_structure(lambda v: self.reduce(reduce_op, v, axis), value)
            local = self.experimental_local_results(value)
            if axis is not None and all(v.shape.rank == 0 for v in local):
                axis = None
            return super().reduce(reduce_op, value, axis)

    strategy = Strategy()
    # Tell a supervising vrgd-train (`supervise`) that the cluster is up.
    fd = os.environ.pop(CONNECTED_FD, None)
    if fd:
        os.write(int(fd), b"connected")
        os.close(int(fd))
    return strategy


# The pipe on which a supervised multi-worker process says it connected.
CONNECTED_FD = "VRGD_TRAIN_CONNECTED_FD"


def supervise(argv, timeout):
    """Runs this command again as a child process and watches it until its
    cluster has connected: TensorFlow's wait for the other tasks neither
    returns to Python (where signal handlers run, so SIGINT and SIGTERM go
    unheard) nor ends. Says what it waits for; after `timeout` seconds, or
    on SIGTERM or SIGINT while waiting, ends the child with a message. Once
    connected, signals are passed on to the child (TensorFlow's own
    handling) and the child's exit status is returned."""
    import select
    import signal
    import subprocess

    spec = json.loads(os.environ["TF_CONFIG"])
    task = spec["task"]
    others = ", ".join(
        f"{kind} {i} ({address})"
        for kind, addresses in spec["cluster"].items()
        for i, address in enumerate(addresses)
        if (kind, i) != (task["type"], task["index"])
    )
    read, write = os.pipe()
    child = subprocess.Popen(
        [sys.executable, "-m", "tf_vrgd.experiments.train", *argv],
        env=dict(os.environ, **{CONNECTED_FD: str(write)}),
        pass_fds=(write,),
    )
    os.close(write)
    print(
        f"experiment: {task['type']} {task['index']} waiting for {others or 'no other task'} "
        f"to connect (up to {timeout} s, --worker-timeout)",
        flush=True,
    )
    connected = False

    def stop(reason):
        print(f"vrgd-train: {reason}", file=sys.stderr, flush=True)
        child.kill()
        child.wait()
        return 1

    def on_signal(number, frame):
        if connected:
            child.send_signal(number)
        else:
            raise KeyboardInterrupt(signal.Signals(number).name)

    previous = {n: signal.signal(n, on_signal) for n in (signal.SIGTERM, signal.SIGINT)}
    try:
        deadline = time.monotonic() + timeout
        while not connected and child.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return stop(
                    f"not every task of TF_CONFIG's cluster connected within {timeout} s "
                    f"(waiting for {others}): start them, check their addresses and ports, "
                    "or raise --worker-timeout."
                )
            ready, _, _ = select.select([read], [], [], min(left, 1.0))
            if ready:
                connected = bool(os.read(read, 64))  # b"" when the child has ended
                if not connected:
                    break
        code = child.wait()
    except KeyboardInterrupt as interrupt:
        return stop(
            f"{interrupt.args[0] if interrupt.args else 'SIGINT'} while waiting for {others}."
        )
    finally:
        os.close(read)
        for number, handler in previous.items():
            signal.signal(number, handler)
    return 128 - code if code < 0 else code


def is_chief(strategy):
    """Whether this process writes the run's files: always on one machine;
    under MultiWorkerMirroredStrategy, the `chief` task, or worker 0 of a
    cluster without one."""
    resolver = getattr(strategy, "cluster_resolver", None)
    if resolver is None:
        return True
    if resolver.task_type == "chief":
        return True
    has_chief = "chief" in resolver.cluster_spec().as_dict()
    return resolver.task_type == "worker" and resolver.task_id == 0 and not has_chief
