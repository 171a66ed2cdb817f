"""The piecewise/families benchmark's plumbing on the CPU (the runs need a GPU)."""

from __future__ import annotations

import types

import pytest

from vmm_bench import piecewise, piecewise_report, piecewise_runners
from vmm_bench.spec import BenchSpec, EngineSpec
from vmm_bench.torch_pools import SharedTorchPool, make_pool


def _configs(scenario="piecewise", strategies="vmm,vllm", orders="ascending,random"):
    spec = BenchSpec(scenarios=tuple(scenario.split(",")), orders=tuple(orders.split(",")),
                     engine=EngineSpec(tuple(strategies.split(","))))
    return piecewise.configurations(spec)


def test_configurations_cover_alone_every_strategy_and_order():
    assert _configs() == [
        "piecewise:alone:ascending", "piecewise:vmm:ascending", "piecewise:vmm:random",
        "piecewise:vllm:ascending", "piecewise:vllm:random"]
    assert _configs(scenario="record-stream") == [
        "record-stream:torch-off:-", "record-stream:torch-on:-", "record-stream:vmm-off:-",
        "record-stream:vmm-on:-"]
    with pytest.raises(ValueError, match="unknown scenario"):
        _configs(scenario="exec-cache")  # folded into --executables (test_bench_exec_cache)
    # SGLang's runner captures whole graphs: it has no piecewise row
    assert _configs(strategies="sglang,vmm", orders="descending") == [
        "piecewise:alone:ascending", "piecewise:vmm:descending"]
    assert _configs(scenario="ondemand", strategies="sglang,vmm-keep,vllm") == [
        "ondemand:alone:-", "ondemand:sglang:ondemand", "ondemand:vmm-keep:ondemand",
        "ondemand:vllm:ondemand"]
    with pytest.raises(ValueError, match="unknown scenario"):
        _configs(scenario="pipeline")
    with pytest.raises(ValueError, match="unknown strategies"):
        _configs(strategies="vmm,magic")
    with pytest.raises(ValueError, match="captures whole graphs; use it with --scenario "
                                         "whole or ondemand"):
        piecewise._check_strategy("piecewise", "sglang")
    with pytest.raises(ValueError, match="captures whole graphs"):
        _configs(strategies="sglang")
    # "vllm" keeps non-owning views of intermediate outputs; keeping them is "keep"
    assert piecewise.DISCIPLINES["vllm"].weak_entries
    assert not piecewise.DISCIPLINES["keep"].weak_entries


def test_ondemand_trace_captures_each_size_once_and_replays_only_captured_ones():
    sizes = [1, 2, 4, 8, 16, 32]
    trace = piecewise._trace(sizes, "ondemand", seed=3, scenario="ondemand")
    assert sorted(s for s, _ in trace) == sizes
    assert [s for s, _ in trace] != sizes  # random first appearance
    seen = set()
    for size, replays in trace:
        assert set(replays) <= seen and (replays or not seen)
        seen.add(size)
    assert piecewise._trace(sizes, "descending", 0, "whole") == [(s, []) for s in sizes[::-1]]


def _record(strategy, order, graphs, graph_mib, pool_mib, **kw):
    MiB = 1 << 20
    r = {"scenario": "piecewise", "strategy": strategy, "order": order, "graphs": graphs,
         "graph_bytes": graph_mib * MiB, "pool_bytes": pool_mib * MiB,
         "default_pool_bytes": 0, "capture_s": 1.0, "replay_us": 100.0,
         "wrong_graphs": [], "worst_rel_err": 1e-3, "growth_bytes": [graph_mib * MiB],
         "physical_bytes": pool_mib * MiB, "largest_space_bytes": pool_mib * MiB,
         "handles": 1}
    r.update(kw)
    return r


