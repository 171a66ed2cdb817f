"""Benchmark children: one process per configuration, progress and record over stdout.

The children here are small Python programs speaking the same protocol as the device
benchmark's ``--one`` children (progress lines, one record line, exit codes), so the
parent's handling of each case runs for real.
"""

from __future__ import annotations

import sys

import pytest

from vmm_bench import children, progress
from vmm_bench.errors import BenchModelError


def child(body: str) -> list[str]:
    return [sys.executable, "-c", "import sys, json\n" + body]


GOOD = child("""
for i in range(3):
    print(f"VMMPROGRESS {i} 2 vmm random: capture", flush=True)
print("some other line the parent ignores")
print("VMMBENCH " + json.dumps({"strategy": "vmm", "order": "random", "graph_bytes": 7}))
print("noise on stderr", file=sys.stderr)
""")


def test_run_child_returns_the_record_forwards_progress_and_keeps_stderr():
    seen = []
    record, rc, stderr = children.run_child(GOOD, on_progress=lambda *a: seen.append(a))
    assert rc == 0 and record == {"strategy": "vmm", "order": "random", "graph_bytes": 7}
    assert seen == [(0, 2, "vmm random: capture"), (1, 2, "vmm random: capture"),
                    (2, 2, "vmm random: capture")]
    assert stderr == "noise on stderr\n"


def test_a_failed_child_becomes_an_error_record_and_the_run_goes_on(capsys):
    crash = child("print('VMMPROGRESS 0 5 x', flush=True); raise SystemExit('it broke')")
    wrong = child("print('VMMBENCH ' + json.dumps({'strategy': 'shared', 'order': 'a', "
                  "'wrong_graphs': [[8, 0.3]]})); sys.exit(1)")
    records = children.run_configurations(
        [({"strategy": "vmm", "order": "random"}, crash),
         ({"strategy": "shared", "order": "a"}, wrong),
         ({"strategy": "vmm", "order": "random"}, GOOD)],
        quiet=False, describe=lambda r: f"  done {r['strategy']} {r['order']}")
    assert records[0]["strategy"] == "vmm" and "child exited 1: it broke" in records[0]["error"]
    assert records[1]["wrong_graphs"] == [[8, 0.3]] and "error" not in records[1]
    assert records[2]["graph_bytes"] == 7
    out = capsys.readouterr().out
    assert "vmm random: child failed (exit 1)" in out and "  done shared a" in out


def test_quiet_prints_no_progress_lines(capsys):
    children.run_configurations([({"strategy": "vmm", "order": "random"}, GOOD)],
                                quiet=True, describe=lambda r: "  done")
    assert capsys.readouterr().out == ""


def test_a_child_saying_the_model_is_unusable_stops_the_run():
    bad = child("print('vmm-core: error: --model \\'x:y\\': importing \\'x\\' failed', "
                "file=sys.stderr); sys.exit(3)")
    with pytest.raises(BenchModelError, match=r"^--model 'x:y': importing 'x' failed$"):
        children.run_configurations([({"strategy": "alone", "order": "largest"}, bad),
                                     ({"strategy": "vmm", "order": "random"}, GOOD)],
                                    bad_config_exit=3)


def test_progress_lines_round_trip(capsys):
    bar = progress.ForwardedBar(4, "shared descending: check against eager")
    bar.update()
    bar.update(2)
    lines = capsys.readouterr().out.splitlines()
    assert [progress.parse_progress(ln) for ln in lines] == [
        (0, 4, "shared descending: check against eager"),
        (1, 4, "shared descending: check against eager"),
        (3, 4, "shared descending: check against eager")]
    assert progress.parse_progress("VMMBENCH {}") is None
    assert progress.parse_progress("VMMPROGRESS x y") is None


def test_bars_are_off_when_stderr_is_not_a_terminal_or_quiet(tmp_path):
    with open(tmp_path / "log", "w") as f:
        assert progress.bars_enabled(False, f) is False

    class Terminal:
        def isatty(self):
            return True

    assert progress.bars_enabled(True, Terminal()) is False
    assert progress.bars_enabled(False, Terminal()) is (progress._tqdm() is not None)


