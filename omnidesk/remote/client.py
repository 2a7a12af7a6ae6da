"""HTTP to a vLLM-Omni server: the model list and one streamed reply per turn (httpx, sync).

A reply streams on a reader thread of its own (:class:`ReplyStream`): it parses
the server-sent events as they arrive and queues text, audio and the end (or an
error) for the executor, which only polls the queue.  So no executor call ever
waits on the network for long, and a barge-in is served at once.

Stopping a reply (:meth:`ReplyStream.abort`) shuts the socket down from the
calling thread: a plain ``close()`` would not wake the reader blocked in
``recv`` and would send nothing until it returned, whereas ``shutdown`` sends
the FIN at once, so the server sees the disconnect and aborts the request on
every stage (``AsyncOmni.generate``, see :mod:`.protocol`).  The socket comes
from httpx's documented ``trace`` request extension (``connection.connect_tcp``
/ ``connection.start_tls`` hand over the network stream) and the response's
``network_stream`` extension.  The pool holds one connection: a turn has one
stream at a time, so the connection a request uses is the one last connected,
and it is reused between turns while it lives (no new TCP/TLS handshake).

Every failure is a :class:`ServerError` whose message names the server URL and
says what happened (unreachable, TLS, API key, unknown model, an HTTP error
before or during the stream, a malformed chunk, a stall, a dropped connection).
"""

from __future__ import annotations

import logging
import queue
import socket
import ssl
import threading
import time
from dataclasses import dataclass

from .protocol import MalformedChunk, decode_audio, error_text, parse_event

log = logging.getLogger("omnidesk.remote")

API_KEY_ENV = "OMNIDESK_API_KEY"
DEFAULT_CONNECT_TIMEOUT_S = 10.0
# vLLM-Omni sends no keep-alive while a stage works; Qwen2.5-Omni's whole audio comes after the
# talker and the vocoder have finished the reply, which takes a while for a long one.
DEFAULT_READ_TIMEOUT_S = 60.0


class ServerError(RuntimeError):
    """Talking to the model server failed; ``kind`` says how (one of KINDS), the message says it
    in words and names the server."""

    KINDS = ("url", "unreachable", "tls", "unauthorized", "unknown_model", "http", "stream_error",
             "malformed", "stalled", "dropped", "no_model")

    def __init__(self, kind: str, message: str, status: int | None = None):
        super().__init__(message)
        self.kind = kind
        self.status = status


def normalize_url(url: str) -> str:
    """``http(s)://host[:port]`` without a trailing ``/`` or ``/v1``; ServerError("url") otherwise."""
    text = (url or "").strip()
    if not text.lower().startswith(("http://", "https://")):
        raise ServerError("url", f"'{url}' is not a server URL: give it as http://HOST:PORT or https://HOST:PORT")
    text = text.rstrip("/")
    if text.endswith("/v1"):
        text = text[:-3]
    return text


def _ssl_cause(e: BaseException) -> ssl.SSLError | None:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, ssl.SSLError):
            return e
        e = e.__cause__ or e.__context__
    return None


def _reason(e: BaseException) -> str:
    """The innermost useful words of a connection error ("[Errno 111] Connection refused")."""
    inner = e
    while (inner.__cause__ or inner.__context__) is not None:
        inner = inner.__cause__ or inner.__context__
    text = str(inner).strip() or str(e).strip() or type(e).__name__
    return text


@dataclass
class Timeouts:
    connect_s: float = DEFAULT_CONNECT_TIMEOUT_S
    read_s: float = DEFAULT_READ_TIMEOUT_S  # no byte for this long = a stalled reply


