"""``--executables``: the graph executables policies of the engine-runner scenarios.

The knob's syntax and refusals, how each policy becomes one child per GraphPool
strategy, a piecewise child run for real on the host backend (its graphs replay
eagerly, its executables are emulated by the policy's own backend calls: misses,
evictions, updates, sleep and wake are GraphPool's), and what the parent makes of the
records: graph memory against vLLM's discipline, step time against ``all``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

import vmm_core
from vmm_bench import exec_policies, piecewise, report
from vmm_bench.cli import bench_spec
from vmm_bench.spec import BenchSpec, EngineSpec, ModelSpec
from vmm_core.cli import CLIError, build_parser

MIB = 1 << 20


def spec_of(*argv: str) -> BenchSpec:
    return bench_spec(build_parser().parse_args(["bench", *argv]))


# ---------------------------------------------------------------- the knob
@pytest.mark.parametrize("text, name", [
    ("all", "all"), ("framework", "framework"), ("share-always", "share-always"),
    ("budget:840", "budget:840"), ("budget:50%", "budget:50%"),
    ("budget:050%+share", "budget:50%+share"), (" budget:25%+share-always ",
                                                "budget:25%+share-always"),
    ("budget:25%+share+ahead", "budget:25%+share+ahead"),
    ("budget:25%+share+ahead+hint", "budget:25%+share+ahead+hint"),
    ("budget:8+ahead", "budget:8+ahead"),
    (" all+kernels", "all+kernels"),
    ("budget:25%+share+ahead+hint+kernels", "budget:25%+share+ahead+hint+kernels"),
])
def test_a_policy_is_written_one_way(text, name):
    assert exec_policies.parse_policy(text) == name


@pytest.mark.parametrize("text, message", [
    ("budget:0", "the budget must be a count >= 1"),
    ("budget:0%", "the budget must be a percentage from 1 to 100"),
    ("budget:101%", "the budget must be a percentage from 1 to 100"),
    ("budget:-5", "not a policy"), ("budget", "not a policy"), ("half", "not a policy"),
    ("budget:50%+sharing", "not a policy"), ("budget:1.5", "not a policy"),
    ("share", "not a policy"), (",", "name at least one policy"),
    ("budget:25%+ahead+share", "not a policy"), ("budget:25%+hint", "not a policy"),
    ("all+ahead", "not a policy"), ("framework+kernels", "not a policy"),
    ("all+kernels+kernels", "not a policy"), ("+kernels", "not a policy"),
    ("budget:25%+kernels+share", "not a policy"),
])
def test_a_bad_policy_is_refused_naming_the_syntax(text, message):
    with pytest.raises(ValueError, match=message):
        exec_policies.parse_policies(text)


def test_policies_become_what_graph_pool_takes():
    P = vmm_core.ExecutablePolicy
    assert exec_policies.parse_policies("all,budget:50%,all") == ("all", "budget:50%")
    assert exec_policies.pool_executables("all", 1683) is None
    assert exec_policies.pool_executables("framework", 1683) is False
    assert exec_policies.pool_executables("share-always", 10) == P(share="always")
    assert exec_policies.pool_executables("all+kernels", 10) == P(random_numbers="kernels")
    assert exec_policies.pool_executables("budget:2+share+kernels", 10) == P(
        max_count=2, share="when_full", ahead=False, random_numbers="kernels")
    # a percentage is of the pool's graphs, rounded up; a bare budget shares nothing
    assert exec_policies.pool_executables("budget:50%", 1683) == P(max_count=842,
                                                                   share="off", ahead=False)
    assert exec_policies.pool_executables("budget:1%", 3) == P(max_count=1, share="off",
                                                               ahead=False)
    assert exec_policies.pool_executables("budget:840+share", 1683) == P(
        max_count=840, share="when_full", ahead=False)
    assert exec_policies.pool_executables("budget:25%+share-always", 51) == \
        P(max_count=13, share="always", ahead=False)
    # +ahead: the policy that prepares ahead; +hint is what the runner does, not the pool
    for name in ("budget:25%+share+ahead", "budget:25%+share+ahead+hint"):
        assert exec_policies.pool_executables(name, 1683) == P(max_count=421,
                                                               share="when_full", ahead=True)
    assert exec_policies.pool_executables("budget:25%+ahead+hint", 1683) == P(
        max_count=421, share="off", ahead=True)
    assert exec_policies.gives_hints("budget:25%+share+ahead+hint")
    assert exec_policies.gives_hints("budget:25%+share+ahead+hint+kernels")
    assert not exec_policies.gives_hints("budget:25%+share+ahead")
    assert not exec_policies.gives_hints("all") and not exec_policies.gives_hints(None)


def test_the_cli_takes_the_policies_and_gives_each_child_one(monkeypatch):
    import vmm_bench.cli

    monkeypatch.setattr(vmm_bench.cli, "require", lambda extra, why: None)  # no transformers
    parent = spec_of("--scenario", "piecewise,families", "--strategies", "vmm,vllm,vmm-keep",
                     "--orders", "random", "--executables", "all,budget:50%+share",
                     "--trace-steps", "40", "--sizes", "1,2")
    assert parent.engine == EngineSpec(("vmm", "vllm", "vmm-keep"),
                                       ("all", "budget:50%+share"), 40)
    assert spec_of().engine.executables == ("all",)  # the default: every one resident
    runs = piecewise.runs(parent)
    # GraphPool strategies once per policy; the peers and the floor with torch's
    assert runs[:6] == [("piecewise:alone:ascending", "framework"),
                        ("piecewise:vmm:random", "all"),
                        ("piecewise:vmm:random", "budget:50%+share"),
                        ("piecewise:vllm:random", "framework"),
                        ("piecewise:vmm-keep:random", "all"),
                        ("piecewise:vmm-keep:random", "budget:50%+share")]
    assert len(runs) == 12 and runs[6][0].startswith("families:alone")
    config, policy = runs[2]
    argv = parent.child_argv(config, "host", model="llama", scenario="piecewise",
                             extra=parent.engine.argv(policy))
    child = bench_spec(build_parser().parse_args(argv[3:]))
    assert child.engine.executables == ("budget:50%+share",)
    assert child.engine.trace_steps == 40
    assert piecewise.child_policy(child, "vmm") == "budget:50%+share"
    assert piecewise.child_policy(child, "vllm") == "framework"  # a peer keeps torch's
    with pytest.raises(CLIError, match="a benchmark child measures one --executables"):
        spec_of("--one", config, "--scenario", "piecewise", "--executables", "all,budget:2")


def test_the_knob_says_when_nothing_uses_it(monkeypatch):
    import vmm_bench.cli

    monkeypatch.setattr(vmm_bench.cli, "require", lambda extra, why: None)
    assert any(n.startswith("--executables: scenario decode does not use it")
               for n in spec_of("--executables", "budget:2").notes)
    assert any(n.startswith("--trace-steps: scenario rl does not use it")
               for n in spec_of("--scenario", "rl", "--trace-steps", "5").notes)
    notes = spec_of("--scenario", "piecewise", "--strategies", "vllm", "--executables",
                    "budget:2").notes
    assert any("none of --strategies vllm is a GraphPool strategy" in n for n in notes)
    assert spec_of("--scenario", "piecewise", "--executables", "budget:2").notes == ()


# ---------------------------------------------------------------- a child on the host
OPTIONS = {"layers": 2, "hidden": 64, "ffn": 128, "heads": 4, "kv_heads": 2, "ctx": 8}
SIZES = (1, 2, 4, 8, 16)  # 3 pieces each: 15 graphs
TRACE = 40


def host_spec(strategies, policy, scenario="piecewise") -> BenchSpec:
    return BenchSpec(backend="host", scenarios=(scenario,), sizes=SIZES,
                     orders=("random",), model=ModelSpec("llama", "float32", OPTIONS),
                     engine=EngineSpec(tuple(strategies), (policy,), TRACE))


def run_host(strategy, policy, scenario="piecewise") -> dict:
    pytest.importorskip("transformers")
    order = "ascending" if strategy == report.FLOOR else "random"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", vmm_core.VMMFallbackWarning)  # the host's pools
        return piecewise.run_one_piecewise(f"{scenario}:{strategy}:{order}",
                                           host_spec([strategy], policy, scenario))


@pytest.fixture(scope="module")
def host_records() -> dict:
    return {(s, p): run_host(s, p) for s, p in (
        ("vllm", "framework"), ("vmm", "all"), ("vmm", "budget:4"),
        ("vmm", "budget:4+share"), ("vmm", "budget:4+share+ahead+hint"))}


def test_a_budget_misses_evicts_and_stays_correct_on_the_host(host_records):
    r = host_records[("vmm", "budget:4")]
    assert r["executables"] == "budget:4" and r["graphs"] == 15
    assert r["exec_policy"] == [{"max_count": 4, "max_bytes": None, "share": "off",
                                 "ahead": False, "random_numbers": "operators",
                                 "eager_wake": False}]
    assert r["exec_graphs"] == 15 and r["exec_peak_resident"] == 4
    assert r["trace_steps"] == TRACE and r["trace_checked"] == TRACE // 20
    assert r["trace_misses"] > 0 and r["trace_evictions"] > 0
    assert r["trace_hits"] + r["trace_misses"] >= 3 * TRACE  # every piece of every step
    assert r["trace_updates"] == 0  # no sharing asked
    assert r["wrong_graphs"] == [] and r["worst_rel_err"] < 1e-4
    assert r["step_us_median"] > 0 and r["step_us_mean"] > 0
    shared = host_records[("vmm", "budget:4+share")]
    assert shared["trace_updates"] > 0 and shared["trace_evictions"] < r["trace_evictions"]
    assert shared["wrong_graphs"] == []


def test_every_configuration_replays_the_three_traces_in_turn(host_records):
    """uniform, zipf and drift one after the other, each with its own numbers; the keys
    at the top of the record are the first trace's."""
    for (strategy, policy), r in host_records.items():
        assert list(r["traces"]) == ["uniform", "zipf", "drift"], (strategy, policy)
        for kind, part in r["traces"].items():
            assert part["trace"] == kind and part["trace_steps"] == TRACE
            assert part["trace_wrong"] == [] and part["step_us_median"] > 0
            assert part["trace_recaptures"] == 0 and part["served_graph_bytes"] is not None
        assert r["trace"] == "uniform" and r["step_us_mean"] == \
            r["traces"]["uniform"]["step_us_mean"]
        assert r["wrong_graphs"] == []


