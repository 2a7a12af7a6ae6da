"""The model families OmniDesk runs: the one place that names them.

Each family is one folder under ``omnidesk/models/`` (its modules, weight map,
loader, executor, demo recipe, memory estimate and verifier).  This registry
maps a family to those pieces; everything that must pick a family (the CLI,
the window, the inventory, ``models verify/list/download``) asks
:func:`family_of` / :func:`resolve_model` / :func:`load_model` instead of
testing names itself.  Adding a family = its folder + one :class:`Family`
entry in :data:`FAMILIES`.

A family is either turn-based (Qwen2.5-Omni, Qwen3-Omni: the engine decides when the user
finished and the executor replies, :class:`~omnidesk.engine.executor.Executor`)
or full duplex (Moshi: one step per 80 ms frame, the model decides when to
talk, :class:`~omnidesk.engine.duplex.DuplexExecutor`).  ``make_engine`` picks
the engine from the executor.

The family modules are imported on first use, so reading the registry costs
nothing.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import checkpoint
from .catalog import PUBLISHED, Recommendation
from .checkpoint import CheckpointError, ConfigError, VerifyReport


@dataclass
class LoadOptions:
    """What a front end may ask of any family's loader; a family ignores what it has no use for
    (``ignored_by`` says which, so the CLI can say so)."""

    greedy: bool = False
    seed: int = 0
    voice: str | None = None
    max_text_tokens: int | None = None
    max_codec_tokens: int | None = None
    quantize: str | None = None  # "int8": weight-only int8 made on load (4-bit comes from the checkpoint)
    compile: str | None = None  # decode steps: "auto" (None), "off", "on" (omnidesk.models.runner.resolve_mode)


@dataclass
class Loaded:
    """A loaded model, ready for an engine."""

    family: "Family"
    root: Path
    executor: Any  # Executor (turn-based) or DuplexExecutor (duplex)
    device: str
    demo: bool
    voices: list[str]
    model_info: dict  # the timeline's "model" section
    stack: Any = None  # the family's loaded weights where a front end needs them (Qwen: OmniStack)


@dataclass(frozen=True)
class Family:
    name: str  # "qwen2_5_omni", "moshi", "qwen3_omni"
    title: str  # what a person calls it
    duplex: bool  # full duplex (DuplexExecutor) rather than turn-based (Executor)
    detect: Callable[[Path], bool]  # is this checkpoint directory one of ours?
    demo_name: str  # what names the built-in demo wherever a model is asked for
    make_demo: Callable[..., Path]  # (dir=None, force=False) -> the demo's directory
    demo_dir: Callable[[], Path]  # where the default demo lives (made or not)
    is_demo: Callable[[Path], bool]  # is this checkpoint directory the demo?
    demo_notice: str
    load: Callable[[Path, str, LoadOptions], Loaded]  # (root, device, options)
    verify: Callable[[Path, VerifyReport, bool], None]  # (root, report, load_test): problems into the report
    voices: Callable[[Path], list[str]]  # voice names ([] for a one-voice model)
    declared_dtype: Callable[[Path], str | None]  # the dtype its config declares, if any
    input_rate: Callable[[Path], int]  # the rate front ends read sound files at: what the model hears
    repos: dict[str, Recommendation] = field(default_factory=dict)  # published repos `models download` knows
    ignored_options: tuple[str, ...] = ()  # LoadOptions fields it has no use for
    # The unstreamed one-turn tools (`omnidesk reply`, `omnidesk bench`, the terminal check turn): a module
    # with generate_reply(stack, wave, ...), talker_defaults(stack, greedy), speak(stack, reply, voice, seed)
    # -> (audio, rate, notes) and run_bench(stack, ...); None
    # where the family has none (a full-duplex model has no turn to run on its own).
    turn_tools: Callable[[], Any] | None = None
    # `models list`: the checkpoint's weight quantization in words (None: float weights), and the GPU memory
    # (bytes) of each way it can run, e.g. {"bfloat16": ..., "int8": ...} ({}: not estimated)
    quantization: Callable[[Path], str | None] = lambda root: None
    memory_modes: Callable[[Path], dict[str, int]] = lambda root: {}
    # Why OmniDesk cannot run this (intact) checkpoint, from its config.json alone (None: it can):
    # `models download` asks before fetching the weights, `models verify` reports it
    unsupported: Callable[[Path], str | None] = lambda root: None


def _config(root: Path) -> dict | None:
    try:
        d = json.loads((Path(root) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return d if isinstance(d, dict) else None


# ---------------------------------------------------------------- Qwen2.5-Omni

def _qwen_detect(root: Path) -> bool:
    d = _config(root)
    return d is not None and d.get("model_type") == "qwen2_5_omni"


def _qwen_make_demo(dir=None, force: bool = False) -> Path:
    from .qwen2_5_omni.demo import make_demo

    return make_demo(dir, force=force)


def _qwen_demo_dir() -> Path:
    from .qwen2_5_omni.demo import default_demo_dir

    return default_demo_dir()


def _qwen_is_demo(root: Path) -> bool:
    from .qwen2_5_omni.demo import is_demo

    return is_demo(_config(root) or {})


def _qwen_load(root: Path, device: str, options: LoadOptions) -> Loaded:
    from .qwen2_5_omni.demo import is_demo
    from .qwen2_5_omni.executor import executor_for
    from .qwen2_5_omni.loading import load_stack

    stack = load_stack(root, device=device, quantize=options.quantize)
    if options.voice and options.voice not in stack.voices:
        raise CheckpointError(f"unknown voice '{options.voice}'; this model has: "
                              f"{', '.join(stack.voices) or 'no voices'}")
    executor = executor_for(stack, greedy=options.greedy, max_text_tokens=options.max_text_tokens,
                            max_codec_tokens=options.max_codec_tokens, compile=options.compile)
    demo = is_demo(stack.config.raw)
    info = {"path": str(stack.path), "family": "qwen2_5_omni", "demo": demo,
            "dtype": str(stack.dtype).replace("torch.", ""), "decode": executor.runner.mode}
    if stack.quantization is not None:
        info["quantization"] = stack.quantization
    return Loaded(QWEN, root, executor, str(stack.device), demo, list(stack.voices), info, stack)


def _qwen_verify(root: Path, report: VerifyReport, load_test: bool) -> None:
    from .qwen2_5_omni.verify import verify

    verify(root, report, load_test)


def _qwen_voices(root: Path) -> list[str]:
    from .qwen2_5_omni.verify import voice_names

    return voice_names(root)


def _qwen_dtype(root: Path) -> str | None:
    from .qwen2_5_omni.verify import config_dtype

    return config_dtype(root)


def _qwen_quantization(root: Path) -> str | None:
    from .qwen2_5_omni.verify import quantization

    return quantization(root)


def _qwen_memory_modes(root: Path) -> dict[str, int]:
    from .qwen2_5_omni.verify import memory_modes

    return memory_modes(root)


def _qwen_input_rate(root: Path) -> int:
    from ..features import FeatureConfig

    try:
        return FeatureConfig.from_preprocessor_config(root).sampling_rate
    except Exception:  # the loader names what is wrong with the checkpoint
        return 16000


def _qwen_tools():
    from .qwen2_5_omni import tools

    return tools


def _qwen_notice() -> str:
    from .qwen2_5_omni.demo import DEMO_NOTICE

    return DEMO_NOTICE


QWEN = Family(
    name="qwen2_5_omni", title="Qwen2.5-Omni", duplex=False, detect=_qwen_detect, demo_name="demo",
    make_demo=_qwen_make_demo, demo_dir=_qwen_demo_dir, is_demo=_qwen_is_demo, demo_notice=_qwen_notice(),
    load=_qwen_load, verify=_qwen_verify, voices=_qwen_voices, declared_dtype=_qwen_dtype,
    input_rate=_qwen_input_rate, turn_tools=_qwen_tools, quantization=_qwen_quantization,
    memory_modes=_qwen_memory_modes,
    repos=PUBLISHED["qwen2_5_omni"])


# ---------------------------------------------------------------- Qwen3-Omni

def _qwen3_detect(root: Path) -> bool:
    d = _config(root)
    return d is not None and d.get("model_type") == "qwen3_omni_moe"


def _qwen3_make_demo(dir=None, force: bool = False) -> Path:
    from .qwen3_omni.demo import make_demo

    return make_demo(dir, force=force)


def _qwen3_demo_dir() -> Path:
    from .qwen3_omni.demo import default_demo_dir

    return default_demo_dir()


def _qwen3_is_demo(root: Path) -> bool:
    from .qwen3_omni.demo import is_demo

    return is_demo(_config(root) or {})


def _qwen3_load(root: Path, device: str, options: LoadOptions) -> Loaded:
    from .qwen3_omni.demo import is_demo
    from .qwen3_omni.executor import executor_for
    from .qwen3_omni.loading import load_stack

    stack = load_stack(root, device=device)
    if options.voice and stack.voice_named(options.voice) is None:
        raise CheckpointError(f"unknown voice '{options.voice}'; this model has: {', '.join(stack.voices)}")
    executor = executor_for(stack, greedy=options.greedy, max_text_tokens=options.max_text_tokens,
                            max_codec_tokens=options.max_codec_tokens, compile=options.compile)
    demo = is_demo(stack.config.raw)
    info = {"path": str(stack.path), "family": "qwen3_omni", "demo": demo,
            "dtype": str(stack.dtype).replace("torch.", ""), "decode": executor.runner.mode}
    # the default speaker first: front ends (the window's voice picker) start on voices[0], and without a
    # voice the executor speaks as the reference does (Ethan), whatever order config.json lists them in
    voices = sorted(stack.voices, key=lambda v: v != stack.default_voice)
    return Loaded(QWEN3, root, executor, str(stack.device), demo, voices, info, stack)


def _qwen3_verify(root: Path, report: VerifyReport, load_test: bool) -> None:
    from .qwen3_omni.verify import verify

    verify(root, report, load_test)


def _qwen3_unsupported(root: Path) -> str | None:
    from .qwen3_omni.verify import unsupported

    return unsupported(root)


def _qwen3_voices(root: Path) -> list[str]:
    from .qwen3_omni.verify import voice_names

    return voice_names(root)


def _qwen3_tools():
    from .qwen3_omni import tools

    return tools


def _qwen3_notice() -> str:
    from .qwen3_omni.demo import DEMO_NOTICE

    return DEMO_NOTICE


QWEN3 = Family(
    name="qwen3_omni", title="Qwen3-Omni", duplex=False, detect=_qwen3_detect, demo_name="qwen3-demo",
    make_demo=_qwen3_make_demo, demo_dir=_qwen3_demo_dir, is_demo=_qwen3_is_demo, demo_notice=_qwen3_notice(),
    load=_qwen3_load, verify=_qwen3_verify, voices=_qwen3_voices, declared_dtype=_qwen_dtype,
    input_rate=_qwen_input_rate, turn_tools=_qwen3_tools, unsupported=_qwen3_unsupported,
    ignored_options=("quantize",),  # its MoE experts are not QuantLinear yet
    repos=PUBLISHED["qwen3_omni"])


# ---------------------------------------------------------------- Moshi

def _moshi_detect(root: Path) -> bool:
    root = Path(root)
    d = _config(root)
    if d is not None and "model_type" in d:
        return d.get("model_type") == "moshi"
    if d is not None and d.get("moshi_name"):
        return True
    # the published moshiko/moshika repos have no config.json: the files say what they are
    from .moshi.config import MIMI_NAME, MOSHI_NAME, TOKENIZER_NAME

    return d is None and (root / MOSHI_NAME).is_file() and (root / MIMI_NAME).is_file() \
        and (root / TOKENIZER_NAME).is_file()


def _moshi_make_demo(dir=None, force: bool = False) -> Path:
    from .moshi.demo import make_moshi_demo

    return make_moshi_demo(dir, force=force)


def _moshi_demo_dir() -> Path:
    from .moshi.demo import default_demo_dir

    return default_demo_dir()


def _moshi_is_demo(root: Path) -> bool:
    from .moshi.demo import is_moshi_demo

    return is_moshi_demo(_config(root))


def _moshi_load(root: Path, device: str, options: LoadOptions) -> Loaded:
    from .moshi.executor import load_moshi

    executor = load_moshi(root, device=device, greedy=options.greedy, seed=options.seed, compile=options.compile)
    info = executor.model_info()
    return Loaded(MOSHI, root, executor, str(executor.device), bool(info.get("demo")), [], info)


def _moshi_verify(root: Path, report: VerifyReport, load_test: bool) -> None:
    from .moshi.verify import verify

    verify(root, report, load_test)


def _moshi_input_rate(root: Path) -> int:
    """Mimi's own rate (24 kHz published): what Moshi hears, with no stop at the VAD's 16 kHz on the way."""
    from .moshi.executor import read_config, read_mimi_config
    from .moshi.mimi import MIMI

    try:
        return read_mimi_config(root, read_config(root)[0]).sample_rate
    except Exception:  # the loader names what is wrong with the checkpoint
        return MIMI.sample_rate


def _moshi_notice() -> str:
    from .moshi.demo import DEMO_NOTICE

    return DEMO_NOTICE


MOSHI = Family(
    name="moshi", title="Moshi", duplex=True, detect=_moshi_detect, demo_name="moshi-demo",
    make_demo=_moshi_make_demo, demo_dir=_moshi_demo_dir, is_demo=_moshi_is_demo, demo_notice=_moshi_notice(),
    load=_moshi_load, verify=_moshi_verify, voices=lambda root: [], declared_dtype=lambda root: None,
    input_rate=_moshi_input_rate,
    repos=PUBLISHED["moshi"],
    # one voice, and no reply to limit: it talks when it likes, one frame at a time; its linears are not
    # QuantLinear yet
    ignored_options=("voice", "max_text_tokens", "max_codec_tokens", "quantize"))

FAMILIES: tuple[Family, ...] = (QWEN, MOSHI, QWEN3)
RECOMMENDED: dict[str, Recommendation] = {repo: r for f in FAMILIES for repo, r in f.repos.items()}
assert set(RECOMMENDED) == set(checkpoint.known_repos()), "every published repo belongs to a family"
SMALLEST_REPO = "Qwen/Qwen2.5-Omni-3B"  # what to suggest to a user who has no model yet


# ---------------------------------------------------------------- lookups

def family_named(name: str) -> Family:
    """A family by its name, title or demo name ("qwen", "moshi", ... case-insensitive)."""
    key = name.strip().lower()
    for f in FAMILIES:
        if key in (f.name, f.title.lower(), f.demo_name) or f.name.startswith(key):
            return f
    raise ValueError(f"unknown model family '{name}'; known: {', '.join(f.name for f in FAMILIES)}")


def detect_family(root: str | os.PathLike) -> Family | None:
    """The family of the checkpoint directory ``root``, or None."""
    root = Path(root)
    return next((f for f in FAMILIES if root.is_dir() and f.detect(root)), None)


def family_of(root: str | os.PathLike) -> Family:
    """The family of the checkpoint directory ``root``; CheckpointError when no family knows it."""
    root = Path(root)
    if not root.is_dir():
        raise CheckpointError(f"checkpoint directory not found: {root}")
    family = detect_family(root)
    if family is not None:
        return family
    config = root / "config.json"
    if config.is_file():  # there but unreadable: say where, not that it is missing
        try:
            d = json.loads(config.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{config}: not valid JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"{config}: cannot read it ({e})") from None
        if not isinstance(d, dict):
            raise ConfigError(f"{config}: expected a JSON object, found {type(d).__name__}")
        what = f"its config.json has model_type {d.get('model_type')!r}"
    else:
        what = "it has no config.json and not the files of a published Moshi repo"
    raise CheckpointError(f"{root}: not a checkpoint OmniDesk can run ({what}); supported: "
                          + ", ".join(f"{f.title} ({f.name})" for f in FAMILIES))


def demo_family(name: str) -> Family | None:
    """The family whose demo ``name`` names ("demo", "moshi-demo"), or None."""
    return next((f for f in FAMILIES if f.demo_name == name), None)


def resolve_checkpoint(model: str | os.PathLike) -> Path:
    """A demo name ("demo", "moshi-demo": the demo must have been made), a directory as given
    (``./demo`` for a folder of that name), or a repo id ("Qwen/Qwen2.5-Omni-3B") found in the
    local HF cache."""
    if isinstance(model, str) and (family := demo_family(model)) is not None:
        demo = family.demo_dir()
        if (demo / "config.json").is_file():
            return demo
        default = family is FAMILIES[0]  # `models make-demo` makes the first family's demo
        what = "the demo model" if default else f"the {family.title} demo model"
        make = "omnidesk models make-demo" + ("" if default else f" --family {family.name}")
        raise CheckpointError(f"{what} is not made yet (it goes to {demo}); make it with: {make}")
    return checkpoint.resolve_checkpoint(model)


def resolve_model(name_or_path: str | os.PathLike, make_demo: bool = False) -> tuple[Path, Family]:
    """A model name as the user gives it (a demo name, a folder, a cached repo id) -> (directory, family).

    A demo name resolves to its demo; ``make_demo`` makes it first when it is not there yet
    (otherwise it must have been made: ``omnidesk models make-demo``)."""
    if make_demo and isinstance(name_or_path, str) and (family := demo_family(name_or_path)) is not None:
        return family.make_demo(), family
    root = resolve_checkpoint(name_or_path)
    return root, family_of(root)


def load_model(name_or_path: str | os.PathLike, device: str, options: LoadOptions | None = None) -> Loaded:
    """Resolve (demo names are made on first use), detect the family and load its executor."""
    root, family = resolve_model(name_or_path, make_demo=True)
    return family.load(root, device, options or LoadOptions())


def verify(name_or_path: str | os.PathLike, load_test: bool = True,
           progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """`models verify`: never raises; every problem is a message in the report.  ``progress(done,
    total)`` (bytes) follows the read of every tensor value."""
    try:
        root, family = resolve_model(name_or_path)
    except CheckpointError as e:
        report = VerifyReport(Path(name_or_path))
        report.problems.append(str(e))
        return report
    report = VerifyReport(root, family=family.name, demo=family.is_demo(root), progress=progress)
    family.verify(root, report, load_test)
    return report


__all__ = ["FAMILIES", "Family", "LoadOptions", "Loaded", "MOSHI", "QWEN", "QWEN3", "RECOMMENDED", "Recommendation",
           "SMALLEST_REPO", "demo_family", "detect_family", "family_named", "family_of", "load_model",
           "resolve_checkpoint", "resolve_model", "verify"]
