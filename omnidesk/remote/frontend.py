"""Connecting the front ends (``omnidesk talk/live --server``, the window's "Server…" entry) to a
vLLM-Omni server.  Kept out of cli/ and gui/ so that they only need a few lines each.

Importing this module is light (no httpx until a server is actually used).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

SERVER_PREFIXES = ("http://", "https://")
PRIVACY_NOTE = "your voice is sent to {url}: audio leaves this machine"


def is_server_url(source: str | None) -> bool:
    """A model source that names a server (the window remembers a server as its URL)."""
    return bool(source) and str(source).strip().lower().startswith(SERVER_PREFIXES)


@dataclass
class Remote:
    """A connected server: its executor and what the front ends show."""

    url: str
    model: str
    executor: object  # RemoteExecutor
    voices: list[str] = field(default_factory=list)
    model_info: dict = field(default_factory=dict)

    @property
    def notice(self) -> str | None:
        return self.executor.notice

    @property
    def host(self) -> str:
        return self.url.split("://", 1)[-1]


def connect(url: str, api_key: str | None = None, connect_timeout_s: float | None = None,
            read_timeout_s: float | None = None, max_tokens: int | None = None) -> Remote:
    """Reach the server, ask /v1/models which model it serves, and make its executor.  Raises
    :class:`~omnidesk.remote.client.ServerError` (the message names the server)."""
    from .client import API_KEY_ENV, ServerClient, ServerError, Timeouts
    from .executor import RemoteExecutor
    from .protocol import VLLM_OMNI_VERSION, audio_at_end_model, known_voices

    timeouts = Timeouts()
    if connect_timeout_s is not None:
        timeouts.connect_s = float(connect_timeout_s)
    if read_timeout_s is not None:
        timeouts.read_s = float(read_timeout_s)
    key = api_key if api_key is not None else (os.environ.get(API_KEY_ENV) or None)
    client = ServerClient(url, key, timeouts)
    try:
        models = client.models()
    except ServerError:
        client.close()
        raise
    if not models:
        client.close()
        raise ServerError("no_model", f"the server at {client.url} serves no model (its /v1/models list is empty)")
    entry = models[0]  # `vllm serve MODEL` serves one model, under its served name
    model, root = str(entry["id"]), entry.get("root")
    executor = RemoteExecutor(client, model, max_tokens=max_tokens)
    if not executor.audio_at_end and audio_at_end_model(root):
        executor.audio_at_end = True
        executor.audio_at_end_why = f"{root} runs on vLLM-Omni without async_chunk"
    info = {"family": "remote", "server": client.url, "name": model, "root": root, "demo": False,
            "protocol": f"vLLM-Omni {VLLM_OMNI_VERSION} chat completions (streamed)",
            "audio_at_end": executor.audio_at_end}
    return Remote(client.url, model, executor, known_voices(model) or known_voices(root), info)


# ---------------------------------------------------------------- the CLI (talk, live)

def add_server_options(p) -> None:
    """--server and what goes with it, for `talk` and `live`."""
    p.add_argument("--server", metavar="URL",
                   help="run the model on a vLLM-Omni server (http://HOST:PORT or https://...; `vllm serve MODEL "
                        "--omni`) instead of this machine; the model is the one the server serves. Your voice "
                        "is sent to the server")
    p.add_argument("--api-key", help="the server's API key (vllm serve --api-key); default: the OMNIDESK_API_KEY "
                                     "environment variable")
    p.add_argument("--connect-timeout", type=float, metavar="S",
                   help="--server: give up connecting after S seconds (default 10)")
    p.add_argument("--read-timeout", type=float, metavar="S",
                   help="--server: a reply from which nothing arrives for S seconds has stalled and is "
                        "dropped (default 60)")


def prepare_server(args, out, prepared_cls):
    """cli.model_setup._prepare for --server: nothing to resolve on this machine; say what runs where."""
    from omnidesk.errors import UsageError

    if getattr(args, "model", None):
        raise UsageError(f"--model and --server both name the model; the server at {args.server} serves its "
                         f"own: drop --model")
    if not is_server_url(args.server):
        raise UsageError(f"--server {args.server}: give the server's URL as http://HOST:PORT or https://HOST:PORT")
    if getattr(args, "device", None):
        print("note: --device has no meaning with --server (the model runs on the server); ignored", file=out)
    print(f"model: the one served by {args.server} (given with --server); device: the server's", file=out,
          flush=True)
    from .executor import SAMPLE_RATE_IN

    return prepared_cls(args.server, Path("."), "remote", SAMPLE_RATE_IN, None)


def load_server(args, prepared, out):
    """cli.model_setup._load for --server: connect, then say what the model is, where the audio goes, and
    anything the server does differently (its audio only at the end of a reply)."""
    from omnidesk.errors import UsageError
    from omnidesk.models.families import Loaded

    from .client import ServerError

    args.doing = f"connecting to {args.server}"
    try:
        remote = connect(args.server, getattr(args, "api_key", None), getattr(args, "connect_timeout", None),
                         getattr(args, "read_timeout", None), max_tokens=getattr(args, "max_text_tokens", None))
    except ServerError as e:
        raise UsageError(str(e)) from None
    ignored = [opt for opt, value in (("--greedy", getattr(args, "greedy", False)),
                                      ("--max-codec-tokens", getattr(args, "max_codec_tokens", None)),
                                      ("--quantize", getattr(args, "quantize", None) not in (None, "none")))
               if value]
    if ignored:
        print(f"note: {', '.join(ignored)} ha{'ve' if len(ignored) > 1 else 's'} no meaning with --server (the "
              f"server's deploy config decides); ignored", file=out)
    voice = getattr(args, "voice", None)
    if voice and remote.voices and voice.lower() not in [v.lower() for v in remote.voices]:
        print(f"note: {remote.model} is published with the voices {', '.join(remote.voices)}; the server "
              f"decides whether it knows '{voice}'", file=out)
    print(f"connected: {remote.model} on {remote.url} (remote); {PRIVACY_NOTE.format(url=remote.url)}", file=out,
          flush=True)
    args.remote_said = {"audio_at_end"} if remote.notice else set()  # notices said once (turn_notes)
    if remote.notice:
        print(f"NOTE: {remote.notice}", file=out, flush=True)
    return Loaded(family=None, root=Path("."), executor=remote.executor, device=f"remote ({remote.url})",
                  demo=False, voices=remote.voices, model_info=remote.model_info)


def turn_notes(number: int, turn, said: set | None = None) -> list[str]:
    """Lines after a remote turn: its network share, and the audio-only-at-end notice the first
    time a reply shows it (``said`` remembers)."""
    from .executor import AUDIO_AT_END_NOTICE
    from .summary import network_summary

    network = turn.extra.get("network")
    if not network:
        return []
    start, end = turn.user_speech_end, turn.events.get("playback_start")
    v2v = None if start is None or end is None else end - start
    lines = [f"{number:4d}  {network_summary(network, v2v)}"]
    if network.get("audio_only_at_end") and said is not None and "audio_at_end" not in said:
        said.add("audio_at_end")
        lines.append(f"NOTE: {AUDIO_AT_END_NOTICE}")
    return lines


def session_notes(timeline, said: set) -> list[str]:
    """`talk --server`: a network line per turn, and the audio-only-at-end notice when a reply
    showed it and it was not said yet (``said``, as for :func:`turn_notes`)."""
    lines = []
    for i, turn in enumerate(timeline.turns, 1):
        lines += turn_notes(i, turn, said)
    return lines


# ---------------------------------------------------------------- the window

def load_server_model(choice, progress, loaded_cls):
    """gui.model_loader.load_model for a server URL (a worker thread): a LoadedModel whose
    ``remote`` is the server's URL (the window shows its "remote" badge)."""
    progress(f"Connecting to {choice.source}")
    remote = connect(choice.source)
    progress(f"Connected to {remote.model} on {remote.host}")
    return loaded_cls(choice=choice, stack=None, executor=remote.executor, demo=False, device="remote",
                      voices=remote.voices, family_title=remote.model, demo_notice="", duplex=False,
                      model_info=remote.model_info, remote=remote.url)