def test_the_traces_draw_as_their_names_say():
    from vmm_bench.measure import VLLM_DECODE_SIZES
    from vmm_bench.serving import request_trace

    sizes = list(VLLM_DECODE_SIZES)
    assert len(sizes) == 51 and sizes[-1] == 512  # vLLM's capture sizes
    walk = request_trace(sizes, 300, 3, "drift")
    steps = [abs(sizes.index(a) - sizes.index(b)) for a, b in zip(walk, walk[1:])]
    assert max(steps) == 1 and 0.35 < steps.count(0) / len(steps) < 0.65
    uniform = request_trace(sizes, 300, 3, "uniform")
    zipf = request_trace(sizes, 300, 3, "zipf")
    top = max(zipf.count(s) for s in sizes) / 300  # the hottest size: about 1/H(51)
    assert 0.12 < top < 0.35 and max(uniform.count(s) for s in sizes) / 300 < 0.06
    assert request_trace(sizes, 50, 3, "zipf") == request_trace(sizes, 50, 3)  # default
    with pytest.raises(ValueError, match="unknown trace 'burst'; choose from uniform, "
                                         "zipf, drift"):
        request_trace(sizes, 5, 0, "burst")


def test_preparing_ahead_with_the_runners_hints_stays_exact_on_the_host(host_records):
    r = host_records[("vmm", "budget:4+share+ahead+hint")]
    assert r["exec_policy"] == [{"max_count": 4, "max_bytes": None, "share": "when_full",
                                 "ahead": True, "random_numbers": "operators",
                                 "eager_wake": False}]
    assert r["exec_peak_resident"] <= 4 and r["wrong_graphs"] == []
    assert sum(p["trace_prepared_ahead"] for p in r["traces"].values()) > 0
    assert r["wake_recaptures"] == 0 and r["sleep_released"] <= 4


