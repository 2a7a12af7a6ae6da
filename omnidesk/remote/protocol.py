"""The wire format of a vLLM-Omni server's chat completions, as read from its code.

Pinned release: vLLM-Omni **0.30.0** (PyPI ``vllm-omni``; read from the wheel,
not installed).  What this module relies on, and where it comes from:

* The request (``POST /v1/chat/completions``): ``messages`` with user content
  parts of type ``audio_url`` (a ``data:audio/wav;base64,...`` URL), assistant
  turns as plain text, ``"stream": true``, ``"modalities": ["text", "audio"]``
  and the voice as ``"speaker"`` -- ``OmniOpenAIServingChat._preprocess_chat``
  in ``vllm_omni/entrypoints/openai/serving_chat.py`` reads
  ``request.voice or request.speaker`` and checks it with
  ``validate_requested_speaker`` (``vllm_omni/entrypoints/openai/utils.py``:
  lower-cased, 400 when the model has no such voice).
* The stream: ``chat_completion_stream_generator`` (same file) yields
  ``data: <OmniChatCompletionStreamResponse JSON>\\n\\n`` per chunk and
  ``data: [DONE]\\n\\n`` at the end.  Every chunk carries a top-level
  ``"modality"`` (``OmniChatCompletionStreamResponse.modality``,
  ``vllm_omni/entrypoints/openai/protocol/chat_completion.py``; default
  ``"text"``, absent from the final stop / usage chunks, which carry no
  content).  Text is ``choices[i].delta.content``.  Audio is ALSO
  ``choices[i].delta.content``: base64 of a complete audio file per chunk
  (``_create_audio_choice``: ``audio_data[-1]`` of the stage output, encoded by
  ``AudioMixin.create_audio`` in ``audio_utils_mixin.py`` with soundfile,
  ``DEFAULT_AUDIO_FORMAT = "wav"`` in ``protocol/audio.py`` -> 16-bit PCM
  mono, 24 kHz unless the model reports another ``sr``), with
  ``choices[i].audio_metadata`` {format, sample_rate_hz, frame_count,
  channels}.  The WAV header is authoritative here; the metadata is not needed.
* Errors: before the stream, a JSON body ``{"error": {"message", "type",
  "code"}}`` with the HTTP status (``ErrorResponse``; ``_check_model`` answers
  404 "The model `X` does not exist."); vLLM's ``--api-key`` middleware answers
  401 ``{"error": "Unauthorized"}``.  During the stream, an exception becomes
  one ``data: {"error": {...}}`` chunk (``create_streaming_error_response``)
  followed by ``data: [DONE]``.
* Client disconnect: the route returns a Starlette ``StreamingResponse``
  (``create_chat_completion`` in ``vllm_omni/entrypoints/openai/api_server.py``,
  ``@with_cancellation``); a closed connection cancels the generator, and
  ``AsyncOmni.generate`` (``vllm_omni/entrypoints/async_omni.py``) catches the
  ``CancelledError``/``GeneratorExit`` and calls ``_abort_internal_requests``:
  the request is aborted on every stage.
* ``GET /v1/models``: ``show_available_models`` (``api_server.py``) returns
  vLLM's model list ``{"object": "list", "data": [{"id", "root", ...}]}``.
* Audio pacing: the bundled deploy configs decide it.
  ``vllm_omni/deploy/qwen3_omni_moe.yaml`` has ``async_chunk: true`` (first
  audio chunk after 4 codec frames, then 25 per chunk: the reply streams);
  ``vllm_omni/deploy/qwen2_5_omni.yaml`` has ``async_chunk: false`` (each stage
  runs to the end before the next: the reply's audio arrives in one piece at
  the end).
"""

from __future__ import annotations

import base64
import io
import json
import re
from dataclasses import dataclass, field

import numpy as np

VLLM_OMNI_VERSION = "0.30.0"  # the release whose serving code this module follows

# Qwen2.5-Omni only speaks with this exact system prompt (FACTS, Qwen2.5-Omni); Qwen3-Omni's
# model card uses it too.  Sent as the first message of every request.
QWEN_SYSTEM_PROMPT = ("You are Qwen, a virtual human developed by the Qwen Team, Alibaba Group, capable of "
                      "perceiving auditory and visual inputs, as well as generating text and speech.")

# Model names whose vLLM-Omni deploy config runs the stages one after the other (async_chunk:
# false in vllm_omni/deploy/qwen2_5_omni.yaml): the reply's audio comes only when it is complete.
_AUDIO_AT_END_NAMES = re.compile(r"qwen2[._-]?5[._-]?omni", re.IGNORECASE)
# Voices the published checkpoints have (FACTS: spk_dict.pt / talker config); the server checks them.
_VOICES = ((re.compile(r"qwen3[._-]?omni", re.IGNORECASE), ["Ethan", "Chelsie", "Aiden"]),
           (_AUDIO_AT_END_NAMES, ["Chelsie", "Ethan"]))


class MalformedChunk(ValueError):
    """A stream chunk this client cannot read (not JSON, not a chat completion chunk, bad audio)."""


