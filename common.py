"""The ground floor: what every other file of this project uses and none of them owns.

- Files: `cache_root` (where everything fetched or fitted once is kept), `write_atomic` and
  `write_json` (the one way a file is written), JSONL logs that survive a kill mid-line.
- The lock: `claim` / `release` / `exclusive_dir` make a process the only writer of a directory.
- Progress: `Pacer` (when the next progress line is due), `duration` and `hms`.
- Command lines: `HelpFormatter` (every default in --help, never "(default: None)").

Nothing here knows about models, probes, environments or GRPO, and this file imports no other
file of the project.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import tempfile
import time
from pathlib import Path


# ----------------------------------------------------------------------------------------------
# Files

def cache_root() -> Path:
    """Where everything fetched or fitted once is kept: Hub checkpoints, the released data, LLM
    judgments, the built-in policy's probes and base evaluations. $PAIR_CACHE, else
    ~/.cache/pair."""
    return Path(os.environ.get("PAIR_CACHE") or Path.home() / ".cache" / "pair").expanduser()


# The process's umask, read once at import: os.umask can only be read by setting it, and setting
# it while another thread creates a file would give that file the wrong mode.
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def write_atomic(path: Path, data: bytes | str) -> None:
    """The one way this project writes a file: a unique temporary file beside it, then
    os.replace, so a reader (or a run killed mid-write) sees the old file or the new one."""
    path = Path(path)
    data = data.encode() if isinstance(data, str) else data
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        # mkstemp creates the file 0600; the result gets the mode open() would have given it
        os.fchmod(fd, 0o666 & ~_UMASK)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def refuse_dir_out(path) -> None:
    """An --out that names a file to write, checked before any work: not a directory (else
    write_atomic would fail only at the end, naming its temporary file)."""
    if path is not None and Path(path).is_dir():
        raise SystemExit(f"error: --out {path} is a directory; name the file to write")


def write_json(path: Path, obj, indent: int = 1) -> None:
    write_atomic(path, json.dumps(obj, indent=indent) + "\n")


def append_jsonl(path: Path, record: dict):
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    """The records of a per-step JSONL log (metrics.jsonl, eval.jsonl): one JSON object with an
    integer "step" per line. A last line cut short by a kill is dropped (the step it logged is
    redone on resume); a broken line before the last one, or a record of another shape, is an
    error."""
    if not path.exists():
        return []
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    records = []
    for k, line in enumerate(lines):
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if k == len(lines) - 1:
                break
            raise SystemExit(f"{path}: line {k + 1} is not JSON ({e}); the log is damaged") \
                from e
        if not isinstance(record, dict) or type(record.get("step")) is not int:
            raise SystemExit(f"{path}: line {k + 1} is not a step's record (a JSON object with "
                             "an integer \"step\"); the log is damaged")
        records.append(record)
    return records


def truncate_jsonl(path: Path, last_step: int):
    """Keep the records up to `last_step`: what an interrupted run logged after its last
    checkpoint is redone on resume."""
    if not path.exists():
        return
    keep = [r for r in read_jsonl(path) if r["step"] <= last_step]
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in keep))


# ----------------------------------------------------------------------------------------------
# One writer per output directory

LOCK_FILE = ".lock"
_claims: dict[str, list] = {}       # resolved directory -> [its open lock file, claim depth]


def claim(directory, wait=None) -> Path:
    """Make this process the only writer of `directory` (created if needed) until it exits or
    calls release(); a directory another process holds is refused with its pid, or, with
    wait=log (a print-like function), waited for after saying so. Claims nest within a process.

    The lock is flock() on DIRECTORY/.lock: the kernel drops it when the holder exits, however
    it exits (kill -9 included), so there is no stale lock to judge by pid or age. A lock file
    created with O_EXCL would need such a rule, and a recycled pid defeats it. The file may be
    deleted while held (the holder removes OUT.parts when it is done), so a lock is only taken
    on the file that is still at that path."""
    import fcntl                    # POSIX only, so imported where it is needed
    directory = Path(directory)
    key = str(directory.resolve())
    held = _claims.get(key)
    if held is not None and _is_file_at(held[0], directory / LOCK_FILE):
        held[1] += 1
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
            _claims[key] = [f, 1]
            return directory
        f.close()                                   # locked a file that was just deleted
    raise SystemExit(f"{directory}: could not be locked (removed again and again meanwhile)")


def release(directory) -> None:
    held = _claims.get(str(Path(directory).resolve()))
    if held is not None:
        held[1] -= 1
        if held[1] == 0:
            del _claims[str(Path(directory).resolve())]
            held[0].close()                         # closing the file drops the lock


def holds(directory) -> bool:
    """Whether this process holds the claim on `directory`."""
    held = _claims.get(str(Path(directory).resolve()))
    return held is not None and _is_file_at(held[0], Path(directory) / LOCK_FILE)


@contextlib.contextmanager
def exclusive_dir(directory):
    """`with exclusive_dir(out):` claim() for the duration of the block."""
    claim(directory)
    try:
        yield Path(directory)
    finally:
        release(directory)


def _is_file_at(f, path: Path) -> bool:
    try:
        a, b = os.fstat(f.fileno()), os.stat(path)
    except FileNotFoundError:
        return False
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


# ----------------------------------------------------------------------------------------------
# Progress lines

def duration(seconds: float) -> str:
    """"42s" or "3m07s": the time left or taken, in a progress line."""
    seconds = int(round(seconds))
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


class Pacer:
    """When the next progress line is due. On a terminal: every `every` seconds. Into a file or
    a pipe (a log, read later): at most one line per 30 s and per 10% of the work, so that an
    hour of work is a dozen lines, not hundreds. The end of the work is always due."""

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


def hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m{seconds % 60:02d}s"


def num(x) -> str:
    return "n/a" if x is None else f"{x:.3f}"


# ----------------------------------------------------------------------------------------------
# Command lines

class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every default in --help, but never "(default: None)": a flag whose default is decided
    at run time (by the preset, or from another flag) says so in its own help text."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


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


# The range of a numeric flag: (test, what it must be), checked after parsing by check_ranges.

def at_least(low):
    return (lambda v: v >= low), f"at least {low}"


def within(low, high):
    return (lambda v: low <= v <= high), f"in [{low}, {high}]"


def positive():
    return (lambda v: 0 < v < math.inf), "a positive number"


def finite(low=-math.inf):
    return (lambda v: low <= v < math.inf), \
        "a finite number" + (f" >= {low}" if low > -math.inf else "")


# more threads than cores only slows a run down, and a huge count crashes torch's thread pool
THREADS = (lambda v: 1 <= v <= (os.cpu_count() or 1)), \
    f"between 1 and this machine's {os.cpu_count() or 1} cores"


def check_ranges(ap: argparse.ArgumentParser, args, ranges: dict) -> None:
    """ap.error for the first flag of `ranges` (name -> (test, what)) whose value, or one of its
    values, fails its test; a flag left at None is not checked (nan fails every test)."""
    for name, (ok, what) in ranges.items():
        value = getattr(args, name)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and not ok(v):
                ap.error(f"--{name.replace('_', '-')} must be {what}, got {v}")


# ----------------------------------------------------------------------------------------------
# Text that must stay UTF-8

# A code point in U+D800..U+DFFF left in a str is half of a UTF-16 pair (a JSON "\ud800"
# escape decodes to one): no UTF-8 text can hold it and the tokenizer refuses it.
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def holds_lone_surrogate(value) -> bool:
    """Whether a JSON value holds one anywhere, in a key or a string."""
    return bool(LONE_SURROGATE.search(json.dumps(value, ensure_ascii=False)))


def without_surrogates(text: str) -> str:
    """text with every unpaired surrogate replaced by U+FFFD (same length): whatever a policy or
    a data file wrote stays encodable."""
    return LONE_SURROGATE.sub("\ufffd", text)
