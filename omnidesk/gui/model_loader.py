"""Which model to open and loading it (runs on a worker thread, never on the UI thread).

The best model available: the one configured (command line or the window's
model picker), else a Qwen2.5-Omni checkpoint found in the local Hugging Face
cache, else the demo model (random weights: its replies are noise).  The rule
itself lives in :mod:`omnidesk.models.choice` (Qt-free), shared with the CLI.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable

from omnidesk.models.choice import DEMO, ModelChoice, check_device, choose_model, default_device

log = logging.getLogger("omnidesk.gui")

__all__ = ["DEMO", "CatalogEntry", "LoadedModel", "ModelChoice", "catalog", "choose_model", "default_device",
           "load_model"]


@dataclass
class LoadedModel:
    """A loaded stack and the executor every session of this model uses."""

    choice: ModelChoice
    stack: object  # omnidesk.models.loading.OmniStack
    executor: object  # omnidesk.engine.executor.Executor
    demo: bool
    device: str
    voices: list[str] = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.choice.name

    def timeline_model_info(self) -> dict:
        """The ``model`` object of the timeline JSON (what `omnidesk talk` writes)."""
        return {"path": str(self.stack.path), "name": self.name, "demo": self.demo,
                "dtype": str(self.stack.dtype).replace("torch.", "")}


@dataclass(frozen=True)
class CatalogEntry:
    """One item of the model picker."""

    source: str
    label: str
    usable: bool
    demo: bool = False


def catalog(find=None) -> list[CatalogEntry]:
    """Everything the model picker can offer: cached/found checkpoints, then the demo model."""
    if find is None:
        from omnidesk.models.inventory import find_checkpoints as find
    entries = []
    for info in find():
        if info.demo:
            continue  # the demo entry below stands for every demo checkpoint
        label = info.name if info.loads else f"{info.name} (damaged)"
        entries.append(CatalogEntry(info.name, label, info.loads))
    entries.append(CatalogEntry(DEMO, "Demo model (replies are noise)", True, demo=True))
    return entries


def load_model(choice: ModelChoice, device: str | None, progress: Callable[[str], None]) -> LoadedModel:
    """Resolve and load ``choice`` (worker thread).  Raises DeviceError (a ``device`` this machine
    cannot use) and the loader's errors (CheckpointError, ModelTooLargeError, ...) for
    :func:`omnidesk.gui.errors.plain_message`."""
    from omnidesk.engine.executors.qwen2_5_omni import executor_for
    from omnidesk.models.demo import is_demo, make_demo
    from omnidesk.models.loading import load_stack

    device = check_device(device) if device else default_device()
    source = choice.source
    if source == DEMO:
        progress("Preparing the demo model")
        source = str(make_demo())
    progress(f"Loading {choice.name} on {device}")
    stack = load_stack(source, device=device)
    progress("Preparing the conversation")
    executor = executor_for(stack)
    demo = is_demo(stack.config.raw)
    if demo and choice.source != DEMO:  # a demo checkpoint opened from a folder is still the demo
        choice = ModelChoice(choice.source, "Demo model", choice.why)
    loaded = LoadedModel(choice=choice, stack=stack, executor=executor, demo=demo,
                         device=str(stack.device), voices=list(stack.voices))
    log.info("loaded %s from %s on %s (%s)", choice.name, stack.path, stack.device, choice.why)
    return loaded

