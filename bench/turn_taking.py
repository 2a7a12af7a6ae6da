#!/usr/bin/env python
"""Turn-taking benchmark (issue 13): the fixed 400 ms silence rule vs the Smart Turn end-of-turn
model, through ``omnidesk talk`` on the labelled espeak-ng set (tests/turn_taking_set.py).

For each policy (``--end-of-turn fixed``, then ``smart`` when its optional packages are
installed) ONE ``omnidesk talk --fast`` run plays every item of the set, in manifest order, as
consecutive ``--input`` utterances: the same files for both policies.  Each turn of the
timeline is mapped back to the item it came from (see :func:`map_turns`), then:

* complete items: end of speech -> playback start (the timeline's voice-to-voice:
  ``events.playback_start - user_speech_end``), median and p90; also end of speech -> endpoint,
  and the same from the labelled end of speech;
* incomplete items: false endpoints = turns that ended before the user finished the sentence
  (all of them fall in the labelled mid-sentence pause), replies that started playing inside
  the pause, items cut;
* the end-of-turn model's scores (``extra["end_of_turn"]["scores"]``): CPU ms per score and
  p_complete in the mid-sentence pauses vs after complete sentences.

Run:  .venv/bin/python bench/turn_taking.py [--policies fixed,smart] [--limit N] [--dir DIR]
      [--vad webrtc|energy] [--realtime] [--out FILE]    (JSON on stdout; also to FILE)

About 1-2 minutes per policy on 2 CPU cores with the demo model (16 items).  The espeak set is a
quick smoke run: Smart Turn is at chance on espeak speech.

``--set DIR`` runs a labelled folder of recorded speech instead (``labels.csv`` with ``file``,
``label`` = complete | pause, ``speech_end_s``; a README table with a ``speaker`` column is
read when present), e.g. ``../shared/data/turns-human``, default policies ``fixed,auto`` (auto:
what a user gets with no flag).  Per policy, under ``"policies"``: ``detector``, ``files``,
``cut_ins`` (files where the user was cut off: early or a false endpoint), ``early_cutins`` (the turn ended before the labelled
speech end), ``false_endpoints`` (a ``pause`` file's turn ended within its trailing silence:
the speaker went on after it), ``missed`` (a ``complete`` file with no endpoint within its
trailing silence; its latency counts as that silence), ``endpoint_ms`` and ``playback_ms``
{median, p90} (endpoint / playback start minus the labelled speech end, ``complete`` files),
``cpu_ms_per_score`` {median, p90} or null, and ``per_speaker`` (the same counts per speaker).
About 2 minutes per policy for the 30 files of turns-human.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import turn_taking_set  # noqa: E402  (the labelled set's generator)
from report import load_avg, machine, report  # noqa: E402

POLICIES = ("fixed", "smart", "auto")
try:  # talk's schedule: the lead-in silence before the first input, the frame grid
    from omnidesk.engine.talk import FRAME_S, GAP_S, LEAD_SILENCE_S
except ImportError:  # pragma: no cover - keep the bench readable if talk moves
    FRAME_S, GAP_S, LEAD_SILENCE_S = 0.04, 0.6, 0.3


def percentile(values: list[float], q: float) -> float | None:
    return None if not values else float(np.percentile(np.asarray(values, float), q))


def stats_ms(values_s: list[float]) -> dict:
    """median / p90 / mean / min / max in ms of a list of seconds (None when empty)."""
    ms = [1000.0 * v for v in values_s]

    def r(v):
        return None if v is None else round(v, 1) + 0.0  # + 0.0: no "-0.0" in the JSON

    return {"n": len(ms), "median_ms": r(percentile(ms, 50)), "p90_ms": r(percentile(ms, 90)),
            "mean_ms": r(float(np.mean(ms)) if ms else None), "min_ms": r(min(ms) if ms else None),
            "max_ms": r(max(ms) if ms else None)}


# ------------------------------------------------------------------ policy availability


def smart_unavailable() -> str | None:
    """Why ``--end-of-turn smart`` cannot run here (None: it can), asked without loading a model
    where the product says so; the talk run itself is the final word (its error is reported)."""
    try:
        from omnidesk.engine.smart_turn import SmartTurn, TurnModelUnavailable
    except ImportError as e:
        return f"omnidesk has no Smart Turn support ({e})"
    try:
        SmartTurn.load()
    except TurnModelUnavailable as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a broken install is a reason too
        return f"{type(e).__name__}: {e}"
    return None


# ------------------------------------------------------------------ the talk run


def run_talk(policy: str, paths: list[str], workdir: Path, args) -> dict:
    """One ``omnidesk talk`` over all items; returns {rc, wall_s, timeline | None, stdout, stderr}."""
    timeline = workdir / f"timeline-{policy}.json"
    cmd = [sys.executable, "-m", "omnidesk", "talk", "--model", args.model, "--device", args.device,
           "--end-of-turn", policy, "--vad", args.vad, "--output", str(workdir / f"reply-{policy}.wav"),
           "--timeline", str(timeline), "--max-codec-tokens", str(args.max_codec_tokens)]
    if not args.realtime:
        cmd.append("--fast")
    shown = [c if c != sys.executable else "python" for c in cmd] + ["--input", "ITEM.wav", "..."]
    for p in paths:
        cmd += ["--input", p]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout)
    wall = time.perf_counter() - t0
    data = json.loads(timeline.read_text()) if timeline.exists() else None
    return {"rc": proc.returncode, "wall_s": round(wall, 1), "timeline": data, "stdout": proc.stdout,
            "stderr": proc.stderr, "cmd": " ".join(shown)}


# ------------------------------------------------------------------ turns -> items


def frames(seconds: float) -> int:
    return int(math.ceil(seconds / FRAME_S - 1e-9))


def map_turns(items: list[dict], turns: list[dict]) -> tuple[list[list[int]], list[float | None], dict]:
    """Which turns belong to which item, and each item's start on the session clock.

    talk's schedule: LEAD_SILENCE_S of silence, then each input (padded with zeros to whole 40 ms
    frames), then silence until the engine is idle (the reply has finished playing), then
    GAP_S more, then the next input.  The first input starts at a known time; the others start
    after a reply of varying length, which the timeline does not record, so an item's start is
    inferred from its first turn: that turn's ``user_speech_start`` is the first frame the
    speech detector heard speech in, i.e. the frame holding the item's labelled speech onset
    (the items have digital silence before it, so nothing earlier is heard).  A turn belongs to
    the current item while it starts before the item's last frame; the next item cannot start
    earlier than that plus GAP_S.  Checked: the first item's inferred start against the known
    one (``first_item_offset_ms``) and every turn's speech within its item (``problems``).
    """
    lead = int(round(LEAD_SILENCE_S / FRAME_S)) * FRAME_S  # the same expression talk uses
    groups: list[list[int]] = [[] for _ in items]
    starts: list[float | None] = [None] * len(items)
    problems: list[str] = []
    first_offset = None
    k = -1  # current item
    for j, turn in enumerate(turns):
        t0 = turn.get("user_speech_start")
        if t0 is None:
            problems.append(f"turn {j}: no user_speech_start")
            continue
        if k >= 0 and starts[k] is not None and t0 < starts[k] + frames(items[k]["duration_s"]) * FRAME_S:
            groups[k].append(j)
            continue
        # a new item: the next one in order
        k += 1
        if k >= len(items):
            problems.append(f"turn {j} at {t0:.2f} s: after the last item's end")
            k = len(items) - 1
            continue
        onset_frame = math.floor(items[k]["speech"][0][0] / FRAME_S + 1e-9) * FRAME_S
        est = round((t0 - onset_frame) / FRAME_S) * FRAME_S
        if k == 0:
            first_offset = round((est - lead) * 1000.0, 1) + 0.0
            if abs(first_offset) > 1000 * FRAME_S + 1e-6:
                problems.append(f"item {items[0]['id']}: its first turn starts {first_offset:+.0f} ms from where its "
                                f"speech onset is (the speech detector missed it, or the mapping is off)")
            est = lead  # known exactly
        elif starts[k - 1] is not None:
            earliest = starts[k - 1] + frames(items[k - 1]["duration_s"]) * FRAME_S + GAP_S
            if est < earliest - 1e-6:
                problems.append(f"item {items[k]['id']}: inferred start {est:.2f} s is before the earliest "
                                f"possible {earliest:.2f} s (its first turn began before its speech?)")
        starts[k] = est
        groups[k].append(j)
    for k, item in enumerate(items):
        if not groups[k]:
            problems.append(f"item {item['id']}: no turn (the speech detector heard nothing, or the mapping "
                            f"shifted: every later item may be off by one)")
            continue
        end = starts[k] + frames(item["duration_s"]) * FRAME_S
        for j in groups[k]:
            t = turns[j]
            if t.get("user_speech_end") is not None and t["user_speech_end"] > end + FRAME_S + 1e-6:
                problems.append(f"item {item['id']}: turn {j}'s speech ends at {t['user_speech_end']:.2f} s, "
                                f"after the item's end {end:.2f} s")
    return groups, starts, {"first_item_offset_ms": first_offset, "lead_s": lead, "problems": problems}


# ------------------------------------------------------------------ metrics


def end_of_turn(turn: dict) -> dict:
    eot = turn.get("end_of_turn")
    return eot if isinstance(eot, dict) else {}


def analyse(items: list[dict], timeline: dict) -> dict:
    turns = timeline.get("turns", [])
    groups, starts, mapping = map_turns(items, turns)
    rows = []
    v2v, v2v_label, to_endpoint, ep_to_play, tl_v2v = [], [], [], [], []
    v2v_incomplete_final = []
    false_ep = in_pause = played_in_pause = played_early = cut_items = 0
    complete_split = 0
    missing_latency = []
    cpu_ms, p_pause, p_final, decisions = [], [], [], {}
    first_pause_scores, first_end_scores = [], []  # per item, None: not scored there
    detectors = sorted({str(end_of_turn(t).get("detector")) for t in turns if end_of_turn(t)})
    ended_by = {}
    for t in turns:
        by = end_of_turn(t).get("ended_by")
        if by is not None:
            ended_by[str(by)] = ended_by.get(str(by), 0) + 1
    for k, item in enumerate(items):
        s = starts[k]
        row = {"id": item["id"], "kind": item["kind"], "voice": item["voice"], "rate": item["rate"],
               "pause_ms": item["pause_ms"], "turns": groups[k], "start_s": s}
        rows.append(row)
        if s is None:
            continue
        speech_end = s + item["speech"][-1][1]
        pause = None if item["pause"] is None else (s + item["pause"][0], s + item["pause"][1])
        final = None
        premature = []
        for j in groups[k]:
            t = turns[j]
            ep = t.get("endpoint")
            if ep is None:
                continue
            if ep < speech_end - 1e-6:
                premature.append(j)
            elif final is None:
                final = j
        row["false_endpoints"] = len(premature)
        if item["kind"] == "incomplete":
            false_ep += len(premature)
            cut_items += bool(premature)
            for j in premature:
                t = turns[j]
                if pause[0] - 1e-6 <= t["endpoint"] <= pause[1] + FRAME_S + 1e-6:
                    in_pause += 1
            for j in groups[k]:
                ps = turns[j]["events"].get("playback_start")
                if ps is not None and ps < speech_end - 1e-6:
                    played_early += 1
                    if pause[0] - 1e-6 <= ps <= pause[1] + 1e-6:
                        played_in_pause += 1
        else:
            complete_split += len(premature)
        # scores: in the labelled pause of an incomplete item / after a complete sentence
        first_in_pause = first_after_end = None
        for j in groups[k]:
            for sc in end_of_turn(turns[j]).get("scores") or []:
                if not isinstance(sc, dict):
                    continue
                if isinstance(sc.get("cpu_ms"), (int, float)):
                    cpu_ms.append(float(sc["cpu_ms"]))
                d = str(sc.get("decision"))
                decisions[d] = decisions.get(d, 0) + 1
                tsc, p = sc.get("t"), sc.get("p_complete")
                if tsc is None or p is None:
                    continue
                if pause is not None and pause[0] <= tsc <= pause[1] + FRAME_S:
                    p_pause.append(float(p))
                    if first_in_pause is None:
                        first_in_pause = float(p)
                elif item["kind"] == "complete" and tsc >= speech_end:
                    p_final.append(float(p))
                    if first_after_end is None:
                        first_after_end = float(p)
        if item["kind"] == "incomplete":
            first_pause_scores.append(first_in_pause)
        else:
            first_end_scores.append(first_after_end)
        if final is None:
            missing_latency.append(item["id"])
            continue
        t = turns[final]
        ps, end, ep = t["events"].get("playback_start"), t.get("user_speech_end"), t.get("endpoint")
        row["final_turn"] = final
        row["end_to_endpoint_ms"] = None if end is None else round(1000 * (ep - end), 1)
        row["voice_to_voice_ms"] = None if ps is None or end is None else round(1000 * (ps - end), 1)
        row["ended_by"] = end_of_turn(t).get("ended_by")
        scores = end_of_turn(t).get("scores") or []
        if scores:
            row["last_score"] = {k2: scores[-1].get(k2) for k2 in ("silence_ms", "p_complete", "decision")}
        if ps is None or end is None:
            missing_latency.append(item["id"])
            continue
        if item["kind"] == "complete":
            v2v.append(ps - end)
            v2v_label.append(ps - speech_end)
            to_endpoint.append(ep - end)
            ep_to_play.append(ps - ep)
            for key in ("voice_to_voice_ms", "voice_to_voice_s"):  # if the timeline ever carries its own
                if isinstance(t.get(key), (int, float)):
                    tl_v2v.append(t[key] / (1000.0 if key.endswith("_ms") else 1.0))
        else:
            v2v_incomplete_final.append(ps - end)
    n_complete = sum(it["kind"] == "complete" for it in items)
    n_incomplete = len(items) - n_complete
    out = {
        "detector": detectors[0] if len(detectors) == 1 else (detectors or None),
        "ended_by": ended_by,
        "turns": len(turns),
        "interrupted_turns": sum(bool(t.get("interrupted")) for t in turns),
        "complete": {
            "items": n_complete,
            "voice_to_voice": stats_ms(v2v),  # user_speech_end -> playback_start: the headline
            "label_end_to_playback": stats_ms(v2v_label),  # labelled end of speech -> playback_start
            "end_to_endpoint": stats_ms(to_endpoint),
            "endpoint_to_playback": stats_ms(ep_to_play),
            "split_turns": complete_split,  # endpoints before a complete sentence ended (should be 0)
        },
        "incomplete": {
            "items": n_incomplete,
            "false_endpoints": false_ep,  # turns ended before the user finished the sentence
            "false_endpoints_in_pause": in_pause,
            "items_cut": cut_items,
            "replies_started_before_done": played_early,  # playback_start before the sentence ended
            "replies_started_in_pause": played_in_pause,
            "final_voice_to_voice": stats_ms(v2v_incomplete_final),  # after the rest of the sentence
        },
        "scores": {
            "n": sum(decisions.values()),
            "decisions": decisions,
            "cpu_ms": {"n": len(cpu_ms), "median": percentile(cpu_ms, 50), "p90": percentile(cpu_ms, 90),
                       "max": max(cpu_ms) if cpu_ms else None},
            # every score in a labelled mid-sentence pause / after a complete sentence ended
            "p_complete_in_pauses": {"n": len(p_pause), "median": percentile(p_pause, 50),
                                     "max": max(p_pause) if p_pause else None},
            "p_complete_after_complete": {"n": len(p_final), "median": percentile(p_final, 50),
                                          "min": min(p_final) if p_final else None},
            # the first score of each pause / each sentence end, in item order (what decides most turns)
            "first_p_complete_in_pause": [None if p is None else round(p, 3) for p in first_pause_scores],
            "first_p_complete_after_complete": [None if p is None else round(p, 3) for p in first_end_scores],
        },
        "missing_latency": missing_latency,
        "mapping": mapping,
        "items": rows,
    }
    if tl_v2v:
        out["complete"]["timeline_voice_to_voice"] = stats_ms(tl_v2v)
    out["checks"] = {
        "every_item_mapped": all(groups),
        "turns_accounted": sum(len(g) for g in groups) == len(turns),
        "items_add_up": n_complete + n_incomplete == len(items),
    }
    return out


def run_policy(policy: str, paths: list[str], score, workdir: Path, args) -> dict:
    """One talk run of ``policy`` over ``paths``; ``score(timeline)`` gives its figures (merged into
    the entry, also for a run that failed part-way and left a timeline)."""
    if policy == "smart":
        reason = smart_unavailable()
        if reason:
            return {"status": "skipped", "reason": reason}
    run = run_talk(policy, paths, workdir, args)
    result = {"status": "ok", "wall_s": run["wall_s"], "command": run["cmd"]}
    if run["rc"] != 0 or run["timeline"] is None:
        err = (run["stderr"].strip().splitlines() or ["(no message)"])[-1]
        if policy == "smart" and "--end-of-turn smart" in run["stderr"]:
            return {"status": "skipped", "reason": err}
        result.update(status="failed", rc=run["rc"], error=err, stdout_tail=run["stdout"][-2000:])
        if run["timeline"] is None:
            return result
    result.update(score(run["timeline"]))
    if args.keep:
        result["timeline_path"] = str(workdir / f"timeline-{policy}.json")
    return result


def bench_policy(policy: str, items: list[dict], workdir: Path, args) -> dict:
    """The espeak set's run of one policy."""
    return run_policy(policy, [it["path"] for it in items], lambda timeline: analyse(items, timeline), workdir, args)


