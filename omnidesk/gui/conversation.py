"""The window's conversation: the current session and its bridge, opened and closed off the UI thread.

One session at a time.  Opening a new one (other devices, another model, a
retry) closes the old one in the background, and the new one starts only once
the old one has closed: both would drive the same executor.  Updates from a
session that was replaced are dropped here, so the window only hears the
current one.  A session is the live audio session or the sound-file
microphone (:class:`.file_mic.FileMicSession`); both have the same interface.
"""

from __future__ import annotations

import logging
import threading

from PySide6.QtCore import QObject, Qt, Signal

from omnidesk.engine.timeline import Timeline

from .bridge import EngineBridge
from .worker import run_in_background

log = logging.getLogger("omnidesk.gui")


class Conversation(QObject):
    started = Signal(object)  # the session, now running
    failed = Signal(object)  # the exception: the session could not be created or started
    state_changed = Signal(object)  # TurnState
    turn_updated = Signal(object)  # TurnView: a new turn, streaming text, a reply played to the end
    turn_interrupted = Signal(object)  # TurnView of a cut reply
    turn_failed = Signal(object, str)  # TurnView (or None), plain words: a turn failed, the session goes on
    status_changed = Signal(object)  # the latest LiveStatus-like status
    duplex_changed = Signal(object)  # the latest DuplexShown (full-duplex models)
    stopped = Signal(str)  # the running session stopped by itself (device lost ...), in plain words

    def __init__(self, session_factory, parent: QObject | None = None):
        super().__init__(parent)
        self.session_factory = session_factory
        self.session = None
        self.bridge: EngineBridge | None = None
        self.timeline: Timeline | None = None  # the current session's
        self.running = False
        self._previous_closed = threading.Event()  # set once the last closed session has finished closing
        self._previous_closed.set()
        self._starting: dict[int, threading.Event] = {}  # id(session) -> set when its start() returned

    # ------------------------------------------------------------------ lifecycle (UI thread)
    def open(self, kind: str, loaded, live_settings, engine_config) -> None:
        """Close the current session and start a new one (a new conversation) on ``loaded``."""
        self.close()
        bridge = EngineBridge(decode=loaded.executor.decode, model=loaded.timeline_model_info(),
                              device=loaded.device, parent=self)
        queued = Qt.ConnectionType.QueuedConnection
        bridge.state_changed.connect(self._relay_state, queued)
        bridge.turn_started.connect(self._relay_turn, queued)
        bridge.turn_changed.connect(self._relay_turns, queued)
        bridge.turn_done.connect(self._relay_turn, queued)
        bridge.turn_interrupted.connect(self._relay_interrupted, queued)
        bridge.status_changed.connect(self._relay_status, queued)
        bridge.error.connect(self._relay_error, queued)
        bridge.turn_failed.connect(self._relay_failed, queued)
        bridge.duplex_changed.connect(self._relay_duplex, queued)
        timeline = Timeline(model=loaded.timeline_model_info(), device=loaded.device)
        try:
            session = self.session_factory(kind, loaded.executor, live_settings, engine_config, bridge.on_update,
                                           timeline)
        except Exception as e:  # noqa: BLE001 - shown in words by the window; details logged
            log.exception("cannot create the session")
            self.failed.emit(e)
            return
        self.bridge, self.session, self.timeline = bridge, session, timeline
        self._start(session)

    def restart(self) -> bool:
        """After a device error: start the same session again (same conversation) if it can."""
        if self.session is None or not hasattr(self.session, "restart"):
            return False
        self._start(self.session, restart=True)
        return True

    def close(self) -> None:
        """Drop the current session; it closes in the background."""
        session, self.session = self.session, None
        if self.bridge is not None:
            self.bridge.blockSignals(True)  # late updates of the old session are dropped
            self.bridge = None
        self.timeline = None
        self.running = False
        if session is None:
            return
        closed = threading.Event()
        self._previous_closed = closed
        started = self._starting.pop(id(session), None)

        def close(progress):
            try:
                if started is not None:
                    started.wait(timeout=60)  # closing a session that is still starting would race it
                session.close()
            finally:
                closed.set()

        run_in_background("closing the conversation", close)

    def shutdown(self) -> None:
        """At exit, after the window is gone: close the session and wait for it."""
        session, self.session = self.session, None
        if self.bridge is not None:
            self.bridge.blockSignals(True)
        self.running = False
        if session is None:
            return
        started = self._starting.pop(id(session), None)
        if started is not None:
            started.wait(timeout=60)
        try:
            session.close()
        except Exception:
            log.exception("closing the session")

    def timeline_dict(self, extra: dict | None = None) -> dict:
        """The current session's timelines (contract JSON)."""
        if self.bridge is None:
            return {"model": {}, "device": "", "turns": []}
        extra = dict(extra or {})
        # a full-duplex session has no turns: its timeline is the engine's "duplex" section, which
        # the engine replaces whole (never edits in place) at each event, so reading it here is safe
        duplex = self.timeline.extra.get("duplex") if self.timeline is not None else None
        if duplex is not None:
            extra["duplex"] = duplex
        return self.bridge.timeline_dict(extra)

    def _start(self, session, restart: bool = False) -> None:
        previous_closed = self._previous_closed
        self.running = False
        started = self._starting[id(session)] = threading.Event()

        def start(progress):
            try:
                previous_closed.wait(timeout=60)  # the old session must be gone: same executor
                # start() begins a new conversation; restart() keeps it (the retry after a device error)
                session.restart() if restart else session.start()
                return session
            finally:
                started.set()

        run_in_background("starting the conversation", start, on_done=self._on_started,
                          on_failed=lambda e, s=session: self._on_failed(e, s))

    def _on_started(self, session) -> None:
        if session is not self.session:
            return  # replaced while it was starting (close() has it)
        self.running = True
        self.started.emit(session)

    def _on_failed(self, exc: BaseException, session) -> None:
        if session is not self.session:
            return
        self._starting.pop(id(session), None)
        self.session = None
        self.running = False
        if self.bridge is not None:
            self.bridge.blockSignals(True)
            self.bridge = None
        self.failed.emit(exc)

    # ------------------------------------------------------------------ engine updates (queued from the bridge)
    def _current(self) -> bool:
        return self.bridge is not None and self.sender() is self.bridge

    def _relay_state(self, state) -> None:
        if self._current():
            self.state_changed.emit(state)

    def _relay_turn(self, view) -> None:
        if self._current():
            self.turn_updated.emit(view)

    def _relay_turns(self) -> None:
        if self._current():
            for view in self.bridge.take_turns():
                self.turn_updated.emit(view)

    def _relay_interrupted(self, view) -> None:
        if self._current():
            self.turn_interrupted.emit(view)

    def _relay_status(self) -> None:
        if self._current():
            self.status_changed.emit(self.bridge.take_status())

    def _relay_duplex(self) -> None:
        if self._current():
            shown = self.bridge.take_duplex()
            if shown is not None:
                self.duplex_changed.emit(shown)

    def _relay_failed(self, view, message: str) -> None:
        if self._current():
            self.turn_failed.emit(view, message)

    def _relay_error(self, message: str) -> None:
        if self._current():
            self.running = False
            self.stopped.emit(message)
