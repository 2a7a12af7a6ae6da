"""A protocol double of a vLLM-Omni 0.30.0 server: a real HTTP/1.1 server on 127.0.0.1.

vLLM-Omni has no CPU backend, so the remote tests talk to this instead.  It is
not a model: it answers each ``POST /v1/chat/completions`` with a scripted
reply (:class:`Reply`), in the byte format the pinned release sends, paced in
time, and it records every request and whether/when the client disconnected.
Which vLLM-Omni code each part follows (files in the vllm-omni 0.30.0 wheel):

* ``GET /v1/models`` -- ``show_available_models`` in
  ``vllm_omni/entrypoints/openai/api_server.py`` (vLLM's ModelList).
* the stream -- ``OmniOpenAIServingChat.chat_completion_stream_generator`` in
  ``vllm_omni/entrypoints/openai/serving_chat.py``: a first text chunk with
  ``delta: {"role": "assistant", "content": ""}``, then one
  ``chat.completion.chunk`` per text delta (``"modality": "text"``), audio
  chunks (``"modality": "audio"``, ``delta.content`` = base64 of a whole WAV
  file, ``audio_metadata``; ``_create_audio_choice``), ``finish_reason`` only
  on the last chunk of the last modality, then ``data: [DONE]``.  A Starlette
  ``StreamingResponse`` (``text/event-stream``, chunked transfer encoding).
* the audio -- ``AudioMixin.create_audio`` (``audio_utils_mixin.py``):
  soundfile WAV (16-bit PCM), mono, 24 kHz by default.
* pacing -- ``vllm_omni/deploy/qwen3_omni_moe.yaml`` (``async_chunk: true``:
  audio chunks while the text streams) vs ``vllm_omni/deploy/qwen2_5_omni.yaml``
  (``async_chunk: false``: all the audio in one chunk after the text).
* errors -- before the stream, ``ErrorResponse`` JSON with the status
  (``_create_error_response`` / vLLM's ``_check_model``: 404 "The model `X`
  does not exist."); during it, one ``data: {"error": {...}}`` chunk
  (``create_streaming_error_response``) then ``data: [DONE]``; an API key
  mismatch gets upstream vLLM's ``--api-key`` middleware answer, 401
  ``{"error": "Unauthorized"}`` (vLLM's ``build_app``, which vllm-omni's
  api_server builds on; recalled from upstream vLLM, not in the wheel).
* client disconnect -- uvicorn notices the closed connection and Starlette
  cancels the generator (``AsyncOmni.generate`` then aborts every stage); the
  double notices it the same way, by watching the socket for EOF between
  chunks, and records the time (``time.monotonic()``, the client's clock too);
  tests wait for it with :meth:`Request.wait_disconnected`.
"""

from __future__ import annotations

import base64
import io
import json
import select
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import soundfile as sf

QWEN3 = "Qwen/Qwen3-Omni-30B-A3B-Instruct"
QWEN25 = "Qwen/Qwen2.5-Omni-7B"
DEFAULT_TEXT = ["Hello", "!", " The", " weather", " today", " is", " sunny", " and", " warm", ",", " with",
                " a", " light", " breeze", " from", " the", " west", "."]


@dataclass
class Reply:
    """How the double answers one request."""

    text: list[str] = field(default_factory=lambda: list(DEFAULT_TEXT))
    audio_s: float = 2.4  # the reply's speech
    streaming: bool = True  # async_chunk (Qwen3-Omni); False: all audio in one chunk after the text
    first_delay_s: float = 0.05  # before the first chunk (prefill, the first token)
    text_interval_s: float = 0.02  # between text deltas
    first_audio_delay_s: float = 0.15  # streaming: first audio chunk this long after the first chunk
    first_chunk_s: float = 0.32  # 4 codec frames at 12.5 Hz (deploy yaml: initial_codec_chunk_frames)
    chunk_s: float = 0.4  # later chunks (the deploy yaml sends 25 frames = 2 s; shorter keeps tests quick)
    pace: float = 2.0  # audio made this many times faster than real time
    end_audio_delay_s: float = 0.1  # not streaming: talker + vocoder time after the text
    sample_rate: int = 24000
    # failures
    status: int | None = None  # answer this HTTP status (an ErrorResponse) instead of streaming
    message: str = "boom"
    fail_after: int | None = None  # after this many chunks (the role chunk counts) ...
    fail_with: str = "error"  # ... "error" (an error chunk + [DONE]), "malformed", "bad_audio", "stall", "drop"


