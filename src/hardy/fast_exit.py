"""Ending a process without the interpreter's teardown, where nothing is left to tear down.

Finalizing an interpreter that imported torch takes seconds on a small machine (its whole module graph
collected and torn down), after every launcher and torchrun agent of a run, while the job waits. The
processes that skip it hold nothing a finalizer must write: their workers have exited and their own
output is flushed here.
"""
from __future__ import annotations

import logging
import os
import sys
from typing import NoReturn

_requested = False


def request() -> None:
    """This process ends with `exit_now` once the command returns (a launcher, after its workers)."""
    global _requested
    _requested = True


def requested() -> bool:
    return _requested


def exit_now(code: int) -> NoReturn:
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
