"""The conversation engine: turn state machine, endpointing, timeline, executors, playback."""