def slow_reply(seconds: float = 30.0) -> Reply:
    """A reply that streams for about ``seconds`` in many small chunks (a text delta every 50 ms,
    0.1 s of audio at a time, in real time): still streaming whenever a test stops it."""
    return Reply(text=["word "] * int(seconds * 10), text_interval_s=0.05, audio_s=seconds, chunk_s=0.1, pace=1.0)


@dataclass
class Request:
    """What the double saw of one chat completion request."""

    body: dict
    headers: dict
    received: float  # time.monotonic()
    first_chunk: float | None = None
    disconnected: float | None = None  # the client closed the connection (EOF seen / write failed)
    completed: bool = False  # [DONE] sent
    chunks: int = 0
    # set when ``disconnected`` is: tests wait on it (a bound that holds on a slow machine) instead
    # of sleeping and reading the time
    gone: threading.Event = field(default_factory=threading.Event, repr=False)

    def hung_up(self) -> None:
        """The client closed the connection: the first time counts."""
        self.disconnected = self.disconnected or time.monotonic()
        self.gone.set()

    def wait_disconnected(self, timeout: float) -> bool:
        return self.gone.wait(timeout)


def wav_b64(samples: np.ndarray, rate: int) -> str:
    buf = io.BytesIO()
    sf.write(buf, samples, rate, format="WAV")  # as AudioMixin.create_audio: soundfile's WAV default, PCM_16
    return base64.b64encode(buf.getvalue()).decode("ascii")


def speech_like(seconds: float, rate: int, seed: int = 0) -> np.ndarray:
    """A voiced, syllable-paced signal (the double has no model: any real audio will do)."""
    t = np.arange(int(round(seconds * rate))) / rate
    f0 = 140 + 30 * np.sin(2 * np.pi * 0.7 * t + seed)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = sum(np.sin(k * phase) / k for k in range(1, 6))
    envelope = 0.5 + 0.5 * np.sin(2 * np.pi * 3.0 * t) ** 2
    return (0.25 * voiced * envelope).astype(np.float32)


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address):
        import sys

        if isinstance(sys.exc_info()[1], (ConnectionError, ssl.SSLError, OSError)):
            return  # a client that hung up (the tests do it on purpose): not worth a traceback
        super().handle_error(request, client_address)