def test_every_executable_resident_never_misses(host_records):
    r = host_records[("vmm", "all")]
    assert r["executables"] == "all" and r["exec_resident"] == 15
    assert (r["trace_misses"], r["trace_evictions"], r["trace_updates"]) == (0, 0, 0)
    assert r["trace_hits"] >= 3 * TRACE and r["wrong_graphs"] == []


def test_a_peer_keeps_torchs_executables_and_is_not_slept(host_records):
    r = host_records[("vllm", "framework")]
    assert r["executables"] == "framework"
    assert r["exec_resident"] is None and r["trace_misses"] is None
    assert r["step_us_median"] > 0 and r["wrong_graphs"] == []
    assert "sleep_released" not in r and "wake_replays" not in r


@pytest.mark.parametrize("policy", ["all", "budget:4", "budget:4+share"])  # all inline
def test_sleep_releases_the_executables_and_the_wake_makes_them_again(host_records, policy):
    r = host_records[("vmm", policy)]
    resident = 15 if policy == "all" else 4
    assert r["sleep_released"] == resident  # every one the pool owned after the trace
    assert r["sleep_released_bytes"] == r["exec_resident_bytes"] > 0
    assert r["sleep_driver_free_change"] == 0  # the driver never shows them free
    assert r["wake_recaptures"] == 0
    sizes = [w["size"] for w in r["wake_replays"]]
    assert sizes == [1, 2, 8, 16]  # spread over the sizes, the smallest and the largest
    # the first replay after the wake makes each executable again (instantiated, or
    # updated from another size's under a shared budget), and every result is right
    first = r["wake_replays"][0]
    assert first["instantiations"] == 3
    made = sum(w["instantiations"] + w["updates"] for w in r["wake_replays"])
    assert made == 3 * len(sizes)
    assert all(w["ratio"] > 0 for w in r["wake_replays"])
    assert r["wake_ratio_max"] == max(w["ratio"] for w in r["wake_replays"])
    # the eager wake makes again what was resident at the second sleep, before it returns
    # (the lazy wake's replays made those of the four sizes only; the budget kept four of
    # them); the last size served then (16) replays first without making anything
    assert r["wake_eager_made"] == (3 * len(sizes) if policy == "all" else 4)
    assert r["wake_eager_ms"] > 0
    eager = {w["size"]: w for w in r["wake_eager_replays"]}
    assert list(eager) == [16, 8, 2, 1]
    assert eager[16]["instantiations"] == eager[16]["updates"] == 0
    if policy == "all":  # every executable was resident: no first replay makes one
        assert all(w["instantiations"] + w["updates"] == 0 for w in eager.values())
    else:  # the budget held 16's three and one more: the rest are made on replay
        assert sum(w["instantiations"] + w["updates"] for w in eager.values()) > 0
    assert r["wake_eager_ratio_max"] == max(w["ratio"] for w in eager.values())
    assert r["wrong_graphs"] == []


