"""What every benchmark script's JSON has in common: the ``machine`` section and writing the file.

Each script keeps its own keys (other tooling and the tests read them), so :func:`machine` takes
the names the script uses, in its order: the standard facts below by name, anything else as a
keyword.  :func:`write` and :func:`report` put the JSON in ``--out`` (its folder made first;
:func:`prepare` makes it before the run).
"""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"  # where --out points by default


def _torch():
    import torch  # only when asked for: some benches (aec, live_latency) never load it

    return torch


def processor() -> str:
    """The CPU's name as Python knows it (the machine's architecture where it does not)."""
    return platform.processor() or platform.machine()


# the standard facts, under the names the scripts use for them
FACTS = {
    "platform": platform.platform,
    "processor": processor,
    "cpu": processor,
    "python": platform.python_version,
    "cpus": os.cpu_count,
    "cpu_count": os.cpu_count,
    "cores": lambda: os.cpu_count() or 1,
    "torch": lambda: _torch().__version__,
    "cuda": lambda: _torch().version.cuda,
    "threads": lambda: _torch().get_num_threads(),
}


def load_avg() -> list[float]:
    """The 1, 5 and 15 minute load averages, rounded to 0.01."""
    return [round(x, 2) for x in os.getloadavg()]


def machine(*facts: str, **extra) -> dict:
    """The ``machine`` section: each of ``facts`` (names in :data:`FACTS`) as it stands now, then
    ``extra`` as given, in that order."""
    return {**{name: FACTS[name]() for name in facts}, **extra}


def when() -> str:
    """Now, UTC, to the second (ISO 8601)."""
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def prepare(out: str | Path) -> Path:
    """``out`` as a Path, its folder made now: a run that cannot write its JSON fails before it measures."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    return path


def write(result: dict, out: str | Path | None, indent: int = 2, newline: bool = False) -> str:
    """``result`` as JSON text, written to ``out`` (its folder made; nothing written when None).
    ``newline``: end the file with one."""
    text = json.dumps(result, indent=indent)
    if out is not None:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n" if newline else text)
    return text


def report(result: dict, out: str | Path | None, indent: int = 2, newline: bool = False) -> str:
    """:func:`write`, then the same JSON on stdout."""
    text = write(result, out, indent, newline)
    print(text)
    return text
