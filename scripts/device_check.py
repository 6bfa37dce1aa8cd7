"""The device check: tf_vrgd's tests, step costs and paper-task throughput
on the GPUs of one machine, in one command of under 8 minutes.

    python scripts/device_check.py OUT            # a machine with NVIDIA GPUs
    python scripts/device_check.py OUT --dry-run  # the same path on CPU, tiny sizes

Each step runs in a process of its own (each takes the GPUs' memory anew)
with a share of the time limit, and OUT/device_check.json is rewritten after
each, so that a run cut short keeps what it measured; each step's output is
in OUT/<step>.log.

1. environment: the GPUs (nvidia-smi), Python, TensorFlow and its CUDA and
   cuDNN, Keras.
2. tests: tests/test_vr.py (the numpy references) and tests/test_vr_keras.py
   (the VR family in Keras' fit, saving, mixed precision) with the
   `strategy` fixture's four replicas on four logical GPUs carved from GPU
   0 (all-reduced through one device, as NCCL does not run between them),
   then on the first four physical GPUs when there are four or more.
3. step cost: scripts/bench_step.py, the update (with its traffic as a
   fraction of the GPU's copy bandwidth) and the training step of the Adam
   and LAMB pairs (and the package's own LAMB) at gsnr_interval N = 1 and
   16, and of Keras' Adam against NoiseScale around it (interval 1 and
   16), on ResNet-50 at 224x224 and the encoder, 64 examples per replica,
   mirrored over the GPUs (over two logical GPUs of GPU 0 where there is
   one).
4. paper tasks: vrgd-train --synthetic --compare on BERT-large phase 1 and
   ResNet-50 (ImageNet shapes) at their model sizes, 30 updates in 3
   intervals: examples per second of the twin and its base (the intervals
   after the first), their ratio, and the first interval's seconds, which
   hold the tracing and compilation (time to first step).

`--dry-run` runs every step on logical CPU devices at tiny sizes (the test
suite runs it): a few tests, a small MLP for the step cost, tiny BERT and
the CIFAR ResNet-8 for the tasks. Its figures say nothing about a GPU.
"""

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAPER = os.path.join(ROOT, "configs", "paper")
TASKS = {
    "bert_large_phase1": "bert_large_vr_lamb_32k_phase1.yaml",
    "resnet50_imagenet": "imagenet_resnet50_vr_lars_32k.yaml",
}
# Per replica (GPU): examples of one step of each task and of the benchmark.
GPU_BATCH = {"bert_large_phase1": 64, "resnet50_imagenet": 128, "bench": 64}
# The dry run's tasks: tiny sizes, and the CIFAR ResNet-8 in place of
# ResNet-50 (the same task and code path).
DRY_TASKS = {"bert_large_phase1": "bert", "resnet50_imagenet": "resnet"}
# Shares of the time limit, in this order.
SHARES = {"environment": 0.03, "tests": 0.37, "bench": 0.3, "tasks": 0.3}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="folder for device_check.json and the step logs")
    parser.add_argument("--dry-run", action="store_true", help="CPU logical devices, tiny sizes")
    parser.add_argument(
        "--time-limit", type=float, default=None, help="seconds for all steps (default 470)"
    )
    return parser.parse_args(argv)


def _run(command, log, timeout, env=None):
    """Runs `command` (output to `log`); returns (exit code or None if it
    timed out, seconds, output)."""
    start = time.monotonic()
    environment = dict(os.environ, PYTHONPATH=ROOT, **(env or {}))
    try:
        done = subprocess.run(
            command,
            cwd=ROOT,
            env=environment,
            capture_output=True,
            text=True,
            timeout=max(timeout, 1.0),
        )
        code, text = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as expired:
        code = None
        text = (expired.stdout or b"").decode() if isinstance(expired.stdout, bytes) else ""
        text += f"\n[device_check] timed out after {timeout:.0f} s\n"
    with open(log, "w") as f:
        f.write(text)
    return code, time.monotonic() - start, text


# Run in a process of its own: this one never initialises a GPU.
VERSIONS = """
import json, keras, tensorflow as tf
build = tf.sysconfig.get_build_info()
print(json.dumps({
    "tensorflow": tf.__version__, "keras": keras.__version__,
    "cuda": build.get("cuda_version"), "cudnn": build.get("cudnn_version"),
    "tensorflow_gpus": [d.name for d in tf.config.list_physical_devices("GPU")],
}))
"""


