"""The network share of a remote turn, in words (the terminal and the latency overlay say the same)."""

from __future__ import annotations


def network_summary(network: dict | None, voice_to_voice_s: float | None = None) -> str | None:
    """One line from a turn's ``network`` record (RemoteExecutor.turn_extras), or None without one:
    when the first byte, text and audio came after the request, and which share of the
    voice-to-voice time the server and the network took (request sent -> first audio)."""
    if not network:
        return None

    def ms(key: str) -> str:
        value = network.get(key)
        return "–" if value is None else f"{value:.0f} ms"

    parts = [f"first byte {ms('first_byte_ms')}", f"first text {ms('first_text_ms')}",
             f"first audio {ms('first_audio_ms')}"]
    if network.get("aborted_ms") is not None:
        parts.append(f"aborted at {ms('aborted_ms')}")
    line = "server + network: " + ", ".join(parts) + " after the request"
    first_audio = network.get("first_audio_ms")
    if first_audio is not None and voice_to_voice_s:
        share = 100.0 * first_audio / (voice_to_voice_s * 1000.0)
        line += f" ({min(share, 100.0):.0f}% of the voice-to-voice time)"
    if network.get("audio_only_at_end"):
        line += "; the audio came only when the reply was complete"
    if network.get("error"):
        line += f"; failed: {network['error']}"
    return line