def talk_settings(args) -> dict:
    return {"model": args.model, "device": args.device, "vad": args.vad, "fast": not args.realtime,
            "max_codec_tokens": args.max_codec_tokens, "frame_s": FRAME_S, "gap_s": GAP_S}


def run_policies(policies: list[str], args, run_one) -> dict:
    """{policy: run_one(policy, workdir)}, in a temp folder (or --keep's)."""
    with tempfile.TemporaryDirectory(prefix="omnidesk-turn-bench-") as tmp:
        workdir = Path(args.keep) if args.keep else Path(tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        return {policy: run_one(policy, workdir) for policy in policies}


# ------------------------------------------------------------------ a labelled folder (--set)


def read_labelled_set(folder: Path) -> list[dict]:
    """The files of a labelled folder: [{file, path, label, speech_end_s, duration_s, speaker}].

    Raises ValueError naming the file and field that is wrong."""
    import csv
    import wave

    labels = folder / "labels.csv"
    if not labels.is_file():
        raise ValueError(f"{folder}: no labels.csv (expected columns file,label,speech_end_s)")
    speakers = {}
    readme = folder / "README.md"
    if readme.is_file():  # the README's file table: | file | label | speech_end_s | speaker | ...
        header = None
        for line in readme.read_text(encoding="utf-8").splitlines():
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            if "file" in cells and "speaker" in cells:
                header = cells
            elif header and len(cells) == len(header) and cells[0].endswith(".wav"):
                speakers[cells[header.index("file")]] = cells[header.index("speaker")]
    files = []
    with labels.open(newline="", encoding="utf-8") as f:
        for n, row in enumerate(csv.DictReader(f), start=2):
            where = f"{labels}, line {n}"
            missing = [k for k in ("file", "label", "speech_end_s") if not (row.get(k) or "").strip()]
            if missing:
                raise ValueError(f"{where}: no {', '.join(missing)}")
            if row["label"] not in ("complete", "pause"):
                raise ValueError(f"{where}: label must be complete or pause, got {row['label']!r}")
            path = folder / row["file"]
            try:
                end = float(row["speech_end_s"])
                with wave.open(str(path)) as w:
                    duration = w.getnframes() / w.getframerate()
            except ValueError as e:
                raise ValueError(f"{where}: speech_end_s {row['speech_end_s']!r}: {e}") from None
            except (OSError, EOFError, wave.Error) as e:
                raise ValueError(f"{path}: not a readable WAV file ({e})") from None
            if not 0 < end <= duration:
                raise ValueError(f"{where}: speech_end_s {end} is outside {path.name} (0-{duration:.3f} s)")
            files.append({"file": row["file"], "path": str(path), "label": row["label"], "speech_end_s": end,
                          "duration_s": duration, "speaker": speakers.get(row["file"], "unknown")})
    if not files:
        raise ValueError(f"{labels}: no files listed")
    return files


def _med_p90(values: list[float]) -> dict:
    def r(v):
        return None if v is None else round(v, 1) + 0.0

    return {"median": r(percentile(values, 50)), "p90": r(percentile(values, 90))}


def score_set(files: list[dict], timeline: dict) -> dict:
    """The issue-27 figures of one policy's talk run over ``files`` (see the module docstring).

    A turn belongs to the file its speech started in: talk records where each input was played
    (``inputs``: start and end on the session clock)."""
    inputs, turns = timeline.get("inputs") or [], timeline.get("turns", [])
    if len(inputs) != len(files):
        raise ValueError(f"the timeline lists {len(inputs)} inputs for {len(files)} files")
    starts = [x["start_s"] for x in inputs] + [math.inf]
    rows, cpu = [], []
    detectors = set()
    for i, f in enumerate(files):
        own = [t for t in turns if t.get("user_speech_start") is not None
               and starts[i] <= t["user_speech_start"] < starts[i + 1]]
        speech_end = starts[i] + f["speech_end_s"]
        silence_end = starts[i] + f["duration_s"]  # the file's trailing silence ends here
        ends = [t for t in own if t.get("endpoint") is not None]
        early = [t for t in ends if t["endpoint"] < speech_end]
        after = [t for t in ends if t["endpoint"] >= speech_end]
        final = after[0] if after else None
        in_silence = final is not None and final["endpoint"] < silence_end
        row = {"file": f["file"], "label": f["label"], "speaker": f["speaker"], "turns": len(own),
               "early_cutin": bool(early), "false_endpoint": f["label"] == "pause" and in_silence}
        if final is not None:
            row["endpoint_ms"] = round(1000 * (final["endpoint"] - speech_end), 1)
            play = (final.get("events") or {}).get("playback_start")
            row["playback_ms"] = None if play is None else round(1000 * (play - speech_end), 1)
            row["ended_by"] = end_of_turn(final).get("ended_by")
        if f["label"] == "complete":
            row["missed"] = not in_silence
        for t in own:
            eot = end_of_turn(t)
            if eot:
                detectors.add("silence" if eot.get("detector") == "fixed" else str(eot.get("detector")))
            cpu += [s["cpu_ms"] for s in eot.get("scores", []) if s.get("cpu_ms") is not None]
        rows.append(row)

    def figures(rs: list[dict]) -> dict:
        complete = [r for r in rs if r["label"] == "complete"]
        limit = {r["file"]: 1000 * next(f["duration_s"] - f["speech_end_s"] for f in files if f["file"] == r["file"])
                 for r in complete}
        # a miss counts as the whole trailing silence (the turn did not end within it)
        endpoint = [limit[r["file"]] if r["missed"] else r["endpoint_ms"] for r in complete]
        playback = [limit[r["file"]] if r["missed"] or r.get("playback_ms") is None else r["playback_ms"]
                    for r in complete]
        return {"files": len(rs), "cut_ins": sum(r["early_cutin"] or r["false_endpoint"] for r in rs),
                "early_cutins": sum(r["early_cutin"] for r in rs),
                "false_endpoints": sum(r["false_endpoint"] for r in rs),
                "missed": sum(r["missed"] for r in complete),
                "endpoint_ms": _med_p90(endpoint), "playback_ms": _med_p90(playback)}

    out = {"detector": "+".join(sorted(detectors)) or None, **figures(rows),
           "cpu_ms_per_score": _med_p90(cpu) if cpu else None, "scores": len(cpu)}
    speakers = sorted({r["speaker"] for r in rows})
    out["per_speaker"] = {sp: figures([r for r in rows if r["speaker"] == sp]) for sp in speakers}
    out["files_detail"] = rows
    return out


def bench_set(args, policies: list[str]) -> dict:
    folder = Path(args.set)
    files = read_labelled_set(folder)
    result = {
        "bench": "turn_taking",
        "machine": machine("platform", "cpu_count", load_avg_before=load_avg()),
        "set": {"dir": str(folder.resolve()), "files": len(files),
                "complete": sum(f["label"] == "complete" for f in files),
                "pause": sum(f["label"] == "pause" for f in files),
                "speakers": sorted({f["speaker"] for f in files})},
        "talk": talk_settings(args),
    }
    paths = [f["path"] for f in files]
    result["policies"] = run_policies(policies, args, lambda policy, workdir: run_policy(
        policy, paths, lambda timeline: score_set(files, timeline), workdir, args))
    result["machine"]["load_avg_after"] = load_avg()
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default=None,
                        help="comma-separated --end-of-turn values to run (default fixed,smart; smart is "
                             "reported as skipped when its packages are missing)")
    parser.add_argument("--set", help="a labelled folder of recordings (labels.csv + WAVs), e.g. "
                                      "../shared/data/turns-human; default policies then fixed,auto")
    parser.add_argument("--dir", default=str(turn_taking_set.DEFAULT_DIR), help="where the espeak set is cached")
    parser.add_argument("--limit", type=int, help="only the first N sentences (2N items)")
    parser.add_argument("--model", default="demo")
    parser.add_argument("--device", default="cpu", help="talk's --device (default cpu: the CPU demo)")
    parser.add_argument("--vad", choices=("webrtc", "energy"), default="webrtc")
    parser.add_argument("--max-codec-tokens", type=int, default=100,
                        help="reply length in codec tokens (100 = 2 s of demo audio, longer than the rest of "
                             "any sentence after its pause, so a false endpoint is heard as a cut-in)")
    parser.add_argument("--realtime", action="store_true", help="pace talk in real time (default --fast)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="per talk run, seconds")
    parser.add_argument("--keep", help="keep the talk timelines and reply WAVs in this folder")
    parser.add_argument("--out", help="also write the JSON here (e.g. bench/results/turn_taking.json)")
    args = parser.parse_args(argv)
    default = "fixed,auto" if args.set else "fixed,smart"
    policies = [p.strip() for p in (args.policies or default).split(",") if p.strip()]
    for p in policies:
        if p not in POLICIES:
            parser.error(f"unknown policy {p!r}; known: {', '.join(POLICIES)}")
    if args.set:
        try:
            result = bench_set(args, policies)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        return _report(result, args)

    manifest = turn_taking_set.ensure_set(args.dir, args.limit)
    items = manifest["items"]
    result = {
        "bench": "turn_taking",
        "machine": machine("platform", "cpu_count", load_avg_before=load_avg()),
        "set": {"dir": manifest["dir"], "version": manifest["version"], "spec": manifest["spec"],
                "espeak": manifest["espeak"], "items": len(items),
                "complete": sum(it["kind"] == "complete" for it in items),
                "incomplete": sum(it["kind"] == "incomplete" for it in items),
                "voices": sorted({it["voice"] for it in items}), "rates": sorted({it["rate"] for it in items}),
                "pauses_ms": [it["pause_ms"] for it in items if it["kind"] == "incomplete"]},
        "talk": talk_settings(args),
    }
    result["policies"] = run_policies(policies, args, lambda policy, workdir: bench_policy(policy, items, workdir, args))
    result["machine"]["load_avg_after"] = load_avg()
    fixed, smart = result["policies"].get("fixed"), result["policies"].get("smart")
    if fixed and smart and fixed.get("status") == smart.get("status") == "ok":
        f_med = fixed["complete"]["voice_to_voice"]["median_ms"]
        s_med = smart["complete"]["voice_to_voice"]["median_ms"]
        f_fe, s_fe = fixed["incomplete"]["false_endpoints"], smart["incomplete"]["false_endpoints"]
        result["comparison"] = {
            "voice_to_voice_median_ms": {"fixed": f_med, "smart": s_med},
            "false_endpoints": {"fixed": f_fe, "smart": s_fe},
            # the acceptance on the CPU demo (same files, one run)
            "smart_median_le_300ms": s_med is not None and s_med <= 300.0,
            "smart_false_endpoints_at_most_half": s_fe <= f_fe / 2.0,
        }
    return _report(result, args)


def _report(result: dict, args) -> int:
    report(result, args.out, newline=True)
    failed = [p for p, r in result["policies"].items() if r.get("status") == "failed"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