def environment(args, gpus, timeout):
    found = {"python": platform.python_version(), "gpus": gpus}
    try:
        smi = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=name,memory.total,driver_version",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        found["nvidia_smi"] = smi.stdout.strip().splitlines()
    except (OSError, subprocess.TimeoutExpired):
        found["nvidia_smi"] = None
    code, _, text = _run(
        [sys.executable, "-c", VERSIONS],
        os.path.join(args.output, "environment.log"),
        max(timeout, 60.0),
        {"TF_CPP_MIN_LOG_LEVEL": "3"},
    )
    lines = [line for line in text.splitlines() if line.startswith("{")]
    if code == 0 and lines:
        found.update(json.loads(lines[-1]))
    return found


def _pytest_counts(text):
    """{"passed": n, "failed": n, ...} from pytest's closing line."""
    counts = {}
    for number, word in re.findall(r"(\d+) (passed|failed|errors?|skipped)", text):
        counts[word.rstrip("s") if word.startswith("error") else word] = int(number)
    return counts


def tests(args, gpus, timeout):
    files = ["tests/test_vr.py", "tests/test_vr_keras.py"]
    setups = ["cpus"] if args.dry_run else ["logical-gpus"] + (["gpus"] if gpus >= 4 else [])
    selection = (
        ["-k", "(four_replicas and VR-Adam and mixed) or (conv_model and VR-Adam)"]
        if args.dry_run
        else []
    )
    results = []
    for setup in setups:
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files]
        code, seconds, text = _run(
            command + selection,
            os.path.join(args.output, f"tests-{setup}.log"),
            timeout / len(setups),
            {"TF_VRGD_TEST_DEVICES": setup},
        )
        results.append(
            {
                "devices": setup,
                "exit_code": code,
                "seconds": round(seconds, 1),
                **_pytest_counts(text),
            }
        )
    return results


def bench(args, gpus, timeout):
    rows_file = os.path.join(args.output, "bench_step.json")
    command = [sys.executable, os.path.join(ROOT, "scripts", "bench_step.py")]
    command += ["--setups", "mirrored", "--pairs", "Adam", "LAMB", "NoiseScale", "--own-base"]
    command += ["--kinds", "update", "train step"]
    command += ["--gsnr-intervals", "1", "16", "--no-no-xla", "--json", rows_file]
    if args.dry_run:  # a small MLP in place of the real shapes
        command += ["--models", "mlp", "--mlp-parameters", "20000", "--batch", "8"]
        command += ["--replicas", "2", "--steps", "1", "--repeats", "1"]
    else:
        command += ["--models", "resnet50", "encoder", "--image-size", "224"]
        command += ["--batch-per-replica", str(GPU_BATCH["bench"])]
        command += ["--steps", "16", "--repeats", "3"]
        if gpus == 1:
            command += ["--logical-gpus", "2"]
    code, seconds, _ = _run(command, os.path.join(args.output, "bench.log"), timeout)
    found = {"exit_code": code, "seconds": round(seconds, 1), "rows": []}
    if os.path.exists(rows_file):
        with open(rows_file) as f:
            rows = json.load(f)["rows"]
        for row in rows:
            seconds_of = row["seconds"]
            found["rows"].append(
                {
                    "model": row["model"],
                    "pair": row["pair"],
                    "kind": row["kind"],
                    "replicas": row["replicas"],
                    "base_ms": round(seconds_of["base"] * 1e3, 2),
                    # The update's achieved traffic over the GPU's copy
                    # bandwidth, per candidate (docs/algorithms.md §6).
                    **{
                        f"{name.replace(' ', '_')}_of_bandwidth": round(value, 4)
                        for name, value in row.get("traffic", {}).items()
                    },
                    **{
                        f"{name.replace(' ', '_')}_over_base": round(value / seconds_of["base"], 3)
                        for name, value in seconds_of.items()
                        if name != "base"
                    },
                }
            )
    return found


def _optimizer_type(config_path):
    sys.path.insert(0, ROOT)
    from tf_vrgd import config

    block = config.optimization_block(config.load(config_path))
    return block["optimizer"]["type"]


