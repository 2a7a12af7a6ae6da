"""The desktop window: conversation, latency overlay, and the Qt side of the engine bridge.

Threads: the Qt main thread only paints.  Model loading, session start/stop and
checkpoint discovery run on a thread pool (:mod:`.worker`); the engine reports
through :class:`.bridge.EngineBridge`, whose signals reach the window as queued
events.
"""
