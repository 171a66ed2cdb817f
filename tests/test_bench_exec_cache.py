"""``--scenario exec-cache`` is refused with the command that measures the same.

Executables under a budget are GraphPool's policy (vmm_core/graphs/executables.py), and
the engine-runner scenarios measure it with ``--executables``
(tests/test_bench_executables.py).  Checked here: the name is refused with the command
that replaces it, before any work, and the serving trace is Zipf-like.
"""

from __future__ import annotations

import collections

import pytest

from vmm_bench import report, scenarios, serving
from vmm_bench.cli import bench_spec
from vmm_core.cli import CLIError, build_parser


def test_the_exec_cache_scenario_is_refused_with_the_command_that_replaces_it():
    with pytest.raises(ValueError) as caught:
        scenarios.parse("piecewise,exec-cache")
    message = str(caught.value)
    assert message.startswith("--scenario exec-cache: ")
    assert "--executables all,budget:25%,budget:25%+share,share-always" in message
    assert "exec-cache" not in scenarios.SCENARIOS
    with pytest.raises(CLIError, match="--scenario piecewise"):
        bench_spec(build_parser().parse_args(["bench", "--scenario", "exec-cache"]))
    # the command it names is one the CLI takes
    replacement = message.split("use ", 1)[1].split()
    spec = bench_spec(build_parser().parse_args(["bench", *replacement]))
    assert spec.engine.executables == ("all", "budget:25%", "budget:25%+share", "share-always")


def test_the_request_trace_is_skewed_reproducible_and_covers_only_the_sizes():
    sizes = [1, 2, 4, 8, 16, 32, 64, 128]
    trace = serving.request_trace(sizes, 4000, seed=1)
    assert trace == serving.request_trace(sizes, 4000, seed=1)
    assert trace != serving.request_trace(sizes, 4000, seed=2)
    counts = collections.Counter(trace)
    assert set(counts) <= set(sizes)
    hot, cold = counts.most_common()[0][1], counts.most_common()[-1][1]
    assert hot > 4 * cold  # weight 1 against 1/8


def test_the_headline_reports_executables_measured_by_instantiation():
    MiB = 1 << 20
    rows = [{"strategy": s, "order": "ascending", "graphs": 10, "graph_bytes": g * MiB,
             "wrong_graphs": [], "exec_bytes_per_graph": e}
            for s, g, e in (("alone", 10, 200 * 1024), ("vmm", 20, 260 * 1024),
                            ("vllm", 30, None))]
    text = " ".join(report.headline(rows, model="m", shared=("vllm",)))
    assert "measured 200 KiB to 260 KiB per graph executable over 2 configuration(s)" in text
    assert "executable_measured" not in report.summary(rows[2:], shared=("vllm",))
