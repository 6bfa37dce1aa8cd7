"""A run folder and the `--output` folder above it: the metrics records,
the checkpoints (written whole, the unreadable ones named and skipped), the
settings a resume must match, each run's optimization block and the
summary."""

import contextlib
import csv
import fcntl
import json
import os
import shutil

from tf_vrgd.experiments.experiment_config import Experiment


def read_records(path, before_epoch):
    """The metrics records of epochs < `before_epoch` (a resumed run drops
    any record written after its last checkpoint)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r["epoch"] < before_epoch]


def _replace(path, write):
    """Writes through `write(file)` to a temporary file, then renames it."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", newline="") as f:
        write(f)
    os.replace(tmp, path)


def write_records(run_dir, records):
    """metrics.jsonl and metrics.csv, each replaced whole."""
    _replace(
        os.path.join(run_dir, "metrics.jsonl"),
        lambda f: f.writelines(json.dumps(r) + "\n" for r in records),
    )
    keys = []
    for r in records:
        keys += [k for k in r if k not in keys]

    def table(f):
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(records)

    _replace(os.path.join(run_dir, "metrics.csv"), table)


def _checkpoints(run_dir):
    """{completed epochs: path} of the run's checkpoints."""
    found = {}
    for name in os.listdir(run_dir):
        if name.startswith("checkpoint-epoch") and name.endswith(".keras"):
            found[int(name[len("checkpoint-epoch") : -len(".keras")])] = os.path.join(run_dir, name)
    return found


def resumable_checkpoints(run_dir, name):
    """{completed epochs: path} of the run's checkpoints, the unreadable ones
    (an empty or truncated file: a full disk, a copy cut short) left out,
    each named in a printed line; {} where `run_dir` does not exist."""
    if not os.path.isdir(run_dir):
        return {}
    checkpoints = _checkpoints(run_dir)
    for epochs in sorted(checkpoints, reverse=True):
        problem = _checkpoint_problem(checkpoints[epochs])
        if not problem:
            break
        print(
            f"[{name}] {checkpoints.pop(epochs)} is unreadable ({problem}); "
            "resuming from the newest intact checkpoint before it, if any",
            flush=True,
        )
    return checkpoints


def _checkpoint_problem(path):
    """Why the `.keras` file (a zip archive) at `path` cannot be read; ""
    if every member reads back with its checksum."""
    import zipfile

    try:
        with zipfile.ZipFile(path) as archive:
            bad = archive.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as error:
        return f"{type(error).__name__}: {error}"
    return f"member {bad} fails its checksum" if bad else ""


def remove_partial_checkpoints(run_dir):
    """Removes the `tmp<pid>.keras` files that `save_checkpoint` leaves when
    killed while writing (one process trains a run folder at a time)."""
    for entry in os.listdir(run_dir):
        if entry.startswith("tmp") and entry.endswith(".keras"):
            os.remove(os.path.join(run_dir, entry))


def save_checkpoint(model, run_dir, epochs_done, keep=1):
    """Model and optimizer after `epochs_done` epochs, written under a
    temporary name and renamed (a kill leaves the previous one intact); all
    but the newest `keep` checkpoints are removed afterwards. A write that
    fails (a full disk) removes its partial file and stops the run, naming
    the path and the cause; a rerun resumes from the checkpoint before."""
    path = os.path.join(run_dir, f"checkpoint-epoch{epochs_done}.keras")
    tmp = os.path.join(run_dir, f"tmp{os.getpid()}.keras")
    try:
        model.save(tmp)
        os.replace(tmp, path)
    except OSError as error:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise SystemExit(
            f"vrgd-train: writing the checkpoint {path} failed "
            f"({error.strerror or error}); the checkpoint before it is intact: free "
            "the room and rerun the command to resume."
        ) from None
    for epochs, old in _checkpoints(run_dir).items():
        if epochs <= epochs_done - keep:
            os.remove(old)


def learning_rate(optimizer):
    """The record's `learning_rate`: an `AdaScale`'s rate applied at the last
    update (its gain times the base rate at tau), otherwise the optimizer's
    rate at its update count."""
    from tf_vrgd.adascale import find_adascale

    adascale = find_adascale(optimizer)
    if adascale is not None:
        return adascale.applied_learning_rate
    return float(optimizer.learning_rate.numpy())


def gsnr_entries(model, vr_optimizer):
    """`{"<log key>/<variable path>": value}` of the VR optimizer's GSNR
    statistics since the epoch began (GSNRMonitor resets them at epoch
    start); empty without a VR optimizer."""
    from tf_vrgd import statistics

    entries = {}
    if vr_optimizer is None:
        return entries
    for path, stats in vr_optimizer.gsnr_statistics().items():
        # A loaded model's paths lack the model-name prefix of a fresh one;
        # keys must not change when a run resumes.
        path = path.removeprefix(f"{model.name}/")
        for column, key in statistics.LOG_KEYS.items():
            entries[f"{key}/{path}"] = stats[column]
    return entries


LOCK_FILE = ".lock"