def test_every_record_is_handed_on_as_its_child_ends_quiet_or_not(tmp_path):
    """A device call's time limit stops the parent before it writes --json; what the
    children finished must already be on disk."""
    import json

    from vmm_bench import piecewise

    crash = child("raise SystemExit('it broke')")
    path = str(tmp_path / "run.json")
    append = piecewise._record_log(path)
    seen = []

    def on_record(record):
        append(record)
        seen.append(len(open(piecewise.records_log_path(path)).readlines()))

    children.run_configurations([({"strategy": "vmm", "order": "random"}, GOOD),
                                 ({"strategy": "shared", "order": "a"}, crash)],
                                quiet=True, on_record=on_record)
    assert seen == [1, 2]  # written when each child ended, not at the end of the run
    lines = [json.loads(ln) for ln in open(tmp_path / "run.records.jsonl")]
    assert lines[0]["graph_bytes"] == 7 and "it broke" in lines[1]["error"]


def _timed(capture_s: float, order: str = "random", **extra) -> list[str]:
    record = {"strategy": "vmm", "order": order, "capture_s": capture_s, "wrong_graphs": [],
              **extra}
    return child(f"print('VMMBENCH ' + json.dumps({record!r}))")


def test_repeated_configurations_run_in_rounds_and_keep_the_median_run(monkeypatch):
    """Every configuration runs once per round (a drift of the machine reaches all), and
    the run of median capture time stands for it, its other values its own."""
    times = {"a": iter([0.9, 0.3, 0.5]), "b": iter([0.2, 0.2, 0.4])}
    started = []
    real = children.run_child

    def run_child(argv, **kw):  # argv names the configuration; its next time is measured
        started.append(argv[0])
        capture_s = next(times[argv[0]])
        return real(_timed(capture_s, order=argv[0], label=f"{argv[0]}-{capture_s}"), **kw)

    monkeypatch.setattr(children, "run_child", run_child)
    records = children.run_configurations(
        [({"strategy": "vmm", "order": "a"}, ["a"]), ({"strategy": "vmm", "order": "b"}, ["b"])],
        quiet=True, repeat=3)
    assert started == ["a", "b", "a", "b", "a", "b"]
    assert [(r["order"], r["capture_s"], r["label"], r["runs"]) for r in records] == \
        [("a", 0.5, "a-0.5", 3), ("b", 0.2, "b-0.2", 3)]
    assert records[0]["capture_s_runs"] == [0.3, 0.5, 0.9]


def test_repeats_keep_every_wrong_graph_and_every_failure():
    merged = children.merge_repeats(
        [{"order": "a", "capture_s": 1.0, "wrong_graphs": []},
         {"order": "a", "capture_s": 2.0, "wrong_graphs": [[8, 0.3]]},
         {"order": "a", "capture_s": 3.0, "wrong_graphs": [[16, 0.2]]},
         {"order": "b", "capture_s": 1.0, "wrong_graphs": []},
         {"order": "b", "error": "child exited 9: boom"}],
        [{"order": "a"}] * 3 + [{"order": "b"}] * 2)
    assert merged[0]["wrong_graphs"] == [[8, 0.3], [16, 0.2]] and merged[0]["capture_s"] == 2.0
    assert merged[1]["error"] == "1 of 2 runs failed; the first: child exited 9: boom"


def test_the_configurations_bar_counts_every_repeated_run(monkeypatch):
    totals = []
    real_bar = children._progress.bar

    def bar(total, desc, **kw):
        totals.append((desc, total))
        return real_bar(total, desc, **{**kw, "enabled": False})

    monkeypatch.setattr(children._progress, "bar", bar)
    children.run_configurations([({"strategy": "vmm", "order": "a"}, _timed(0.1, "a")),
                                 ({"strategy": "vmm", "order": "b"}, _timed(0.2, "b"))],
                                quiet=True, repeat=3)
    assert ("configurations", 6) in totals
