"""CrashRecorder: the window of recent requests and the JSON file written when the engine dies."""

from __future__ import annotations

import json

from servelm.engine.crash_dump import CrashRecorder
from servelm.sampling.params import SamplingParams


def test_dump_holds_in_flight_and_finished_requests(tmp_path):
    recorder = CrashRecorder(str(tmp_path / "dumps"))
    recorder.record("a", [1, 2, 3], SamplingParams(max_tokens=5, temperature=0.0), priority=0)
    recorder.record("b", [4, 5], SamplingParams(max_tokens=7), priority=2)
    recorder.finish("a", "length", 5)
    path = recorder.dump("engine process exited (exit code -9)")
    assert path is not None and path.parent == tmp_path / "dumps"
    body = json.loads(path.read_text())
    assert body["reason"] == "engine process exited (exit code -9)"
    assert body["num_in_flight"] == 1
    by_id = {r["request_id"]: r for r in body["requests"]}
    assert by_id["a"]["prompt_token_ids"] == [1, 2, 3]
    assert by_id["a"]["finish_reason"] == "length" and by_id["a"]["num_output_tokens"] == 5
    assert by_id["a"]["sampling_params"]["max_tokens"] == 5
    assert by_id["b"]["finish_reason"] is None and by_id["b"]["priority"] == 2


def test_records_older_than_the_window_are_dropped(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr("servelm.engine.crash_dump.time.time", lambda: clock[0])
    recorder = CrashRecorder(str(tmp_path), window_s=60)
    recorder.record("old", [1], SamplingParams(), 0)
    clock[0] += 30
    recorder.record("mid", [2], SamplingParams(), 0)
    clock[0] += 45  # "old" is now 75 s old, "mid" 45 s
    recorder.record("new", [3], SamplingParams(), 0)
    body = json.loads(recorder.dump("test").read_text())
    assert [r["request_id"] for r in body["requests"]] == ["mid", "new"]


def test_an_unwritable_folder_is_logged_not_raised(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    recorder = CrashRecorder(str(blocker / "dumps"))
    recorder.record("a", [1], SamplingParams(), 0)
    assert recorder.dump("test") is None