def prepare_folder(output):
    """Makes `--output` (if missing) and checks that it can be written,
    naming the path and the cause otherwise (a file of that name, a
    read-only mount, no permission)."""
    try:
        os.makedirs(output, exist_ok=True)
        probe = os.path.join(output, f".write-test-{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as error:
        cause = error.strerror or str(error)
        if os.path.exists(output) and not os.path.isdir(output):
            cause = "a file of that name exists"
        raise SystemExit(
            f"vrgd-train: --output {output} cannot be used as the run's folder ({cause})."
        ) from None


# The lock files this process holds, by folder (open until it ends).
_HELD = {}


def lock_folder(output):
    """Takes `output` for this process (once; a second call is a no-op): an
    exclusive lock on its lock file, held until the process ends, killed
    or not, when the system releases it. Raises SystemExit, naming the
    holder, if another process holds it (a second start would train the
    same runs and clean up the first one's checkpoint files mid-save)."""
    key = os.path.realpath(output)
    if key in _HELD:
        return
    path = os.path.join(output, LOCK_FILE)
    lock = open(path, "a+")  # noqa: SIM115 (held open until the process ends)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        lock.seek(0)
        holder = lock.read().strip() or "another process"
        lock.close()
        raise SystemExit(
            f"vrgd-train: {output} is in use by another run ({holder}); wait for it to end, "
            "or use another --output."
        ) from None
    lock.seek(0)
    lock.truncate()
    lock.write(f"process {os.getpid()}\n")
    lock.flush()
    _HELD[key] = lock


SETTINGS_FILE = "settings.json"
# The settings' key of the input files (`{split: {file: bytes}}`), compared
# file by file.
INPUT_FILES = "input_files"


def check_settings(output, settings, restart, write=True, accept_input_change=False):
    """Records `settings` in `output` (if `write`), or checks them against
    the ones a previous start recorded there: a resume must continue the
    same run. With `restart`, the folder's earlier results are discarded
    instead. With `accept_input_change`, a resume over other input files
    goes on (and records them) instead of being refused."""
    path = os.path.join(output, SETTINGS_FILE)
    if restart:
        for entry in os.listdir(output):
            run_dir = os.path.join(output, entry)
            if os.path.isdir(run_dir) and (
                _checkpoints(run_dir) or os.path.exists(os.path.join(run_dir, "metrics.jsonl"))
            ):
                shutil.rmtree(run_dir)
        if os.path.exists(path):
            os.remove(path)
    if os.path.exists(path):
        with open(path) as f:
            recorded = json.load(f)
        from tf_vrgd.experiments import fields

        # Compared field by field (dotted paths into nested blocks), so that
        # the message names the fields that changed, not the whole config.
        # The input files are compared file by file below.
        files_then = recorded.pop(INPUT_FILES, None)
        recorded = fields.leaves(recorded)
        current = {k: v for k, v in settings.items() if k != INPUT_FILES}
        current = fields.leaves(json.loads(json.dumps(current)))  # as JSON reads it back
        missing = "(unset)"
        changed = sorted(
            k
            for k in set(recorded) | set(current)
            if recorded.get(k, missing) != current.get(k, missing)
        )
        if changed:
            details = "; ".join(
                f"{k}: {_short(recorded.get(k, missing))} then, "
                f"{_short(current.get(k, missing))} now"
                for k in changed
            )
            raise SystemExit(
                f"vrgd-train: {output} holds a run started with other settings ({details}). "
                "Resuming would continue that run with these settings. Use a new --output, "
                "or pass --restart to discard the folder's results and start over."
            )
        # A folder from before the files were recorded has none to compare.
        files_now = settings.get(INPUT_FILES, {})
        changes = input_changes(files_then, files_now) if files_then is not None else []
        if not changes:
            return
        if not accept_input_change:
            raise SystemExit(
                f"vrgd-train: {output} holds a run that read other input files "
                f"({'; '.join(changes)}). Resuming would read on in a stream that is "
                "neither the uninterrupted run's nor the new files' from the start. "
                "Restore the files, use a new --output, pass --restart to start over, "
                "or pass --accept-input-change to resume on these files."
            )
        print(f"vrgd-train: resuming on changed input files ({'; '.join(changes)})", flush=True)
    if write:
        _replace(path, lambda f: json.dump(settings, f, indent=2, sort_keys=True))


def input_changes(then, now):
    """What differs between two ``{split: {file: bytes}}`` records, one
    text per split and kind of change (removed, added, resized)."""
    changes = []
    for split in sorted(set(then) | set(now)):
        before, after = then.get(split, {}), now.get(split, {})
        removed = sorted(set(before) - set(after))
        added = sorted(set(after) - set(before))
        resized = sorted(f for f in set(before) & set(after) if before[f] != after[f])
        if removed:
            changes.append(f"task.{split}_data: {', '.join(removed)} removed")
        if added:
            changes.append(f"task.{split}_data: {', '.join(added)} added")
        if resized:
            sizes = ", ".join(f"{f} {before[f]} then, {after[f]} bytes now" for f in resized)
            changes.append(f"task.{split}_data: {sizes}")
    return changes


def _short(value):
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 80 else text[:77] + "..."


def train_each(args, experiment: Experiment, train_one, write=True):
    """`{run name: records}`: each run of the experiment (the config's, then
    with --compare its twin) trained by `train_one(name, block, run_dir)`,
    its optimization block written beside it (if `write`)."""
    runs = {}
    for name, block in experiment.runs(args.compare):
        print(f"\n=== {name} ===", flush=True)
        if write:
            with open(os.path.join(args.output, f"{name}.optimization.json"), "w") as f:
                json.dump(block, f, indent=2)
        runs[name] = train_one(name, block, os.path.join(args.output, name))
    return runs


def write_summary(args, experiment: Experiment, rows, format_rows):
    """summary.json and summary.txt in --output; returns the table."""
    table = format_rows(rows)
    with open(os.path.join(args.output, "summary.json"), "w") as f:
        json.dump({"config": args.config, "note": experiment.note, "runs": rows}, f, indent=2)
    with open(os.path.join(args.output, "summary.txt"), "w") as f:
        f.write(table + "\n")
    return table
