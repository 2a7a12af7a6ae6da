"""Running the model on a vLLM-Omni server: the same engine, barge-in and window, the model remote.

* :mod:`.protocol` -- the request and stream format of vLLM-Omni's chat completions (the pinned
  release, and the files and functions it follows);
* :mod:`.client` -- HTTP (httpx): the model list, one streamed reply per turn on a reader thread,
  abort on barge-in, every failure a :class:`~.client.ServerError` naming the server;
* :mod:`.executor` -- :class:`~.executor.RemoteExecutor`, the turn-based executor whose model is
  the server (history on the client, heard-text truncation, the ``network`` timeline record);
* :mod:`.frontend` -- ``--server`` for ``talk``/``live`` and the window's "Server…" entry.
"""
