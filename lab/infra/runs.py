"""Run-management helpers of the lab's scripts: argparse types, a claimed directory, a clock,
the keys of the caches kept across runs."""
from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import os
import shutil
import subprocess
import time
from pathlib import Path

import model


def positive_number(text: str) -> float:
    """An argparse type: a finite number > 0 (nan and inf fail too)."""
    x = float(text)
    if not 0 < x < math.inf:
        raise argparse.ArgumentTypeError(f"must be a positive number, not {text}")
    return x


def int_at_least(low: int):
    """An argparse type: an integer >= low."""
    def parse(text: str) -> int:
        n = int(text)
        if n < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, not {text}")
        return n
    parse.__name__ = "int"              # argparse's "invalid int value: 'x'"
    return parse


def within(low, high):
    """A range of grpo.check_ranges: low <= v <= high."""
    return (lambda v: low <= v <= high), f"in [{low}, {high}]"


@contextlib.contextmanager
def exclusive_dir(directory):
    """`with exclusive_dir(out):` claim() for the duration of the block."""
    claim(directory)
    try:
        yield Path(directory)
    finally:
        release(directory)


def hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m{seconds % 60:02d}s"


LOCK_FILE = ".lock"
_claims: dict[str, list] = {}       # resolved directory -> [its open lock file, claim depth]


def claim(directory, wait=None) -> Path:
    """Make this process the only writer of `directory` (created if needed) until it exits or
    release()s it; claims nest. One another process holds is refused with its pid, or, with
    wait=log, waited for. flock() on DIRECTORY/.lock dies with its holder (kill -9 included):
    no stale lock to judge. The file may be deleted while held: only the one at the path counts."""
    import fcntl                    # POSIX only
    directory = Path(directory)
    if holds(directory):
        _claims[str(directory.resolve())][1] += 1
        return directory
    for _ in range(100):
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except (FileExistsError, NotADirectoryError):
            raise SystemExit(f"{directory}: not a directory (an output directory is needed "
                             "here)") from None
        except OSError as e:
            raise SystemExit(f"{directory}: cannot create it ({e.strerror})") from None
        try:
            f = open(directory / LOCK_FILE, "a+")   # "a+": the holder's pid stays readable
        except FileNotFoundError:                   # the directory was removed meanwhile
            continue
        except OSError as e:
            raise SystemExit(f"{directory}: cannot write there ({e.strerror})") from None
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            pid = f.read().strip() or "?"
            if wait is None:
                f.close()
                raise SystemExit(f"{directory} is in use by pid {pid}; wait for that process to "
                                 "finish (or stop it), or write somewhere else") from None
            wait(f"{directory} is in use by pid {pid}: waiting for it", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        if _is_file_at(f, directory / LOCK_FILE):
            f.truncate(0)
            f.write(f"{os.getpid()}\n")
            f.flush()
            _claims[str(directory.resolve())] = [f, 1]
            return directory
        f.close()                                   # locked a file that was just deleted
    raise SystemExit(f"{directory}: could not be locked (removed again and again meanwhile)")


def release(directory) -> None:
    key = str(Path(directory).resolve())
    if key in _claims:
        _claims[key][1] -= 1
        if _claims[key][1] == 0:
            # the lock file goes first, then closing it drops the lock: a process waiting on it
            # finds it deleted and takes a fresh one (claim), and nothing is left behind
            f = _claims.pop(key)[0]
            if _is_file_at(f, Path(directory) / LOCK_FILE):
                (Path(directory) / LOCK_FILE).unlink()
            f.close()


def holds(directory) -> bool:
    """Whether this process holds the claim on `directory`."""
    held = _claims.get(str(Path(directory).resolve()))
    return held is not None and _is_file_at(held[0], Path(directory) / LOCK_FILE)


def _is_file_at(f, path: Path) -> bool:
    try:
        a, b = os.fstat(f.fileno()), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


PROBES_FORMAT = "grpo-probes/3"   # 3: the on-policy corpus balanced within each kind of turn


def policy_hash(model_dir) -> str:
    """The key of everything cached for one policy: model.checkpoint_sha256 of its files."""
    try:
        digest = model.checkpoint_sha256(model_dir)
    except model.CheckpointError as e:
        raise SystemExit(f"{model_dir}: nothing to key this policy's cache on ({e})") from None
    return hashlib.sha256(f"{PROBES_FORMAT}\0{digest}".encode()).hexdigest()[:16]


def settings_hash(settings: dict) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:12]


class Pacer:
    """When the next progress line is due: on a terminal every `every` seconds; into a file or
    pipe at most one per 30 s and per 10% of the work. The end of the work is always due."""

    def __init__(self, total: float, stream, every: float = 5.0, clock=time.monotonic):
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.total, self.clock = total, clock
        self.every, self.least = (every, 0.0) if self.tty else (30.0, total / 10)
        self.last_time, self.last_done = clock(), 0.0

    def due(self, done: float) -> bool:
        now = self.clock()
        if done >= self.total or (now - self.last_time >= self.every
                                  and done - self.last_done >= self.least):
            self.last_time, self.last_done = now, done
            return True
        return False


def forget_failed(args) -> None:
    """A run that failed before logging anything leaves nothing behind: its args.json, the
    lab's refit/, the lock and the directory go (only while this process holds OUT)."""
    out = Path(args.out)
    if not holds(out) or any(out.glob("checkpoint-*")) \
            or any((out / n).exists() for n in ("metrics.jsonl", "eval.jsonl")):
        return
    (out / "args.json").unlink(missing_ok=True)
    shutil.rmtree(out / "refit", ignore_errors=True)
    (out / LOCK_FILE).unlink(missing_ok=True)
    _claims.pop(str(out.resolve()))[0].close()
    with contextlib.suppress(OSError):
        out.rmdir()                     # only if nothing else is in it


def claim_out(out: Path) -> None:
    """grpo.py's run directory: one run per OUT (two would interleave metrics and checkpoints),
    held until the process exits."""
    if not holds(out):
        claim(out)


CODE_FILE = "code.json"     # in a run's directory: the code each segment of the run ran


def code_version(root: Path) -> dict:
    """The repository's commit at `root` and whether its tracked files are as committed (an
    untracked file, a run's records say, does not count); None each where git cannot tell."""
    def git(*argv) -> str | None:
        try:
            r = subprocess.run(["git", "-C", str(root), *argv], capture_output=True, text=True,
                               timeout=30)
        except (OSError, subprocess.SubprocessError):
            return None
        return r.stdout.strip() if r.returncode == 0 else None
    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    clean = None if status is None else status == ""
    return {"commit": commit, "clean": clean}


def record_code(out: Path, step: int, root: Path) -> None:
    """Append to out/code.json the code this segment of a run runs from `step` on (a resumed run
    adds a segment), with the time it started, written atomically."""
    path = out / CODE_FILE
    segments = json.loads(path.read_text()) if path.exists() else []
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    segments.append({"from_step": step, "started": stamp, **code_version(root)})
    model.write_atomic(path, json.dumps(segments, indent=1) + "\n")
