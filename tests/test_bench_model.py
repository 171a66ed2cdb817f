"""``vmm-core bench --model``: the built-in models and user factories, on the CPU.

The device benchmark builds its model through ``load_workload`` in every child; here the
same loader runs on the CPU, the Llama stack runs eagerly and under a real GraphExecutor
on the host backend (bucket padding, persistent buffers, fresh inputs), and every error a
user can make with a factory is checked for its message.
"""

from __future__ import annotations

import math
import sys
import textwrap

import pytest

import vmm_core
from vmm_bench import workload as wl
from vmm_bench.errors import BenchModelError
from vmm_bench.measure import GrowthRecorder, ordered

FACTORIES = textwrap.dedent('''
    import torch

    def good(*, device, dtype, max_batch, seed):
        torch.manual_seed(seed)
        w = torch.randn(8, 8, device=device, dtype=dtype)
        ids = torch.randint(0, 5, (max_batch, 3), device=device)
        x = torch.randn(max_batch, 8, device=device, dtype=dtype)
        table = torch.randn(5, 8, device=device, dtype=dtype)
        return (lambda x, ids: (x @ w + table[ids].sum(1), ids * 2)), (x, ids)

    def few(device, max_batch):          # takes only what it needs, positionally named
        return (lambda x: x * 2), torch.ones(max_batch, 4, device=device)

    def needs_more(device, max_batch, tokenizer):
        raise AssertionError("never called")

    def raises(**kw):
        raise RuntimeError("out of coffee")

    def not_a_pair(**kw):
        return torch.ones(2, 2)

    def fn_not_callable(device, max_batch):
        return 3, torch.ones(max_batch, 2)

    def wrong_batch(device, max_batch):
        return (lambda x: x), torch.ones(max_batch + 1, 2, device=device)

    def elsewhere(device, max_batch):
        return (lambda x: x), torch.ones(max_batch, 2, device="meta")

    def scalar_output(device, max_batch):
        return (lambda x: x.sum()), torch.ones(max_batch, 2, device=device)

    class Models:
        @staticmethod
        def nested(device, max_batch):
            return (lambda x: x + 1), torch.zeros(max_batch, 2, device=device)

    NOT_CALLABLE = 5
''')


@pytest.fixture(scope="module")
def factories(tmp_path_factory):
    root = tmp_path_factory.mktemp("factories")
    (root / "bench_factories.py").write_text(FACTORIES)
    (root / "broken_factories.py").write_text("import no_such_dependency_xyz\n")
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in ("bench_factories", "broken_factories"):
        sys.modules.pop(name, None)


def load(spec, max_batch=6, **kw):
    import torch

    return wl.load_workload(spec, device="cpu", dtype=torch.float32, max_batch=max_batch,
                            seed=0, **kw)


def test_a_factory_is_called_with_the_benchmark_parameters(factories):
    w = load("bench_factories:good", max_batch=6)
    assert w.name == "bench_factories:good"
    assert [tuple(t.shape) for t in w.inputs] == [(6, 8), (6, 3)]
    assert "inputs [6, 8] float32, [6, 3] int64" in w.description
    assert wl.check_eager(w, 4) == [(4, 8), (4, 3)]


def test_a_factory_may_take_only_the_parameters_it_uses(factories):
    w = load("bench_factories:few", max_batch=3)
    assert w.fn(*w.inputs).tolist() == [[2.0] * 4] * 3
    assert load("bench_factories:Models.nested").inputs[0].shape == (6, 2)


@pytest.mark.parametrize("spec, message", [
    ("nocolon", "expected a built-in model ('mlp', 'llama', 'llama8b') or "
                "'package.module:factory'"),
    ("pkg.mod:", "expected a built-in model ('mlp', 'llama', 'llama8b') or "
                 "'package.module:factory'"),
    ("pkg mod:f", "expected a built-in model ('mlp', 'llama', 'llama8b') or "
                  "'package.module:factory'"),
    ("no_such_module_xyz:make", "importing 'no_such_module_xyz' failed with "
                                "ModuleNotFoundError"),
    ("broken_factories:make", "importing 'broken_factories' failed with ModuleNotFoundError: "
                              "No module named 'no_such_dependency_xyz'"),
    ("bench_factories:missing", "module 'bench_factories' has no attribute 'missing'"),
    ("bench_factories:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not a callable factory"),
    ("bench_factories:needs_more", "the factory needs 'tokenizer', which vmm-core bench does "
                                   "not pass; it passes only device, dtype, max_batch, seed"),
    ("bench_factories:raises", "the factory raised RuntimeError: out of coffee"),
    ("bench_factories:not_a_pair", "must return (fn, example_inputs); it returned a Tensor"),
    ("bench_factories:fn_not_callable", "fn a int, which is not callable"),
    ("bench_factories:wrong_batch", "example input 0 has shape (7, 2); every input needs the "
                                    "batch first, at max_batch=6"),
    ("bench_factories:elsewhere", "example input 0 lives on meta, the benchmark runs on cpu"),
])
def test_factory_mistakes_are_explained(factories, spec, message):
    with pytest.raises(BenchModelError) as info:
        load(spec)
    assert message in str(info.value)
    assert str(info.value).startswith(f"--model {spec!r}")


def test_model_outputs_need_the_batch_first(factories):
    w = load("bench_factories:scalar_output")
    with pytest.raises(BenchModelError, match=r"returned shape \(\); outputs need the batch"):
        wl.check_eager(w)


def test_options_belong_to_the_built_in_models(factories):
    with pytest.raises(BenchModelError, match="--hidden configure the built-in models only"):
        load("bench_factories:good", options={"hidden": 4})
    with pytest.raises(BenchModelError, match="--model mlp has no option --heads"):
        load("mlp", options={"heads": 4})