def test_table_reports_ratios_against_alone_and_the_executable_floor(capsys):
    rows = [_record("alone", "ascending", 5, 101, 100),
            _record("vmm", "ascending", 255, 151, 100),
            _record("vllm", "ascending", 255, 400, 398),
            {"scenario": "piecewise", "strategy": "sglang", "order": "ascending",
             "error": "boom"}]
    piecewise_report.print_scenario("piecewise", rows, "dev", "t", "a llama")
    out = capsys.readouterr().out
    assert "sglang" in out and "FAILED: boom" in out
    assert "1.000x the largest space" in out
    # executables: 51 MiB over 255 graphs = 0.2 MiB per graph, measured on vmm; the target
    # is 101 MiB alone + 250 more graphs at 0.2 MiB = 151 MiB: ratio 1.000
    assert "= 1.000" in out
    vmm_line = next(line for line in out.splitlines() if line.startswith("vmm "))
    assert " 1.50 " in vmm_line  # 151 / 101 MiB against the largest size alone


def test_table_prefers_the_measured_executables_and_names_the_peers(capsys):
    rows = [_record("alone", "ascending", 5, 101, 100),
            _record("vmm", "ascending", 255, 151, 100, exec_bytes_per_graph=0.1 * (1 << 20)),
            _record("vllm", "ascending", 255, 160, 150)]
    piecewise_report.print_scenario("piecewise", rows, "dev", "t", "a llama")
    out = capsys.readouterr().out
    # 101 alone + 250 graphs x 0.1 MiB measured = 126 MiB: 151 / 126 = 1.198
    assert "executables of the other 250 graphs, measured) = 1.198" in out
    assert "CUDAGraphWrapper.__call__" in out  # the vllm row names the code it follows
    vmm_row = next(line for line in out.splitlines() if line.startswith("vmm "))
    assert " 102 KiB " in vmm_row  # the measured column (0.1 MiB)


# ---------------------------------------------------------------- the disciplines, on the host
class _Recorder:
    """The Llama stack, recording a weak reference to the storage of every tensor each
    graph function returns, and which earlier ones are alive when a piece starts."""

    def __init__(self, model) -> None:
        self.model = model
        self.made: list = []  # (size, graph index, [(weakref, data_ptr)])
        self.alive_at_start: list = []  # (size, graph index, {graph index: alive count})
        for name in ("hidden", "device", "dtype", "num_pieces", "attention", "layers"):
            setattr(self, name, getattr(model, name))

    def _record(self, size, index, out, inputs_ptr):
        import weakref

        from vmm_bench.peers import flat_tensors

        refs = [(weakref.ref(t.untyped_storage()), t.data_ptr()) for t in flat_tensors(out)
                if t.untyped_storage().data_ptr() != inputs_ptr]
        self.made.append((size, index, refs))
        return out

    def alive(self, size, index) -> int:
        return sum(ref() is not None for s, i, refs in self.made if (s, i) == (size, index)
                   for ref, _ in refs)

    def piece(self, index, *inputs):
        size = inputs[0].shape[0]
        self.alive_at_start.append((size, index, {i: self.alive(size, i)
                                                  for i in range(index)}))
        return self._record(size, index, self.model.piece(index, *inputs), self.inputs_ptr)

    def __call__(self, x):
        return self._record(x.shape[0], 0, self.model(x), self.inputs_ptr)


class _AddressOnlyOps:
    """Graph ops whose graphs hold no reference to what their capture returned: a device
    graph holds addresses, not tensors (the host backend's graphs keep their outputs to
    replay into them, which would hide what the runner itself holds)."""

    def __init__(self, ops) -> None:
        self.ops = ops

    def new_graph(self):
        return object()

    def capture(self, graph, fn, handle):
        return fn()


def _tiny_llama():
    pytest.importorskip("transformers")
    import torch

    from vmm_bench.models import LlamaStack

    return LlamaStack(layers=3, hidden=64, ffn=128, heads=4, kv_heads=2, ctx=8,
                      max_batch=16, dtype=torch.float32, device="cpu")


def _captured(discipline, runner_cls, sizes=(4, 16, 8)):
    import vmm_core

    host = vmm_core.get_backend("host")
    reuse = piecewise.DISCIPLINES[discipline].reuse
    pool = make_pool(reuse, backend=host, reads=())
    model = _Recorder(_tiny_llama())
    runner = runner_cls(model, pool, sizes, discipline, ops=_AddressOnlyOps(pool.ops))
    model.inputs_ptr = runner.inputs.untyped_storage().data_ptr()
    for size in sizes:
        runner.capture(size)
    return model, runner, pool