class ServerClient:
    """One server: its URL, API key, TLS verification (on by default) and timeouts."""

    def __init__(self, url: str, api_key: str | None = None, timeouts: Timeouts | None = None,
                 verify: bool | str = True):
        import httpx

        self.url = normalize_url(url)
        self.api_key = api_key
        self.timeouts = timeouts or Timeouts()
        t = self.timeouts
        self._httpx = httpx
        # one connection: see the module docstring (which socket a stream uses)
        self._client = httpx.Client(
            verify=verify, timeout=httpx.Timeout(connect=t.connect_s, read=t.read_s, write=t.read_s, pool=t.read_s),
            # keep-alive shorter than uvicorn's 5 s default, so a turn never sends on a connection
            # the server is closing at that moment
            limits=httpx.Limits(max_connections=1, max_keepalive_connections=1, keepalive_expiry=4.0))
        self._last_stream = None  # the network stream of the connection last opened (trace extension)

    def close(self) -> None:
        self._client.close()

    def _headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    # ---------------------------------------------------------------- errors
    def _transport_error(self, e: Exception, during: str) -> ServerError:
        """An httpx exception -> ServerError naming the server and what went wrong."""
        httpx = self._httpx
        where = f"the server at {self.url}"
        tls = _ssl_cause(e)
        if tls is not None or (isinstance(e, httpx.ConnectError) and "SSL" in str(e)):
            if isinstance(tls, ssl.SSLCertVerificationError):
                reason = f"certificate verify failed: {tls.verify_message or tls.reason}"
            else:
                reason = getattr(tls, "reason", None) or _reason(e)
            hint = (" (is it plain HTTP? then use http://)" if "WRONG_VERSION" in str(reason).upper() else
                    "; TLS verification is on: give the server a certificate this machine trusts, or point "
                    "SSL_CERT_FILE at the CA that signed it")
            return ServerError("tls", f"TLS failure talking to {where}: {reason}{hint}")
        if isinstance(e, httpx.ConnectTimeout):
            return ServerError("unreachable", f"cannot reach {where}: no connection within "
                                              f"{self.timeouts.connect_s:g} s (is the host up and the port open?)")
        if isinstance(e, httpx.ConnectError):
            return ServerError("unreachable", f"cannot reach {where}: {_reason(e)} (is `vllm serve ... --omni` "
                                              f"running there?)")
        if isinstance(e, (httpx.ReadTimeout, httpx.PoolTimeout, httpx.WriteTimeout)):
            return ServerError("stalled", f"{where} sent nothing for {self.timeouts.read_s:g} s {during}; "
                                          f"the reply was dropped (read timeout)")
        if isinstance(e, (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)):
            return ServerError("dropped", f"{where} closed the connection {during} ({_reason(e)})")
        if isinstance(e, (httpx.UnsupportedProtocol, httpx.InvalidURL)):
            return ServerError("url", f"'{self.url}' is not a server URL this client can use: {e}")
        return ServerError("dropped", f"talking to {where} failed {during}: {type(e).__name__}: {_reason(e)}")

    def _status_error(self, status: int, body: bytes, model: str | None = None) -> ServerError:
        where = f"the server at {self.url}"
        text = error_text(body)
        if status in (401, 403):
            sent = "the API key was refused" if self.api_key else "it wants an API key and none was given"
            return ServerError("unauthorized", f"{where} answered {status} ({text}): {sent}; give it with "
                                               f"--api-key or the {API_KEY_ENV} environment variable", status)
        if status == 404 and model is not None and "does not exist" in text:
            return ServerError("unknown_model", f"{where} does not serve the model '{model}' ({text}); "
                                                f"it may have been restarted with another model: connect again",
                               status)
        return ServerError("http", f"{where} answered {status} before the reply: {text}", status)

    # ---------------------------------------------------------------- requests
    def models(self) -> list[dict]:
        """``GET /v1/models``: the served models (vLLM's ModelList ``data``)."""
        try:
            r = self._client.get(self.url + "/v1/models", headers=self._headers())
        except self._httpx.HTTPError as e:
            raise self._transport_error(e, "while listing its models") from None
        if r.status_code != 200:
            raise self._status_error(r.status_code, r.content)
        try:
            data = r.json()["data"]
            return [m for m in data if isinstance(m, dict) and m.get("id")]
        except (ValueError, KeyError, TypeError):
            raise ServerError("malformed", f"the server at {self.url} answered /v1/models with something that "
                                           f"is not a model list: {error_text(r.content)}") from None

    def stream(self, body: dict, model: str) -> "ReplyStream":
        """Start one streamed reply (returns at once; the request runs on the stream's thread)."""
        s = ReplyStream(self, body, model)
        s.start()
        return s

    def _trace(self, stream: "ReplyStream"):
        def trace(name: str, info: dict) -> None:
            if name in ("connection.connect_tcp.complete", "connection.start_tls.complete"):
                self._last_stream = info.get("return_value")
                stream.stamp("connected")
                stream.attach(self._last_stream)
            elif name == "http11.send_request_headers.started":
                stream.attach(self._last_stream)  # a reused connection: the one last connected
            elif name == "http11.receive_response_headers.complete":
                stream.stamp("first_byte")
        return trace