class VllmOmniDouble:
    """``with VllmOmniDouble() as server:`` -- ``server.url``, ``server.replies`` (a list consumed one
    per request; ``server.default`` once empty), ``server.requests``; ``down()`` / ``up()`` take it
    away and bring it back on the same port (unreachable in between)."""

    def __init__(self, model: str = QWEN3, api_key: str | None = None, certfile: str | None = None,
                 keyfile: str | None = None):
        self.model = model
        self.api_key = api_key
        self.replies: list[Reply] = []
        self.default = Reply()
        self.requests: list[Request] = []
        self.models_requests = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._connections: set = set()
        self.port = 0
        self.httpd = None
        self.up(certfile, keyfile)

    def _handler(self):
        double = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive and chunked transfer, as uvicorn

            def setup(self):
                super().setup()
                with double._lock:
                    double._connections.add(self.connection)

            def finish(self):
                with double._lock:
                    double._connections.discard(self.connection)
                super().finish()

            def log_message(self, *args):  # quiet
                pass

            def do_GET(self):
                double._get(self)

            def do_POST(self):
                double._post(self)

        return Handler

    def up(self, certfile: str | None = None, keyfile: str | None = None) -> None:
        """Listen (again, on the same port once it had one): plain HTTP, or TLS with this certificate."""
        self._stop.clear()
        self.httpd = _Server(("127.0.0.1", self.port), self._handler())
        self.httpd.daemon_threads = True
        self.scheme = "http"
        if certfile:
            ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            ctx.load_cert_chain(certfile, keyfile)
            self.httpd.socket = ctx.wrap_socket(self.httpd.socket, server_side=True)
            self.scheme = "https"
        self.port = self.httpd.server_address[1]
        self.url = f"{self.scheme}://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05},
                         name="vllm-omni-double", daemon=True).start()

    def down(self) -> None:
        """Stop listening and cut every open connection (the server process is gone)."""
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        with self._lock:
            live = list(self._connections)
        for conn in live:
            try:
                conn.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def __enter__(self) -> "VllmOmniDouble":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self.down()

    # ---------------------------------------------------------------- handlers
    def _authorized(self, h) -> bool:
        if self.api_key is None or h.headers.get("Authorization") == f"Bearer {self.api_key}":
            return True
        self._json(h, 401, {"error": "Unauthorized"})
        return False

    def _json(self, h, status: int, obj) -> None:
        body = json.dumps(obj).encode()
        h.send_response(status)
        h.send_header("Content-Type", "application/json")
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    def _get(self, h) -> None:
        if h.path != "/v1/models":
            return self._json(h, 404, {"detail": "Not Found"})
        if not self._authorized(h):
            return
        self.models_requests += 1
        self._json(h, 200, {"object": "list", "data": [
            {"id": self.model, "object": "model", "created": int(time.time()), "owned_by": "vllm",
             "root": self.model, "parent": None, "max_model_len": 65536, "permission": []}]})

    def _post(self, h) -> None:
        length = int(h.headers.get("Content-Length", 0))
        raw = h.rfile.read(length)
        if h.path != "/v1/chat/completions":
            return self._json(h, 404, {"detail": "Not Found"})
        if not self._authorized(h):
            return
        body = json.loads(raw)
        req = Request(body=body, headers=dict(h.headers), received=time.monotonic())
        with self._lock:
            self.requests.append(req)
            reply = self.replies.pop(0) if self.replies else self.default
        if body.get("model") != self.model:  # vLLM's _check_model
            return self._json(h, 404, {"error": {"message": f"The model `{body.get('model')}` does not exist.",
                                                 "type": "NotFoundError", "param": "model", "code": 404}})
        if reply.status is not None:
            return self._json(h, reply.status, {"error": {"message": reply.message, "type": "BadRequestError",
                                                          "param": None, "code": reply.status}})
        self._stream(h, req, reply)

    # ---------------------------------------------------------------- the stream
    def _events(self, reply: Reply) -> list[tuple[float, str, object]]:
        """(time after the request, kind, payload) in send order."""
        events: list[tuple[float, str, object]] = [(reply.first_delay_s, "role", None)]
        t_text = [reply.first_delay_s + (i + 1) * reply.text_interval_s for i in range(len(reply.text))]
        events += [(t, "text", s) for t, s in zip(t_text, reply.text)]
        audio = speech_like(reply.audio_s, reply.sample_rate)
        if reply.streaming:
            sizes = [reply.first_chunk_s] + [reply.chunk_s] * int(np.ceil(max(0.0, reply.audio_s - reply.first_chunk_s)
                                                                          / reply.chunk_s))
            t, start = reply.first_delay_s + reply.first_audio_delay_s, 0
            for size in sizes:
                n = int(round(size * reply.sample_rate))
                if start >= audio.size:
                    break
                events.append((t, "audio", audio[start:start + n]))
                start += n
                t += size / reply.pace
        else:
            t_end = (t_text[-1] if t_text else reply.first_delay_s) + reply.end_audio_delay_s
            events.append((t_end, "audio", audio))
        events.sort(key=lambda e: e[0])  # stable: text before audio at the same instant
        return events

    def _chunk(self, modality: str, delta: dict, finish: str | None, extra: dict | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        choice.update(extra or {})
        return {"id": "chatcmpl-double", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model, "choices": [choice], "modality": modality, "metrics": None}

    def _stream(self, h, req: Request, reply: Reply) -> None:
        h.send_response(200)
        h.send_header("Content-Type", "text/event-stream; charset=utf-8")
        h.send_header("Transfer-Encoding", "chunked")
        h.end_headers()
        h.wfile.flush()
        sock = h.connection
        events = self._events(reply)
        last_audio = max((i for i, e in enumerate(events) if e[1] == "audio"), default=None)
        t0 = req.received
        for i, (t, kind, payload) in enumerate(events):
            if not self._wait(sock, t0 + t, req):
                return
            if reply.fail_after is not None and req.chunks >= reply.fail_after:
                return self._fail(h, sock, req, reply)
            if kind == "role":
                obj = self._chunk("text", {"role": "assistant", "content": ""}, None)
                obj.update({"prompt_token_ids": None, "prompt_text": None})
                obj.pop("metrics")
            elif kind == "text":
                obj = self._chunk("text", {"content": payload}, None, {"token_ids": None})
            else:
                samples = payload
                obj = self._chunk("audio", {"role": "assistant", "content": wav_b64(samples, reply.sample_rate)},
                                  "stop" if i == last_audio else None,
                                  {"audio_metadata": {"format": "wav", "sample_rate_hz": reply.sample_rate,
                                                      "frame_count": int(samples.size), "channels": 1},
                                   "stop_reason": None, "token_ids": None})
                obj["usage"] = {"prompt_tokens": 100, "completion_tokens": 0, "total_tokens": 100}
            if not self._send(h, req, "data: " + json.dumps(obj) + "\n\n"):
                return
        if reply.fail_after is not None and req.chunks >= reply.fail_after:
            return self._fail(h, sock, req, reply)
        if self._send(h, req, "data: [DONE]\n\n") and self._send_raw(h, req, b"0\r\n\r\n"):
            req.completed = True

    def _fail(self, h, sock, req: Request, reply: Reply) -> None:
        kind = reply.fail_with
        if kind == "error":  # create_streaming_error_response, then [DONE]
            err = {"error": {"message": reply.message, "type": "InternalServerError", "param": None, "code": 500}}
            self._send(h, req, "data: " + json.dumps(err) + "\n\n")
            self._send(h, req, "data: [DONE]\n\n")
            self._send_raw(h, req, b"0\r\n\r\n")
        elif kind == "malformed":
            self._send(h, req, "data: {\"id\": \"chatcmpl-double\", \"choices\": [{\"delta\": \n\n")
            self._wait(sock, time.monotonic() + 5.0, req)
        elif kind == "bad_audio":
            obj = self._chunk("audio", {"role": "assistant", "content": base64.b64encode(b"not a wav").decode()}, None)
            self._send(h, req, "data: " + json.dumps(obj) + "\n\n")
            self._wait(sock, time.monotonic() + 5.0, req)
        elif kind == "stall":  # sends nothing more, keeps the connection open
            self._wait(sock, time.monotonic() + 30.0, req)
        elif kind == "drop":  # the server process dies: the connection closes mid-stream
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            h.close_connection = True

    def _wait(self, sock, until: float, req: Request) -> bool:
        """Sleep until ``until`` unless the client disconnects first (False: it did)."""
        while not self._stop.is_set():
            remaining = until - time.monotonic()
            if remaining <= 0:
                return True
            try:
                readable, _, _ = select.select([sock], [], [], min(remaining, 0.25))
                if readable and self._peer_closed(sock):
                    req.hung_up()
                    return False
            except (OSError, ValueError):
                req.hung_up()
                return False
        return False

    @staticmethod
    def _peer_closed(sock) -> bool:
        try:
            if isinstance(sock, ssl.SSLSocket):
                # TLS: EOF shows as a read of nothing (or an error); any record would be a protocol violation here
                sock.setblocking(False)
                try:
                    return sock.recv(1) == b""
                except ssl.SSLWantReadError:
                    return False
                finally:
                    sock.setblocking(True)
            return sock.recv(1, socket.MSG_PEEK) == b""
        except (ConnectionResetError, BrokenPipeError, ssl.SSLError):
            return True

    def _send(self, h, req: Request, text: str) -> bool:
        data = text.encode("utf-8")
        ok = self._send_raw(h, req, f"{len(data):x}\r\n".encode() + data + b"\r\n")
        if ok:
            req.chunks += 1
            req.first_chunk = req.first_chunk or time.monotonic()
        return ok

    def _send_raw(self, h, req: Request, data: bytes) -> bool:
        try:
            h.wfile.write(data)
            h.wfile.flush()
            return True
        except (BrokenPipeError, ConnectionResetError, OSError):
            req.hung_up()
            h.close_connection = True
            return False