def _tiny_sizes(task):
    sys.path.insert(0, ROOT)
    from tf_vrgd.experiments import tasks

    return tasks.TINY_SIZES[task]


def tasks(args, gpus, timeout):
    results = []
    for name, config_file in TASKS.items():
        path = os.path.join(PAPER, config_file)
        replicas = 2 if args.dry_run else max(gpus, 1)
        # One GPU: two accumulated micro-steps give the twin its k = 2.
        accumulation = 2 if not args.dry_run and gpus == 1 else 1
        per_replica = 2 if args.dry_run else GPU_BATCH[name]
        overrides = {
            "task.train_data.global_batch_size": per_replica * replicas * accumulation,
            "trainer.checkpoint_interval": 2 if args.dry_run else 10,
            **(_tiny_sizes(DRY_TASKS[name]) if args.dry_run else {}),
        }
        if accumulation > 1:
            kind = _optimizer_type(path)
            overrides[f"trainer.optimizer_config.optimizer.{kind}.gradient_accumulation_steps"] = (
                accumulation
            )
        output = os.path.join(args.output, name)
        command = [sys.executable, "-m", "tf_vrgd.experiments.train", "--config", path]
        command += ["--output", output, "--synthetic", "--compare", "--restart", "--verbose", "0"]
        command += ["--replicas", str(replicas), "--train-steps", "4" if args.dry_run else "30"]
        for key, value in overrides.items():
            command += ["--override", f"{key}={json.dumps(value)}"]
        code, seconds, _ = _run(
            command, os.path.join(args.output, f"{name}.log"), timeout / len(TASKS)
        )
        found = {"config": config_file, "exit_code": code, "seconds": round(seconds, 1)}
        summary = os.path.join(output, "summary.json")
        if code == 0 and os.path.exists(summary):
            with open(summary) as f:
                runs = json.load(f)["runs"]
            found["runs"] = [
                {
                    "run": r["run"],
                    "examples_per_second": round(r["examples_per_second"], 2),
                    "first_interval_seconds": round(r["first_interval_seconds"], 2),
                }
                for r in runs
            ]
            twin = next(r for r in runs if r["run"].startswith("vr_"))
            base = next(r for r in runs if not r["run"].startswith("vr_"))
            found["vr_over_base_examples_per_second"] = round(
                twin["examples_per_second"] / base["examples_per_second"], 3
            )
        results.append(found)
    return results


def _gpu_count():
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return 0
    return sum(line.startswith("GPU ") for line in listed.stdout.splitlines())


def main(argv=None):
    args = parse_args(argv)
    if args.time_limit is None:
        # On CPU the dry run shares the machine with the test suite: its
        # limit only guards against a hang.
        args.time_limit = 1800.0 if args.dry_run else 470.0
    os.makedirs(args.output, exist_ok=True)
    gpus = 0 if args.dry_run else _gpu_count()
    if not args.dry_run and not gpus:
        print("device_check: no NVIDIA GPU found (nvidia-smi -L); --dry-run runs on CPU.")
        return 2
    report = {
        "dry_run": args.dry_run,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = os.path.join(args.output, "device_check.json")
    start = time.monotonic()
    steps = {"environment": None, "tests": tests, "bench": bench, "tasks": tasks}
    for step, run in steps.items():
        # What earlier steps left unused goes to the later ones.
        left = args.time_limit - (time.monotonic() - start)
        names = list(SHARES)
        budget = left * SHARES[step] / sum(SHARES[n] for n in names[names.index(step) :])
        if step == "environment":
            report[step] = environment(args, gpus, budget)
        else:
            report[step] = run(args, gpus, budget)
        report["seconds"] = round(time.monotonic() - start, 1)
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        print(f"device_check: {step} done ({report['seconds']} s)", flush=True)
        if step == "environment" and not args.dry_run and not report[step].get("tensorflow_gpus"):
            print(
                f"device_check: {gpus} GPU(s) listed, but TensorFlow "
                f"{report[step].get('tensorflow', '(not importable)')} sees none: install "
                "TensorFlow with its CUDA libraries (pip install 'tensorflow[and-cuda]'; "
                "TensorFlow 2.21 loads CUDA 12's). environment.log has what it printed."
            )
            return 3
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
