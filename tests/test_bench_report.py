"""The benchmark's report over configuration records: table, headline, JSON, picture.

The records are synthetic (no device here); what is tested is what the report says
about them: ratios against the floor, the comparison with the best shared-pool order in
plain words, and the memory outside every pool computed from the measured parts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from vmm_bench import report
from vmm_core.cli import CLIError, exit_status

MIB = 2**20


def rec(strategy, order, mib, *, graphs=51, pool_mib=None, default_mib=100.0, wrong=()):
    total = int(mib * MIB)
    return {"strategy": strategy, "order": order, "graphs": graphs, "graph_bytes": total,
            "growth_bytes": [total * (i + 1) // graphs for i in range(graphs)],
            "pool_bytes": None if pool_mib is None else int(pool_mib * MIB),
            "default_pool_bytes": None if default_mib is None else int(default_mib * MIB),
            "capture_s": 0.5 if strategy != "vmm" else 0.55, "replay_us": 40.0,
            "wrong_graphs": [list(w) for w in wrong],
            "worst_rel_err": max([w[1] for w in wrong], default=1e-3)}


def run(vmm_mib=206, shared=(394, 208, 258), vmm_pool=92, default_mib=100.0):
    orders = ("ascending", "descending", "random")
    return ([rec("alone", "largest", 196, graphs=1, pool_mib=92, default_mib=default_mib)]
            + [rec("shared", o, m, pool_mib=m - 110, default_mib=default_mib)
               for o, m in zip(orders, shared)]
            + [rec("private", o, 2280, pool_mib=2170, default_mib=default_mib) for o in orders]
            + [rec("vmm", o, vmm_mib, pool_mib=vmm_pool, default_mib=default_mib)
               for o in orders])


def test_table_gives_ratios_against_the_floor_and_the_reference():
    records = run() + [{"strategy": "vmm", "order": "ascending", "error": "child exited 2: "
                        "boom\nCaptureEscapeError: 32 MiB"}]
    lines = report.table(records).splitlines()
    rows = {tuple(ln.split()[:2]): ln.split() for ln in lines[1:]}
    assert rows[("alone", "-")][3:5] == ["196.0", "1.00"]
    assert rows[("shared", "ascending")][3:5] == ["394.0", "2.01"]
    assert rows[("vmm", "descending")][3:5] == ["206.0", "1.05"]
    # capture time against the shared pool in the same order (after exec/graph, "-" "-":
    # no executables measured by instantiation and none the pool owns, in these records)
    assert rows[("vmm", "random")][8:12] == ["-", "-", "0.55", "1.10"]
    # exec/graph: (206 - 92 - 100) MiB over 51 graphs
    assert rows[("vmm", "random")][6:8] == [f"{14 * 1024 / 51:.0f}", "KiB"]
    failed = [ln for ln in lines if "FAILED" in ln]
    assert len(failed) == 1 and "CaptureEscapeError: 32 MiB" in failed[0]


def test_headline_says_plainly_when_there_is_little_to_gain():
    lines = report.headline(run(), model="mlp")
    assert lines[0] == ("mlp: vmm holds 206 MiB, 1.0% less than the best shared-pool order "
                        "(descending, 208 MiB): little to gain for this model (largest "
                        "shape alone: 196 MiB).")


def test_headline_gives_the_saving_against_the_best_and_the_worst_order():
    lines = report.headline(run(vmm_mib=206, shared=(900, 600, 700)), model="llama")
    assert lines[0].startswith("llama: vmm holds 206 MiB, 66% less than the best shared-pool "
                               "order (descending, 600 MiB): it saves 394 MiB there and 694 "
                               "MiB against the worst order (ascending, 900 MiB)")


def test_headline_says_when_vmm_holds_more():
    lines = report.headline(run(vmm_mib=212), model="mlp")
    assert "1.9% more than the best shared-pool order (descending, 208 MiB): nothing to " \
           "gain for this model" in lines[0]


def test_headline_reports_the_measured_memory_outside_every_pool():
    s = report.summary(run())
    e = s["executable"]
    assert e["total_bytes"] == (206 - 92 - 100) * MIB
    assert e["bytes_per_graph"] == pytest.approx(14 * MIB / 51)
    sentence = report.headline(run(), model="mlp")[1]
    assert sentence.startswith(f"Outside every pool the graph executables hold "
                               f"{14 * 1024 / 51:.0f} KiB per graph (14.0 MiB for 51 graphs)")
    assert "minus its physical pool (92.0 MiB) and the default pool's growth (100 MiB" in \
        sentence
    # not a floor: a pool that owns its executables bounds them
    assert sentence.endswith("a budget on GraphPool's executables bounds them "
                             "(--executables, docs/executables.md).")
    assert "floor" not in sentence


def test_without_a_default_pool_reading_the_floor_says_what_it_still_includes():
    sentence = report.headline(run(default_mib=None), model="mlp")[1]
    assert "114 MiB for 51 graphs" in sentence
    assert "still includes the persistent input and output buffers" in sentence


def test_several_shared_strategies_name_the_best_one():
    records = [rec("alone", "largest", 100, graphs=1, pool_mib=60),
               rec("vllm", "descending", 150, pool_mib=60), rec("vllm", "ascending", 400),
               rec("sglang", "descending", 180), rec("vmm", "descending", 104, pool_mib=60)]
    line = report.headline(records, model="llama piecewise", shared=("vllm", "sglang"))[0]
    assert "best shared-pool order (vllm, descending, 150 MiB)" in line
    assert "worst order (vllm, ascending, 400 MiB)" in line


def test_wrong_and_failed_configurations_are_in_the_headline():
    records = run()
    records[-1] = rec("vmm", "random", 206, pool_mib=92, wrong=[(8, 0.3), (16, 0.29)])
    records.append({"strategy": "shared", "order": "random", "error": "child exited -9"})
    lines = report.headline(records, model="mlp")
    assert "WRONG RESULTS: vmm random: 2 graph(s) differ from eager (worst relative error " \
           "0.3)." in lines
    assert any(ln.startswith("FAILED: shared random") for ln in lines)


def _documented_schema() -> str:
    return (Path(__file__).parent.parent / "docs" / "json-schema.md").read_text()


def test_json_document_has_the_documented_keys_and_no_nan(tmp_path):
    records = run()
    records[1]["worst_rel_err"] = float("nan")
    doc = report.document(kind="graph-memory", records=records, ok=True,
                          model={"name": "mlp", "description": "d", "dtype": "bfloat16",
                                 "options": {}},
                          backend="cuda", device="H100", torch="2.11", sizes=[1, 2])
    path = tmp_path / "out.json"
    report.write_json(doc, str(path))
    loaded = json.loads(path.read_text(), parse_constant=lambda c: pytest.fail(c))
    assert loaded["schema"] == report.SCHEMA
    assert loaded["records"][1]["worst_rel_err"] is None
    assert loaded["headline"] == report.headline(records, model="mlp")
    schema = _documented_schema()
    for key in list(loaded) + list(loaded["records"][0]) + list(loaded["summary"]):
        assert f"`{key}`" in schema, f"docs/json-schema.md does not document {key!r}"


def test_plot_writes_one_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert report.plot(run(), str(path), title="mlp") is True
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 20000


def test_plot_without_matplotlib_says_so(tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert report.plot(run(), str(tmp_path / "x.png"), title="mlp") is False
    assert not (tmp_path / "x.png").exists()


def test_a_json_rewrite_that_fails_keeps_the_previous_document(tmp_path):
    """The rl bench rewrites --json after every strategy so that a run cut short keeps what
    finished: a rewrite stopped midway (the time limit, a value json cannot write) leaves
    the previous document whole, never a truncated file."""
    path = tmp_path / "rl.json"
    report.write_json({"kind": "rl", "partial": True, "records": [{"strategy": "vmm"}]},
                      str(path))
    with pytest.raises(TypeError):
        report.write_json({"kind": "rl", "records": [{"strategy": "vmm"},
                                                     {"strategy": "tms", "x": object()}]},
                          str(path))
    assert json.loads(path.read_text())["records"] == [{"strategy": "vmm"}]
    assert [p.name for p in tmp_path.iterdir()] == ["rl.json"]
    report.write_json({"kind": "rl", "records": []}, str(path))
    assert json.loads(path.read_text()) == {"kind": "rl", "records": []}
    # a symlink (or /dev/stdout) is written through, not replaced by a file
    target, link = tmp_path / "target.json", tmp_path / "link.json"
    link.symlink_to(target)
    report.write_json({"kind": "rl"}, str(link))
    assert link.is_symlink() and json.loads(target.read_text()) == {"kind": "rl"}


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_a_json_path_that_takes_no_bytes_at_the_end_is_the_one_line_output_error():
    """The run's results are on the screen; the file that cannot take them is one line
    naming the flag, with the output exit status, not a traceback."""
    with pytest.raises(CLIError) as info:
        report.save_json({"kind": "decode", "records": []}, "/dev/full")
    assert str(info.value) == ("--json /dev/full: cannot be written (No space left on "
                               "device); the results are printed above")
    assert exit_status(info.value) == 4


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this system")
def test_a_plot_path_that_takes_no_bytes_at_the_end_is_the_one_line_output_error():
    plt = report.pyplot()
    if plt is None:
        pytest.skip("matplotlib is not installed (the 'bench' extra)")
    fig, ax = plt.subplots()
    ax.plot([1, 2], [3, 4])
    with pytest.raises(CLIError) as info:
        report.save_figure(fig, "/dev/full", dpi=50)
    assert str(info.value).startswith("--plot /dev/full: cannot be written (No space left")
    assert exit_status(info.value) == 4
    assert not plt.get_fignums(), "the figure is closed whatever happened"


def test_repeated_runs_show_the_fastest_and_slowest_capture_beside_the_median():
    records = run()
    records[-1] = {**records[-1], "capture_s": 0.55, "runs": 3,
                   "capture_s_runs": [0.48, 0.55, 0.71]}
    rows = {tuple(ln.split()[:2]): ln.split() for ln in report.table(records).splitlines()[1:]}
    assert rows[("vmm", "random")][10:13] == ["0.55", "1.10", "0.48-0.71"]
    assert rows[("vmm", "ascending")][12] == "-"


def test_headline_splits_each_orders_capture_into_warmups_captures_and_the_rest():
    records = run()
    for r in records:
        if r["strategy"] == "vmm":
            r["phase_ms"] = {"warmup": 400.0, "capture": 90.0, "switch": 20.0}
            r["capture_s"] = 0.52
        elif r["strategy"] == "shared":
            r["phase_ms"] = {"warmup": 300.0, "capture": 60.0}
            r["capture_s"] = 0.365
    records[-1]["phase_ms"] = {"capture": 90.0}  # vmm random: no warm-ups reported
    split = [ln for ln in report.headline(records, model="mlp") if ln.startswith("Capture")]
    assert split == ["Capture time as warm-ups + captures + the rest (entering and leaving "
                     "spaces, trims), vmm against the shared pool: ascending 0.40 + 0.09 + "
                     "0.03 s against 0.30 + 0.06 + 0.01 s; descending 0.40 + 0.09 + 0.03 s "
                     "against 0.30 + 0.06 + 0.01 s."]
    assert report.capture_split(run(), vmm="vmm") is None  # no phases: no sentence