@pytest.mark.parametrize("discipline", ["vllm", "vmm"])
def test_vllm_discipline_entries_hold_no_storage_and_outputs_die_after_their_last_use(
        discipline):
    """vLLM's CUDAGraphWrapper: entry.output = weak_ref_tensors(output); the forward drops
    each piece's outputs once the next piece has consumed them."""
    model, runner, pool = _captured(discipline, piecewise_runners.PiecewiseRunner)
    pieces = model.num_pieces
    assert runner.num_graphs == 3 * pieces
    assert all(ref() is None for _, _, refs in model.made for ref, _ in refs)
    for size, index, alive in model.alive_at_start:
        for earlier, count in alive.items():
            if earlier < index - 1:  # consumed by an earlier piece: gone
                assert count == 0, (size, index, earlier)
        if index:  # the previous piece's residual and attention buffer are the inputs
            # (piece 0's residual is the runner's input buffer, which is not recorded)
            assert alive[index - 1] == (1 if index == 1 else 2), (size, index)
    # the entries are views of the captured addresses (the replay reads them there)
    for size, entries in runner.entries.items():
        made = [refs for s, _, refs in model.made if s == size]
        for entry, refs in zip(entries, made):
            from vmm_bench.peers import flat_tensors

            ptrs = {t.data_ptr() for t in flat_tensors(entry.output)}
            assert {p for _, p in refs} <= ptrs
    if discipline == "vmm":
        assert all(not space.kept for space in pool._spaces.values())  # no keep()


@pytest.mark.parametrize("discipline", ["keep", "vmm-keep"])
def test_keep_discipline_holds_every_intermediate_output(discipline):
    model, runner, pool = _captured(discipline, piecewise_runners.PiecewiseRunner)
    last = model.num_pieces - 1
    for size, index, refs in model.made:
        alive = sum(ref() is not None for ref, _ in refs)
        assert alive == (0 if index == last else len(refs)), (size, index)
    if discipline == "vmm-keep":
        assert all(space.kept for space in pool._spaces.values())


def test_sglang_discipline_holds_exactly_one_output_per_size():
    """SGLang's CudaGraphRunner: self.output_buffers[bs] = output, whole graphs."""
    model, runner, _ = _captured("sglang", piecewise_runners.FullRunner)
    alive = {size: sum(ref() is not None for ref, _ in refs) for size, _, refs in model.made}
    assert alive == {4: 1, 8: 1, 16: 1}
    # the vLLM FULL family holds none
    model, runner, _ = _captured("vllm", piecewise_runners.FullRunner)
    assert all(ref() is None for _, _, refs in model.made for ref, _ in refs)


@pytest.mark.parametrize("discipline", ["vllm", "vmm", "keep", "vmm-keep", "private",
                                        "vmm-seed", "vmm-keep-seed"])
@pytest.mark.parametrize("order", ["ascending", "descending"])
def test_runners_replay_through_entries_and_match_eager_on_the_host(discipline, order):
    """The replay wiring (keys, entries read by the eager attention, padding) on the host
    backend, whose replay rewrites the captured outputs as a device graph does.  A CPU
    returns freed memory to malloc where a device pool keeps it, so the non-owning views
    are replaced by the outputs themselves here; the tests above pin what is held."""
    import torch

    import vmm_core

    host = vmm_core.get_backend("host")
    model = _tiny_llama()
    reuse = piecewise.DISCIPLINES[discipline].reuse
    pool = make_pool(reuse, backend=host, reads=())
    pieces = piecewise_runners.PiecewiseRunner(model, pool, [4, 16], discipline,
                                               weak_ref=lambda o: o)
    full_pool = make_pool(reuse, backend=host, reads=(), allocator=pool.allocator)
    full = piecewise_runners.FullRunner(model, full_pool, [4, 16], discipline,
                                        weak_ref=lambda o: o)
    for size in sorted([4, 16], reverse=order == "descending"):
        pieces.capture(size), full.capture(size)
    assert pieces.num_graphs == 2 * model.num_pieces and full.num_graphs == 2
    if reuse == "vmm":
        assert set(pool.keys) == {("piecewise", 4), ("piecewise", 16)}
    for n in (3, 16, 1, 9):
        x = torch.randn(n, 64)
        torch.testing.assert_close(pieces(x).clone(), model(x))
        torch.testing.assert_close(full(x).clone(), model(x))
    with pytest.raises(ValueError, match="exceeds the largest"):
        pieces(torch.randn(17, 64))
    # no segment readings on the host: a seeding discipline seeds nothing there
    assert all(v == [] for v in (*pieces.seeded.values(), *full.seeded.values()))
    assert bool(full.seeded) == piecewise.DISCIPLINES[discipline].seed