def test_the_families_full_graphs_hold_attention_and_follow_the_budget():
    """Attention (scaled_dot_product_attention) carries torch's tag for drawing random
    numbers (its dropout argument), yet at dropout_p=0 it draws none: the FULL graphs that
    hold it stay their pool's, under that pool's budget as the pieces are under theirs, and
    no graph is left on torch's replay."""
    r = run_host("vmm", "budget:4", scenario="families")
    assert r["exec_framework_replayed"] == 0  # attention at dropout_p=0 draws nothing
    assert r["exec_graphs"] == 4 * len(SIZES)  # three pieces and one FULL graph a size
    # each family's pool keeps its own budget of 4
    assert len(r["exec_policy"]) == 2 and r["exec_resident"] == 8
    assert r["trace_misses"] > 0 and r["wrong_graphs"] == []


CHILD = """
import json, sys, warnings
warnings.simplefilter("ignore")
from vmm_bench import piecewise
from vmm_bench.spec import BenchSpec, EngineSpec, ModelSpec
spec = BenchSpec(backend="host", scenarios=("piecewise",), sizes={sizes}, orders=("random",),
                 model=ModelSpec("llama", "float32", {options}),
                 engine=EngineSpec(("vmm",), (sys.argv[1],), {trace}))
r = piecewise.run_one_piecewise("piecewise:vmm:random", spec)
print(json.dumps({{k: r[k] for k in ("served_graph_bytes", "exec_resident_bytes",
                                     "served_exec_bytes", "wrong_graphs")}}))
"""