@dataclass
class Chunk:
    """What one SSE ``data:`` event carried."""

    done: bool = False  # the [DONE] marker
    modality: str = "text"
    text: list[str] = field(default_factory=list)  # text deltas (one per choice with content)
    audio: list[str] = field(default_factory=list)  # base64 audio files (one per choice with content)
    finish_reason: str | None = None
    error: dict | None = None  # the server's {"message", "type", "code"}


def audio_at_end_model(name: str | None) -> bool:
    """Whether vLLM-Omni serves this model with its audio only at the end of a reply (see above)."""
    return bool(name) and bool(_AUDIO_AT_END_NAMES.search(name))


def known_voices(name: str | None) -> list[str]:
    """The voices of the published checkpoint this model name is, or [] (the server's default)."""
    for pattern, voices in _VOICES:
        if name and pattern.search(name):
            return list(voices)
    return []


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """16-bit PCM mono WAV of float samples in [-1, 1]."""
    import soundfile as sf

    buf = io.BytesIO()
    sf.write(buf, np.clip(np.asarray(samples, np.float32), -1.0, 1.0), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def audio_data_url(samples: np.ndarray, rate: int) -> str:
    """A user turn's audio as the ``audio_url`` data URL vLLM-Omni's chat template takes."""
    return "data:audio/wav;base64," + base64.b64encode(wav_bytes(samples, rate)).decode("ascii")


def decode_audio(b64: str) -> tuple[np.ndarray, int]:
    """One audio chunk (base64 of a WAV file) -> (float32 mono samples, sample rate)."""
    import soundfile as sf

    try:
        raw = base64.b64decode(b64, validate=True)
    except (ValueError, TypeError) as e:
        raise MalformedChunk(f"audio chunk is not base64 ({e})") from None
    try:
        data, rate = sf.read(io.BytesIO(raw), dtype="float32", always_2d=True)
    except Exception as e:  # noqa: BLE001 - soundfile raises several types for bad data
        raise MalformedChunk(f"audio chunk is not a sound file ({str(e).strip() or type(e).__name__})") from None
    return data.mean(axis=1, dtype=np.float32), int(rate)


def user_message(samples: np.ndarray, rate: int) -> dict:
    return {"role": "user", "content": [{"type": "audio_url", "audio_url": {"url": audio_data_url(samples, rate)}}]}


def request_body(model: str, messages: list[dict], voice: str | None, seed: int | None = None,
                 max_tokens: int | None = None, system_prompt: str | None = QWEN_SYSTEM_PROMPT) -> dict:
    """The streaming chat completion request for one turn (the whole history rides along)."""
    head = [{"role": "system", "content": system_prompt}] if system_prompt else []
    body = {"model": model, "messages": head + list(messages), "stream": True, "modalities": ["text", "audio"]}
    if voice:
        body["speaker"] = voice
    if seed is not None:
        body["seed"] = int(seed)
    if max_tokens is not None:
        body["max_tokens"] = int(max_tokens)
    return body


def parse_event(data: str) -> Chunk:
    """One SSE event's data (``data:`` lines joined) -> a :class:`Chunk`; MalformedChunk when it is
    not what chat_completion_stream_generator sends."""
    if data.strip() == "[DONE]":
        return Chunk(done=True)
    try:
        obj = json.loads(data)
    except ValueError:
        raise MalformedChunk(f"not JSON: {_snippet(data)}") from None
    if not isinstance(obj, dict):
        raise MalformedChunk(f"not a JSON object: {_snippet(data)}")
    if "error" in obj:
        err = obj["error"]
        return Chunk(error=err if isinstance(err, dict) else {"message": str(err)})
    choices = obj.get("choices")
    if not isinstance(choices, list):
        raise MalformedChunk(f"no 'choices' list in a chat completion chunk: {_snippet(data)}")
    modality = obj.get("modality") or "text"
    chunk = Chunk(modality=modality)
    for choice in choices:
        if not isinstance(choice, dict):
            raise MalformedChunk(f"a choice is not an object: {_snippet(data)}")
        delta = choice.get("delta") or {}
        if not isinstance(delta, dict):
            raise MalformedChunk(f"a delta is not an object: {_snippet(data)}")
        content = delta.get("content")
        if content is not None and not isinstance(content, str):
            raise MalformedChunk(f"delta.content is not a string: {_snippet(data)}")
        if content:
            (chunk.audio if modality == "audio" else chunk.text).append(content)
        if choice.get("finish_reason"):
            chunk.finish_reason = choice["finish_reason"]
    return chunk


def error_text(body: bytes) -> str:
    """The message of an error body (vLLM's ErrorResponse, FastAPI's {"detail"}, the API-key
    middleware's {"error": "Unauthorized"}), else the start of the body."""
    try:
        obj = json.loads(body.decode("utf-8", "replace"))
    except ValueError:
        return _snippet(body.decode("utf-8", "replace"))
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail"))
        if isinstance(err, dict):
            return str(err.get("message") or err)
        if err is not None:
            return str(err)
    return _snippet(json.dumps(obj))


def _snippet(text: str, n: int = 120) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[:n - 3] + "..."
