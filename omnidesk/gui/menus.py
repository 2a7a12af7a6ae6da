"""The main window's menu bar: File (export, log, quit), Conversation (the talk controls' keys), View.

:func:`build_menus` makes the actions; each calls what a panel already does, so a key and its button
are the same path.  The window keeps the actions that follow a control's state: Mute follows the
mute button both ways, and the overlay item is unticked when the overlay is closed.
"""

from __future__ import annotations

from PySide6.QtCore import Qt
from PySide6.QtGui import QAction, QKeySequence


def build_menus(window) -> None:
    """The menus of the :class:`.main_window.MainWindow`; sets ``stop_action``, ``mute_action`` and
    ``overlay_action`` on it."""

    def action(menu, text, slot, shortcut=None, checkable=False, app_wide=False) -> QAction:
        a = QAction(text, window)
        if shortcut:
            a.setShortcut(QKeySequence(shortcut))
            if app_wide:  # also while the overlay has the focus
                a.setShortcutContext(Qt.ShortcutContext.ApplicationShortcut)
        a.setCheckable(checkable)
        (a.toggled if checkable else a.triggered).connect(slot)
        menu.addAction(a)
        return a

    talk, export = window.talk, window.overlay_control
    bar = window.menuBar()
    file = bar.addMenu("&File")
    action(file, "Export timeline as &JSON…", lambda: export.choose_export("json"), "Ctrl+E")
    action(file, "Export timeline as &CSV…", lambda: export.choose_export("csv"))
    action(file, "Open the &log file", window.open_log)
    file.addSeparator()
    action(file, "&Quit", window.close, QKeySequence.StandardKey.Quit)
    conversation = bar.addMenu("&Conversation")
    window.stop_action = action(conversation, "&Stop reply", talk.stop_reply, "Esc")
    window.mute_action = action(conversation, "&Mute microphone", talk.mute_button.setChecked, "Ctrl+M",
                                checkable=True)
    talk.mute_button.toggled.connect(window.mute_action.setChecked)
    action(conversation, "Speak a sound &file…", talk.choose_sound_file, "Ctrl+O")
    action(conversation, "&Repeat last question", talk.repeat_last_question, "Ctrl+R")
    action(conversation, "&Interrupt the reply after the set time", talk.arm_interrupt_after, "Ctrl+I")
    view = bar.addMenu("&View")
    window.overlay_action = action(view, "&Latency overlay", export.set_visible, "F2", checkable=True,
                                   app_wide=True)