def test_cpu_weak_refs_are_views_that_do_not_keep_the_storage():
    import weakref

    import torch

    from vmm_bench.peers import weak_ref_tensors

    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    ref = weakref.ref(t.untyped_storage())
    views = weak_ref_tensors((t, [t]))
    assert isinstance(views, tuple) and isinstance(views[1], list)
    assert views[0].data_ptr() == t.data_ptr() and views[0].shape == t.shape
    assert torch.equal(views[0], t)  # read while the owner lives
    del t
    assert ref() is None  # the views did not keep it
    from vmm_core.errors import CaptureError

    with pytest.raises(CaptureError, match="contiguous"):
        weak_ref_tensors(torch.zeros(4, 4).t())


def test_record_stream_reuse_on_a_backend_without_it_raises_and_leaves_the_pool_usable():
    import vmm_core
    from vmm_core.errors import CaptureError

    pool = vmm_core.GraphPool(backend="host", reads=())
    with pytest.raises(CaptureError, match="drop record_stream_reuse=True"):
        with pool.space("a", record_stream_reuse=True):
            pass
    with pool.space("a") as handle:
        assert handle is not None
    pool.close()


def test_graph_pool_space_turns_record_stream_reuse_on_for_its_block_only():
    """The flag reaches the graph ops for the capture block and no longer."""
    import contextlib

    import vmm_core

    pool = vmm_core.GraphPool(backend="host", reads=())
    calls = []

    class _Ops(type(pool.ops)):
        @contextlib.contextmanager
        def record_stream_reuse(self, enabled):
            calls.append(("on", enabled))
            yield
            calls.append(("off", enabled))

    pool.ops.__class__ = _Ops
    with pool.space("a", record_stream_reuse=True):
        assert calls == [("on", True)]
    assert calls == [("on", True), ("off", True)]
    with pool.space("b"):
        pass
    assert len(calls) == 2  # without the flag the allocator setting is left alone
    pool.close()


def test_side_stream_model_makes_the_temporaries_the_record_stream_case_needs():
    import torch

    from vmm_bench.models import SideStreamStack

    model = SideStreamStack(layers=3, hidden=32, temp_bytes=64 << 10, dtype=torch.float32,
                            device="cpu")
    assert model.rows * model.hidden * 4 == 64 << 10  # one temporary's bytes
    x = torch.randn(5, 32)
    out = model(x)
    assert out.shape == (5, 32) and torch.isfinite(out).all()


# ---------------------------------------------------------------- which key sets the pool
def test_space_accounting_names_each_key_and_the_largest_space_need_not_be_the_largest_size(
        host):
    """On the H100 the llama8b space of 464 (208 MiB) set the physical pool, not 512's
    (180 MiB): the record must say which key's space is the largest."""
    from host_space import framework_alloc

    import vmm_core

    MiB = 1 << 20
    pool = vmm_core.GraphPool(backend=host, reads=())
    for size, nbytes in ((512, 4 * MiB), (464, 6 * MiB), (8, 2 * MiB)):
        with pool.space(("full", size)):
            pool.keep(framework_alloc(nbytes))
    spaces = piecewise.space_accounting([pool, pool], memory=None)
    assert spaces == {"full:512": {"bytes": 4 * MiB}, "full:464": {"bytes": 6 * MiB},
                      "full:8": {"bytes": 2 * MiB}}
    lines = piecewise_report.space_lines({"spaces": spaces}, alone=None)
    assert lines == ["largest space: full:464, 6.0 MiB; the largest size's (full:512): "
                     "4.0 MiB"]
    shared = SharedTorchPool(backend=host)
    assert piecewise.space_accounting([shared], memory=None) == {}
    shared.close()
    pool.close()


