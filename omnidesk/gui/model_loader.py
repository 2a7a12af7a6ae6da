"""Which model to open and loading it (runs on a worker thread, never on the UI thread).

The best model available: the one configured (command line or the window's
model picker), else a checkpoint found in the local Hugging Face cache, else
the demo model (random weights: its replies are noise).  The rule
itself lives in :mod:`omnidesk.models.choice` (Qt-free), shared with the CLI.

Which family a checkpoint belongs to (turn-based or full duplex), how to load
it, its demo and its demo notice come from the family registry
(:mod:`omnidesk.models.families`).
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
    """A loaded model and the executor every session of this model uses."""

    choice: ModelChoice
    stack: object  # the family's loaded weights where it has them (Loaded.stack), else None
    executor: object  # omnidesk.engine.executor.Executor or engine.duplex.DuplexExecutor
    demo: bool
    device: str
    voices: list[str] = field(default_factory=list)
    family_title: str = ""  # what a person calls the family
    demo_notice: str = ""  # the family's words on its demo (shown when ``demo``)
    duplex: bool = False  # full duplex (no turns, one step per frame)
    model_info: dict = field(default_factory=dict)  # the family's description for the timeline
    remote: str | None = None  # the server's URL when the model runs on a vLLM-Omni server (omnidesk.remote)
    int8_on_load: bool = False  # the family can quantize this checkpoint's weights to int8 while loading

    @property
    def name(self) -> str:
        return self.choice.name

    def timeline_model_info(self) -> dict:
        """The ``model`` object of the timeline JSON (what `omnidesk talk` writes)."""
        return {**self.model_info, "name": self.name, "demo": self.demo}


@dataclass(frozen=True)
class CatalogEntry:
    """One item of the model picker."""

    source: str
    label: str
    usable: bool
    demo: bool = False


def catalog(find=None) -> list[CatalogEntry]:
    """Everything the model picker can offer: cached/found checkpoints, then each family's demo
    (made on first use)."""
    from omnidesk.models.families import FAMILIES

    if find is None:
        from omnidesk.models.inventory import find_checkpoints as find
    entries = []
    for info in find():
        if info.demo:
            continue  # the demo entries below stand for every demo checkpoint
        label = info.name if info.loads else f"{info.name} ({info.state})"
        entries.append(CatalogEntry(info.name, label, info.loads))
    for f in FAMILIES:
        label = ("Demo model" if f.demo_name == DEMO else f"{f.title} demo"
                 + (" (full duplex)" if f.duplex else "")) + " (replies are noise)"
        entries.append(CatalogEntry(f.demo_name, label, True, demo=True))
    return entries


def load_model(choice: ModelChoice, device: str | None, progress: Callable[[str], None],
               quantize: str | None = None, compile: str | None = None) -> LoadedModel:
    """Resolve and load ``choice`` through its family (worker thread); ``quantize`` "int8" loads a float
    checkpoint's linears in int8 (families that cannot ignore it); ``compile`` is the decode-step
    setting (auto/on/off, omnidesk.models.runner).  Raises DeviceError (a ``device``
    this machine cannot use) and the loader's errors (CheckpointError, ModelTooLargeError, ...) for
    :func:`omnidesk.gui.errors.plain_message`."""
    from omnidesk.remote.frontend import is_server_url

    if is_server_url(choice.source):  # "Server…": the model runs on a vLLM-Omni server, nothing loads here
        from omnidesk.remote.frontend import load_server_model

        return load_server_model(choice, progress, LoadedModel)
    from omnidesk.models.families import LoadOptions, demo_family, resolve_model

    device = check_device(device) if device else default_device()
    if demo_family(choice.source) is not None:  # "demo", "moshi-demo": made on first use
        progress("Preparing the demo model")
    root, family = resolve_model(choice.source, make_demo=True)
    progress(f"Loading {choice.name} on {device}")
    int8 = quantize == "int8" and "quantize" not in family.ignored_options
    loaded = family.load(root, device, LoadOptions(quantize="int8" if int8 else None, compile=compile))
    if loaded.demo and demo_family(choice.source) is None:  # a demo opened from a folder is still the demo
        choice = ModelChoice(choice.source, "Demo model" if family.demo_name == DEMO else f"{family.title} demo model",
                             choice.why)
    log.info("loaded %s (%s%s) from %s on %s (%s)", choice.name, family.title, ", full duplex" if family.duplex else "",
             root, loaded.device, choice.why)
    if loaded.model_info.get("quantization"):  # which weights and which matmul path run
        log.info("weights: %s", loaded.model_info["quantization"]["summary"])
    runner = getattr(loaded.executor, "runner", None)
    if runner is not None:
        log.info("decode steps: %s", runner.describe())
    return LoadedModel(choice=choice, stack=loaded.stack, executor=loaded.executor, demo=loaded.demo,
                       device=loaded.device, voices=loaded.voices, family_title=family.title,
                       demo_notice=family.demo_notice, duplex=family.duplex, model_info=loaded.model_info,
                       int8_on_load="quantize" not in family.ignored_options)