class ReplyStream:
    """One ``POST /v1/chat/completions`` streamed on a thread of its own.

    ``events`` yields ("text", str), ("audio", (samples, rate)), ("end", None) or ("error",
    ServerError); ``stamps`` are time.monotonic() values: request_sent, connected (a new
    connection only), first_byte (response headers), first_text, first_audio, end, aborted.
    """

    def __init__(self, client: ServerClient, body: dict, model: str):
        self.client = client
        self.body = body
        self.model = model
        self.events: queue.Queue = queue.Queue()
        self.stamps: dict[str, float] = {}
        self.aborted = False
        self.received_bytes = 0
        self._lock = threading.Lock()
        self._net = None  # httpcore network stream
        self._thread = threading.Thread(target=self._run, name="omnidesk-remote-stream", daemon=True)

    def start(self) -> None:
        self.stamp("request_sent")  # before connecting: the network share includes the connection
        self._thread.start()

    def stamp(self, name: str, t: float | None = None) -> None:
        with self._lock:
            if name not in self.stamps:
                self.stamps[name] = time.monotonic() if t is None else t

    def attach(self, net) -> None:
        with self._lock:
            self._net = net
            aborted = self.aborted
        if aborted:
            self._shutdown(net)

    @staticmethod
    def _shutdown(net) -> None:
        sock = net.get_extra_info("socket") if net is not None else None
        if sock is None:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)  # sends the FIN now, and wakes the reader
        except OSError:
            pass  # already closed

    def abort(self) -> None:
        """Close the stream now (any thread): the server sees the disconnect and aborts the request."""
        with self._lock:
            if self.aborted:
                return
            self.aborted = True
            self.stamps.setdefault("aborted", time.monotonic())
            net = self._net
        self._shutdown(net)

    def join(self, timeout: float) -> None:
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def finished(self) -> bool:
        return not self._thread.is_alive()

    # ---------------------------------------------------------------- the reader thread
    def _run(self) -> None:
        c = self.client
        httpx = c._httpx
        try:
            with c._client.stream("POST", c.url + "/v1/chat/completions", json=self.body, headers=c._headers(),
                                  extensions={"trace": c._trace(self)}) as resp:
                self.attach(resp.extensions.get("network_stream"))
                self.stamp("first_byte")
                if resp.status_code != 200:
                    raise c._status_error(resp.status_code, resp.read(), self.model)
                self._read_events(resp)
        except ServerError as e:
            self._fail(e)
        except httpx.HTTPError as e:
            self._fail(c._transport_error(e, "in the middle of the reply" if "first_byte" in self.stamps
                                          else "before answering"))
        except Exception as e:  # noqa: BLE001 - anything else ends this reply, with its words
            self._fail(ServerError("dropped", f"the reply from {c.url} failed: {type(e).__name__}: {e}"))

    def _fail(self, error: ServerError) -> None:
        if self.aborted:
            return  # we closed it: what the reader saw afterwards is no failure
        self.stamp("end")
        self.events.put(("error", error))

    def _read_events(self, resp) -> None:
        buf = b""
        data: list[str] = []
        pieces = resp.iter_raw()
        for piece in pieces:
            if self.aborted:
                return
            self.received_bytes += len(piece)
            buf += piece
            while b"\n" in buf:
                raw, buf = buf.split(b"\n", 1)
                line = raw.rstrip(b"\r").decode("utf-8", "replace")
                if line:
                    if line.startswith(":"):
                        continue  # an SSE comment
                    name, _, value = line.partition(":")
                    if name == "data":
                        data.append(value[1:] if value.startswith(" ") else value)
                    continue
                if not data:
                    continue
                event, data = "\n".join(data), []
                if self._dispatch(event):
                    for _ in pieces:  # read to the end of the body, so the connection can serve the next turn
                        if self.aborted:
                            break
                    return
        if not self.aborted:
            raise ServerError("dropped", f"the server at {self.client.url} ended the reply without its [DONE] "
                                         f"marker (the connection closed part-way)")

    def _dispatch(self, event: str) -> bool:
        """One SSE event; True at the end of the reply."""
        url = self.client.url
        try:
            chunk = parse_event(event)
        except MalformedChunk as e:
            raise ServerError("malformed", f"the server at {url} sent a chunk this client cannot read: {e}") from None
        if chunk.done:
            self.stamp("end")
            self.events.put(("end", None))
            return True
        if chunk.error is not None:
            err = chunk.error
            code = err.get("code")
            raise ServerError("stream_error", f"the server at {url} failed during the reply"
                                              f"{f' ({code})' if code else ''}: {err.get('message') or err}",
                              code if isinstance(code, int) else None)
        for text in chunk.text:
            self.stamp("first_text")
            self.events.put(("text", text))
        for b64 in chunk.audio:
            try:
                samples, rate = decode_audio(b64)
            except MalformedChunk as e:
                raise ServerError("malformed", f"the server at {url} sent an audio chunk this client cannot "
                                               f"read: {e}") from None
            self.stamp("first_audio")
            self.events.put(("audio", (samples, rate)))
        return False