def test_space_lines_compare_each_space_with_its_pool_and_torchs_fresh_pool_alone():
    MiB = 1 << 20
    alone = {"strategy": "alone", "graphs": 1, "graph_bytes": 184 * MiB,
             "pool_bytes": 180 * MiB,
             "fresh_pool_bytes": {"512": 180 * MiB, "464": 208 * MiB, "8": 6 * MiB}}
    row = {"graphs": 3, "graph_bytes": 222 * MiB,
           "spaces": {"full:512": {"bytes": 180 * MiB, "torch_segment_bytes": 180 * MiB},
                      "full:464": {"bytes": 208 * MiB, "torch_segment_bytes": 208 * MiB},
                      "full:8": {"bytes": 6 * MiB, "torch_segment_bytes": 6 * MiB}}}
    lines = piecewise_report.space_lines(row, alone, per_graph=5 * MiB)
    assert lines[0] == "largest space: full:464, 208.0 MiB; the largest size's (full:512): " \
                       "180.0 MiB"
    assert "every space asked for exactly the segments its pool holds (3 keys)" in lines[1]
    assert lines[2] == "torch, each size alone in a fresh pool: largest 464, 208.0 MiB; " \
                       "size 512: 180.0 MiB"
    assert lines[3] == "every space = torch's fresh pool of its size alone (3 keys)"
    # 184 - 180 + 208 = 212 MiB for the floor's own graph, + 2 more graphs x 5 MiB = 222
    assert lines[4].endswith("in place of the largest size's 180.0 MiB) = 1.000")

    # a space that asked for more than its pool holds, and more than torch alone needs
    row["spaces"]["full:464"] = {"bytes": 236 * MiB, "torch_segment_bytes": 208 * MiB}
    lines = piecewise_report.space_lines(row, alone, per_graph=5 * MiB)
    assert "1 of 3 spaces asked for more than their pool holds now" in lines[1]
    assert lines[1].endswith("full:464 +28.0 MiB")
    assert lines[3] == "1 of 3 spaces differ from torch's fresh pool of their size " \
                       "alone: full:464 +28.0 MiB"


def test_pool_segments_group_a_snapshot_by_pool_and_leave_the_default_pool_out():
    from vmm_bench.measure import DeviceMemory

    MiB = 1 << 20
    memory = DeviceMemory.__new__(DeviceMemory)
    memory.device = types.SimpleNamespace(index=0)
    snapshot = [{"device": 0, "segment_pool_id": (0, 0), "total_size": 2 * MiB},
                {"device": 0, "segment_pool_id": (0, 7), "total_size": 14 * MiB},
                {"device": 0, "segment_pool_id": (0, 7), "total_size": 20 * MiB},
                {"device": 1, "segment_pool_id": (0, 7), "total_size": 64 * MiB},
                {"device": 0, "segment_pool_id": (3, 0), "total_size": 2 * MiB}]
    memory.mod = types.SimpleNamespace(memory_snapshot=lambda: snapshot)
    assert memory.pool_segments() == {(0, 7): [20 * MiB, 14 * MiB], (3, 0): [2 * MiB]}
    snapshot.append({"device": 0, "total_size": MiB})  # no pool ids: cannot tell pools apart
    assert memory.pool_segments() is None
    memory.mod = types.SimpleNamespace()  # a framework without snapshots
    assert memory.pool_segments() is None


def test_fresh_pools_need_a_framework_that_tells_pools_apart(host):
    """On the host (no caching allocator snapshot) nothing is captured and None says "not
    measured"; the device runs it (tests/test_cuda_graph_pool.py)."""
    from vmm_bench.measure import DeviceMemory

    pool = SharedTorchPool(backend=host)
    captured = []

    class _Runner:
        def __init__(self, *args, **kw):
            captured.append(args)

    assert piecewise.fresh_pools(None, _Runner, [8, 16], "sglang", pool.ops,
                                 DeviceMemory(pool.ops), host) is None
    assert captured == []
    pool.close()