def test_graph_memory_counts_the_executables_so_a_budget_lowers_it():
    """Each policy in a process of its own, as the benchmark's children run: the emulated
    driver never gives executable memory back, so only a fresh process shows what a
    policy holds."""
    pytest.importorskip("transformers")
    code = CHILD.format(sizes=SIZES, options=OPTIONS, trace=TRACE)
    held = {}
    for policy in ("all", "budget:2"):
        proc = subprocess.run([sys.executable, "-c", code, policy], capture_output=True,
                              text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        held[policy] = json.loads(proc.stdout.splitlines()[-1])
    assert held["all"]["wrong_graphs"] == held["budget:2"]["wrong_graphs"] == []
    # 15 executables of ~190 KiB (the emulation takes 2 MiB steps) against 2 of them
    assert held["all"]["served_graph_bytes"] == 4 * MIB
    assert held["budget:2"]["served_graph_bytes"] == 2 * MIB
    assert held["budget:2"]["exec_resident_bytes"] * 7 < held["all"]["exec_resident_bytes"]
    # on the host every graph-pool page is counted too: none here (the framework's CPU
    # tensors are not in the pool), so what lies outside every pool is the executables
    assert held["budget:2"]["served_exec_bytes"] == 2 * MIB


# ---------------------------------------------------------------- the parent's report
def served(strategy, order, policy, mib, median, mean, **kw):
    r = {"scenario": "piecewise", "strategy": strategy, "order": order,
         "executables": policy, "graphs": 1683, "graph_bytes": int(mib * MIB),
         "served_graph_bytes": int(mib * MIB), "served_exec_bytes": None,
         "exec_resident": None, "exec_resident_bytes": None,
         "exec_framework_replayed": None, "step_us_median": median, "step_us_mean": mean,
         "trace_steps": 300, "trace_hits": None, "trace_misses": None,
         "trace_updates": None, "trace_evictions": None, "wrong_graphs": []}
    r.update(kw)
    return r


def test_the_parent_compares_each_policy_with_vllm_and_with_all_in_the_same_run(capsys):
    records = [
        {"scenario": "piecewise", "strategy": "alone", "order": "ascending",
         "executables": "framework", "graphs": 33, "graph_bytes": 100 * MIB,
         "wrong_graphs": []},
        served("vllm", "random", "framework", 460, 8000.0, 8100.0),
        served("vmm", "random", "all", 452, 7900.0, 8000.0, exec_resident=1683,
               exec_resident_bytes=356 * MIB, exec_framework_replayed=0),
        served("vmm", "random", "budget:50%+share", 230, 7950.0, 8240.0,
               exec_resident=842, exec_resident_bytes=178 * MIB, exec_framework_replayed=0,
               trace_hits=9000, trace_misses=900, trace_updates=880, trace_evictions=20,
               sleep_released=842, sleep_released_bytes=178 * MIB,
               sleep_driver_free_change=0, wake_ratio_max=1.8, wake_recaptures=0),
        {"scenario": "piecewise", "strategy": "vmm", "order": "random",
         "executables": "budget:25%", "error": "child exited -9"},
    ]
    rows = {report.strategy_label(r): r for r in report.executables_rows(records)}
    assert set(rows) == {"vllm", "vmm", "vmm budget:50%+share"}  # not the floor or a failure
    budget = rows["vmm budget:50%+share"]
    assert budget["reference"] == "vllm random"
    assert budget["x_reference"] == pytest.approx(230 / 460)
    assert budget["step_median_x_all"] == pytest.approx(7950 / 7900)
    assert budget["step_mean_x_all"] == pytest.approx(8240 / 8000)
    assert rows["vmm"]["step_mean_x_all"] == 1.0 and rows["vllm"]["step_mean_x_all"] is None
    text = report.executables_table(list(rows.values()))
    line = next(ln for ln in text.splitlines() if ln.startswith("vmm budget:50%+share"))
    assert line.split()[2:7] == ["random", "230.0", "0.50", "842", "178.0"]
    [sentence] = report.executables_headline(list(rows.values()))
    assert sentence.startswith("vmm budget:50%+share random: graph memory after the trace "
                               "230 MiB, 0.50x vllm random; a step 1.006x (median) and "
                               "1.030x (mean) the same strategy with every executable "
                               "resident; 900 misses, 880 updates, 20 evictions in 300 steps")
    assert "sleep released 842 executables (178 MiB estimated, the driver's free memory " \
           "+0.0 MiB)" in sentence
    assert sentence.endswith("at most 1.80x a warm one, 0 recaptures.")
    # the graph memory headline speaks of the default policy only
    assert report.summary(records, shared=("vllm",))["vmm_bytes"] == 452 * MIB
    table = report.table(records, reference="vllm")
    assert "vmm budget:50%+share random" in table
    failed = next(ln for ln in table.splitlines() if "FAILED" in ln)
    assert failed.split()[:4] == ["vmm", "budget:25%", "random", "FAILED:"]


def _documented() -> str:
    return (Path(__file__).parent.parent / "docs" / "json-schema.md").read_text()


def test_every_key_of_an_engine_runner_document_is_documented(host_records):
    records = list(host_records.values())
    rows = report.executables_rows(records)
    doc = report.document(kind="piecewise", records=records, ok=True, shared=("vllm",),
                          model={"name": "llama"}, executables=rows)
    keys = set(doc) | set(doc["summary"]) | {k for r in records for k in r} \
        | {k for row in rows for k in row} \
        | {k for r in records for w in r.get("wake_replays", ()) for k in w}
    documented = _documented()
    missing = sorted(k for k in keys if f"`{k}`" not in documented)
    assert missing == [], f"docs/json-schema.md does not document {missing}"


def test_the_trace_flag_reaches_every_child_and_refuses_an_unknown_trace(monkeypatch):
    import vmm_bench.cli

    monkeypatch.setattr(vmm_bench.cli, "require", lambda extra, why: None)
    parent = spec_of("--scenario", "piecewise", "--trace", "drift,zipf", "--executables",
                     "budget:25%+share+ahead+hint")
    assert parent.engine.traces == ("drift", "zipf")
    assert spec_of("--scenario", "piecewise").engine.traces == ("uniform", "zipf", "drift")
    argv = parent.child_argv("piecewise:vmm:random", "host", model="llama",
                             scenario="piecewise",
                             extra=parent.engine.argv("budget:25%+share+ahead+hint"))
    child = bench_spec(build_parser().parse_args(argv[3:]))
    assert child.engine.traces == ("drift", "zipf")
    with pytest.raises(CLIError, match="burst: choose from uniform,zipf,drift"):
        spec_of("--scenario", "piecewise", "--trace", "burst")
    assert any(n.startswith("--trace: scenario decode does not use it")
               for n in spec_of("--trace", "zipf").notes)


def test_the_step_gap_reaches_every_child_is_untimed_and_is_said(monkeypatch, capsys):
    """--step-gap-ms leaves host time between a trace's steps: taken (the trace lasts
    that much longer), not timed (the steps do not), recorded, and named where the
    target is judged; a value outside 0-1000 ms is refused."""
    import vmm_bench.cli
    from vmm_bench import serving, trace_report

    monkeypatch.setattr(vmm_bench.cli, "require", lambda extra, why: None)
    parent = spec_of("--scenario", "piecewise", "--step-gap-ms", "2.5")
    assert parent.engine.step_gap_ms == 2.5
    assert spec_of("--scenario", "piecewise").engine.step_gap_ms == 0
    argv = parent.child_argv("piecewise:vmm:random", "host", model="llama",
                             scenario="piecewise", extra=parent.engine.argv("all"))
    assert bench_spec(build_parser().parse_args(argv[3:])).engine.step_gap_ms == 2.5
    for bad in ("-1", "1001", "soon"):
        with pytest.raises(CLIError, match="milliseconds from 0 to 1000"):
            spec_of("--scenario", "piecewise", "--step-gap-ms", bad)
    assert any(n.startswith("--step-gap-ms: scenario decode does not use it")
               for n in spec_of("--step-gap-ms", "3").notes)

    def run(gap_s):
        t0 = time.perf_counter()
        import torch

        record = serving.serve_trace(lambda size, x=None: torch.ones(size), torch.ones,
                                     lambda x: x, [1, 2, 4], pools=[], steps=20, seed=0,
                                     clock=serving.StepClock(lambda: None),
                                     wrong_above=0.0, kind="uniform", gap_s=gap_s)
        return record, time.perf_counter() - t0

    run(0.0)  # whatever a first call pays (torch's first operators) is paid here
    plain, took_plain = run(0.0)
    record, took = run(0.02)
    assert plain["trace_step_gap_ms"] == 0.0 and record["trace_step_gap_ms"] == 20.0
    assert took - took_plain >= 20 * 0.02 * 0.9, (took, took_plain)
    assert record["step_us_max"] < 20_000  # the gap is not in any step's time

    def row(strategy, policy, med, gap, **kw):
        r = served(strategy, "random", policy, 0, 0, 0, **kw)
        r.update(trace="uniform", served_graph_bytes=300 * MIB, step_us_median=med,
                 step_us_mean=med, trace_wrong=[], trace_recaptures=0, trace_steps=300,
                 trace_step_gap_ms=gap)
        r["traces"] = {"uniform": {k: r[k] for k in (
            "trace", "served_graph_bytes", "step_us_median", "step_us_mean", "trace_wrong",
            "trace_recaptures", "trace_steps", "trace_step_gap_ms")}}
        return r

    records = [row("vllm", "framework", 8000.0, 10.0),
               row("vmm", "all", 8000.0, 10.0, exec_resident=1683, wake_ratio_max=1.1),
               row("vmm", "budget:25%+ahead+hint", 8080.0, 10.0, exec_resident=421,
                   wake_ratio_max=1.1)]
    trace_report.print_traces("piecewise", records, "vllm")
    out = capsys.readouterr().out
    assert "(uniform sizes, 10 ms of untimed host time after each)" in " ".join(out.split())
    assert "target piecewise uniform (10 ms of host time between steps) vmm " \
           "budget:25%+ahead+hint: " in out, out


def test_each_trace_gets_its_rows_and_a_target_line_per_policy(capsys):
    from vmm_bench import trace_report

    def traced(strategy, policy, parts, **kw):
        r = served(strategy, "random", policy, 0, 0, 0, **kw)
        r["traces"] = {kind: {"trace": kind, "served_graph_bytes": int(mib * MIB),
                              "step_us_median": med, "step_us_mean": mean,
                              "trace_wrong": [], "trace_recaptures": 0,
                              "trace_misses": misses, "trace_prepared_ahead": 90,
                              "trace_unused_ahead": 3, "trace_waits": 1,
                              "trace_cold_blocks": 2, "trace_steps": 300}
                       for kind, (mib, med, mean, misses) in parts.items()}
        r.update(r["traces"]["uniform"])
        return r

    records = [
        traced("vllm", "framework", {"uniform": (460, 8000.0, 8100.0, None),
                                     "drift": (460, 8000.0, 8100.0, None)}),
        traced("vmm", "all", {"uniform": (452, 7900.0, 8000.0, 0),
                              "drift": (452, 7900.0, 8000.0, 0)},
               exec_resident=1683, wake_ratio_max=2.2, wake_recaptures=0, capture_s=24.0),
        traced("vmm", "budget:25%+share+ahead+hint",
               {"uniform": (200, 7950.0, 8100.0, 4), "drift": (210, 8100.0, 8300.0, 9)},
               exec_resident=421, wake_ratio_max=1.6, wake_eager_ratio_max=1.04,
               wake_eager_ms=48.0, wake_recaptures=0, capture_s=19.0),
    ]
    records[0]["capture_s"] = 20.0
    by_trace = trace_report.print_traces("piecewise", records, "vllm")
    assert list(by_trace) == ["uniform", "drift"]
    out = capsys.readouterr().out
    assert "piecewise, trace drift:" in out and "(drift sizes)" in out
    lines = [ln for ln in out.splitlines() if ln.startswith("target ")]
    assert len(lines) == 2  # one per trace for the one policy other than all
    uniform, drift = lines
    assert uniform.startswith("target piecewise uniform vmm budget:25%+share+ahead+hint: "
                              "graph memory 0.43x vllm random (<= 0.5); step 1.006x "
                              "median, 1.012x mean of every executable resident (<= 1.02); "
                              "first replay after wake 1.60x warm lazily, 1.04x after an "
                              "eager wake of 48 ms (<= 1.2); 0 wrong, "
                              "0 recaptures; steps begun cold 2 of 300, misses 4, "
                              "prepared ahead 90 (3 unused), waits 1: met (the first "
                              "replay after a wake: through the eager wake only)")
    assert drift.endswith("NOT MET (step median, step mean)")
    # a wake slow both ways, or never measured eagerly, is a target missed
    fast = dict(records[2], wake_ratio_max=1.1)  # lazily within the target: plain met
    trace_report.print_traces("piecewise", [records[0], records[1], fast], "vllm")
    assert [ln for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("target piecewise uniform")][0].endswith("waits 1: met")
    for eager in (1.3, None):
        slow = dict(records[2], wake_eager_ratio_max=eager)
        trace_report.print_traces("piecewise", [records[0], records[1], slow], "vllm")
        lines = [ln for ln in capsys.readouterr().out.splitlines()
                 if ln.startswith("target piecewise uniform")]
        assert lines[0].endswith("NOT MET (wake)"), lines
    # the capture, once per policy (no budget too) and not per trace, against vLLM's
    assert [ln for ln in out.splitlines() if ln.startswith("capture ")] == [
        "capture piecewise: vmm 24.0 s for 1683 graphs, 1.20x vllm random (<= 1.1): NOT MET",
        "capture piecewise: vmm budget:25%+share+ahead+hint 19.0 s for 1683 graphs, 0.95x "
        "vllm random (<= 1.1): met"]
    launch = [ln for ln in out.splitlines() if ln.startswith("launch path ")]
    assert launch[0] == ("launch path piecewise uniform: vmm (every executable resident) a "
                         "step 0.988x median, 0.988x mean of vllm random (torch's replay())")
    assert len(launch) == 2


def test_a_policy_prepared_ahead_is_compared_with_its_budget_served_inline(capsys):
    from vmm_bench import trace_report

    def traced(policy, med, mean, misses, updates, **kw):
        r = served("vmm", "random", policy, 0, 0, 0, **kw)
        r["traces"] = {"zipf": {"trace": "zipf", "served_graph_bytes": 200 * MIB,
                                "step_us_median": med, "step_us_mean": mean,
                                "trace_wrong": [], "trace_recaptures": 0,
                                "trace_misses": misses, "trace_updates": updates}}
        r.update(r["traces"]["zipf"])
        return r

    records = [
        traced("all", 8000.0, 8000.0, 0, 0, exec_resident=1683),
        traced("budget:25%+share", 8600.0, 8800.0, 2700, 2600, exec_resident=421),
        traced("budget:25%+share+ahead", 8300.0, 8360.0, 200, 4100, exec_resident=421),
        traced("budget:25%+share+ahead+hint", 8170.0, 8184.0, 3, 2700, exec_resident=421),
    ]
    trace_report.print_traces("piecewise", records, "vllm")
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("ahead ")]
    assert lines == [
        "ahead piecewise zipf: vmm budget:25%+share+ahead a step 0.965x median, 0.950x mean "
        "of vmm budget:25%+share in this run (misses 200 against 2700, updates 4100 "
        "against 2600)",
        "ahead piecewise zipf: vmm budget:25%+share+ahead+hint a step 0.950x median, 0.930x "
        "mean of vmm budget:25%+share in this run (misses 3 against 2700, updates 2700 "
        "against 2600)"]