def test_fresh_inputs_are_new_floats_and_valid_integer_rows():
    import torch

    x = torch.randn(6, 4)
    ids = torch.arange(6 * 3).reshape(6, 3)
    fx, fids = wl.fresh_inputs((x, ids), 4, seed=1)
    assert fx.shape == (4, 4) and fx.dtype == x.dtype and not torch.equal(fx, x[:4])
    assert fids.shape == (4, 3)
    for row in fids.tolist():  # every row is one of the example's rows
        assert row in ids.tolist()
    again = wl.fresh_inputs((x, ids), 4, seed=1)
    assert all(torch.equal(a, b) for a, b in zip(again, (fx, fids)))


def test_relative_error_catches_nan_and_integer_mismatches():
    import torch

    ref = torch.ones(4, 2)
    assert wl.relative_error(ref, ref) == 0.0
    assert wl.relative_error(ref * 1.01, ref) == pytest.approx(0.01)
    assert math.isnan(wl.relative_error(torch.full((4, 2), float("nan")), ref))
    ids = torch.arange(4)
    assert wl.relative_error((ref, ids), (ref, torch.tensor([0, 1, 9, 9]))) == 0.5


LLAMA_SMALL = {"layers": 2, "hidden": 128, "ffn": 256, "heads": 4, "kv_heads": 2, "ctx": 8}


def test_llama_stack_is_per_row_so_padded_buckets_replay_it_exactly():
    pytest.importorskip("transformers")
    import torch

    w = load("llama", max_batch=16, options=LLAMA_SMALL)
    assert "2 transformers LlamaDecoderLayers, float32 (hidden 128" in w.description
    x = w.inputs[0]
    full = w.fn(x)
    assert full.shape == (16, 128) and torch.isfinite(full).all()
    # row i of a batch of n is row i of the full batch: padding rows change nothing
    assert torch.allclose(w.fn(x[:5]), full[:5], atol=1e-5, rtol=1e-5)


def test_llama_stack_under_the_executor_matches_eager_on_fresh_inputs():
    """The device child's check, on the host backend: capture every bucket in random order
    into vmm spaces, then compare against eager at batches between the buckets."""
    pytest.importorskip("transformers")
    import random

    w = load("llama", max_batch=16, options=LLAMA_SMALL)
    buckets = [1, 2, 4, 8, 16]
    ex = vmm_core.GraphExecutor(w.fn, w.inputs, buckets=buckets, reuse="vmm", backend="host")
    try:
        for b in ordered(buckets, "random", seed=3):
            ex.capture_all([b])
        assert ex.captured_buckets == buckets
        for b in buckets:
            n = b if b < 3 else random.Random(b).randint(b // 2 + 1, b)
            x = wl.fresh_inputs(w.inputs, n, seed=b)
            assert wl.relative_error(ex(*x), w.fn(*x)) < 1e-5
    finally:
        ex.close()


def test_growth_recorder_reads_after_every_capture_and_keeps_probe_time_apart():
    """On the host allocator the growth curve of vmm spaces is the running maximum."""
    alloc = vmm_core.SharedVMMAllocator("host")
    try:
        probes = []

        def probe():
            probes.append(alloc.physical_bytes)
            return alloc.physical_bytes

        rec = GrowthRecorder(probe)
        assert rec.baseline == 0
        unit = alloc.granularity
        sizes = [3, 9, 1, 5]
        for i, pages in enumerate(sizes):
            def capture(pages=pages, first=not i):
                if not first:
                    alloc.switch_to_new_virtual_space()
                alloc.allocate(pages * unit)
            rec.capture(capture)
        assert len(rec.growth_bytes) == len(sizes) and len(probes) == len(sizes) + 1
        for i, grown in enumerate(rec.growth_bytes):
            largest, total = max(sizes[:i + 1]) * unit, sum(sizes[:i + 1]) * unit
            assert largest <= grown <= largest * 1.05 + unit, (i, grown, largest)
            assert i == 0 or grown < total  # max, not sum
        assert rec.total_bytes == rec.growth_bytes[-1] == alloc.physical_bytes
        assert rec.capture_s > 0 and rec.probe_s > 0
    finally:
        alloc.close()


def test_llama8b_is_the_llama_3_8b_shape_and_a_shortened_one_builds_on_the_cpu():
    assert wl.check_options("llama8b", {}) == {"layers": 32, "hidden": 4096, "ffn": 14336,
                                               "heads": 32, "kv_heads": 8, "ctx": 64}
    assert wl.check_options("llama8b", {"layers": 2})["layers"] == 2  # --layers N
    assert "llama8b" in wl.LLAMA_MODELS
    with pytest.raises(BenchModelError, match="--model llama8b has no option --seq"):
        wl.check_options("llama8b", {"seq": 2})
    pytest.importorskip("transformers")
    # the same factory at a width a CPU builds in a moment (the full one is ~15 GB)
    w = load("llama8b", max_batch=4, options={"layers": 2, "hidden": 64, "ffn": 128,
                                               "heads": 4, "kv_heads": 2, "ctx": 4})
    assert w.description.startswith("2 transformers LlamaDecoderLayers, float32 (hidden 64")
    assert wl.check_eager(w) == [(4, 64)]


def test_engine_runner_scenarios_take_only_the_llama_models():
    assert wl.llama_model("llama8b", "piecewise") == "llama8b"
    assert wl.llama_model(None, "piecewise") == "llama"
    with pytest.raises(BenchModelError, match="--scenario piecewise runs a transformers Llama "
                                              "stack: --model llama or llama8b, not 'mlp'"):
        wl.llama_model("mlp", "piecewise")
