"""Run-management helpers of the lab's scripts: argparse types, a claimed directory, a clock."""
from __future__ import annotations

import argparse
import contextlib
import math
from pathlib import Path

import grpo


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
    """`with exclusive_dir(out):` grpo.claim() for the duration of the block."""
    grpo.claim(directory)
    try:
        yield Path(directory)
    finally:
        grpo.release(directory)


def hms(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds // 60 % 60:02d}m{seconds % 60:02d}s"
