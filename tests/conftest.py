"""Test platforms and the per-platform summary.

Every test that takes the ``vmm_backend`` fixture runs once per platform: ``host``
(always), the emulated vendor drivers, and ``cuda`` (skipped without a GPU, failing
instead under VMM_CORE_REQUIRE=cuda).  The run ends with one line per skip reason and
its count, then one line per platform with its counts: the last thing on the screen.
"""

from __future__ import annotations

import contextlib
import re
import warnings
from collections import Counter, defaultdict

import pytest

import vmm_core
from vmm_core.testing.platforms import (
    ENV_REQUIRE,
    require_backend,
    required_platforms,
    skip_or_fail,
)

PLATFORMS = ["host", "ascend-emulated", "mlu-emulated", "cuda"]

#: what ``VMM_CORE_REQUIRE`` may name: the names this suite's tests skip under
#: (``skip_or_fail``), each turning those skips into failures
REQUIREMENTS = {
    "cuda": "CUDA tests (one GPU)",
    "cuda-2gpu": "the two-GPU tests (implies cuda)",
    "ascend": "the Ascend tests on the emulated driver",
    "mlu": "the MLU tests on the emulated driver",
    "vllm": "the tests against the released vLLM",
    "torch_memory_saver": "the tests against the released torch_memory_saver",
}


def pytest_configure(config):
    """A misspelled requirement would turn nothing into a failure and let every test it
    meant skip green: the run stops before collecting anything."""
    unknown = sorted(required_platforms() - set(REQUIREMENTS))
    if unknown:
        valid = "\n".join(f"  {name:<20} {what}" for name, what in REQUIREMENTS.items())
        raise pytest.UsageError(
            f"{ENV_REQUIRE} names {', '.join(map(repr, unknown))}, which no test requires. "
            f"Valid names (comma-separated):\n{valid}")

_setup = {}


def platform_setup(name):
    def deco(fn):
        _setup[name] = fn
        return fn
    return deco


@platform_setup("host")
def _host():
    return vmm_core.get_backend("host")


@platform_setup("cuda")
def _cuda():
    return require_backend("cuda")


def _emulated(platform):
    import emulated  # tests/emulated: builds the fake vendor libraries

    try:
        return emulated.backend_for(platform)
    except emulated.NotBuildable as exc:
        skip_or_fail(platform, str(exc))


@platform_setup("ascend-emulated")
def _ascend():
    return _emulated("ascend")


@platform_setup("mlu-emulated")
def _mlu():
    return _emulated("mlu")


@pytest.fixture(scope="session")
def cuda():
    """The CUDA backend with a usable torch.cuda (GPU tests): skip, or fail when required."""
    backend = require_backend("cuda")
    import torch

    if not torch.cuda.is_available():
        skip_or_fail("cuda", "torch.cuda.is_available() is False")
    return backend


@pytest.fixture(params=PLATFORMS, scope="session")
def vmm_platform(request):
    return request.param


@pytest.fixture
def vmm_backend(vmm_platform):
    yield _setup[vmm_platform]()
    if vmm_platform.endswith("-emulated"):
        import emulated

        emulated.release(vmm_platform.split("-")[0])


# ------------------------------------------------------------------ shared fixtures
@pytest.fixture(autouse=True)
def fresh_once_notices(monkeypatch):
    """The notices vmm_core gives once per process (a region with nothing allocated in
    it, a capture that allocated nothing in its space, on a backend whose framework
    tensors it cannot route) start unsaid in every test, as in a new process: whether a
    test gives one does not depend on which tests ran before it.  pyproject.toml makes a
    notice no test asserts an error."""
    from vmm_core.graphs import capture_space
    from vmm_core.memory import tagged

    monkeypatch.setattr(tagged, "_warned_unrouted", set())
    monkeypatch.setattr(capture_space, "_warned_unrouted", set())


@pytest.fixture
def warns_unrouted():
    """``warns_unrouted(backend, *tags)``: a block in which each region of ``tags`` (no
    tag: a GraphPool capture) ends with nothing allocated in it, and vmm_core says so
    (VMMFallbackWarning) on a backend whose framework tensors it cannot route, the host's;
    where it routes them (a GPU), nothing is said.  vmm_core says it once per process
    (per tag, or per backend for captures): the block forgets that it was said before,
    so it is asserted whichever test ran before."""
    from vmm_core.errors import VMMFallbackWarning
    from vmm_core.graphs import capture_space
    from vmm_core.memory import routing, tagged

    @contextlib.contextmanager
    def expect(backend, *tags):
        backend = vmm_core.get_backend(backend) if isinstance(backend, str) else backend
        if routing.framework_routed(backend, 0):
            yield
            return
        said = [rf"region\({re.escape(repr(tag))}\) on the {backend.name!r} backend: "
                rf"nothing was allocated in it" for tag in tags]
        for tag in tags:
            tagged._warned_unrouted.discard((tag, backend.name))
        if not tags:
            capture_space._warned_unrouted.discard(backend.name)
            said = [rf"GraphPool on the {backend.name!r} backend: the capture of key .* "
                    rf"allocated nothing in its space"]
        with pytest.warns(VMMFallbackWarning) as record:
            yield
        messages = [str(w.message) for w in record]
        for pattern in said:
            assert any(re.match(pattern, m) for m in messages), (pattern, messages)
        for w in record:  # any other notice is not this block's to take
            if not any(re.match(pattern, str(w.message)) for pattern in said):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    return expect


@pytest.fixture
def host():
    """The embedded backend, real on every machine."""
    import vmm_core

    return vmm_core.get_backend("host")


@pytest.fixture
def graphs_passed_to(monkeypatch):
    """``graphs_passed_to(cls, name)``: wrap the method ``cls.name``, which takes a graph
    first, so that it records each graph it is called with; returns that list."""
    def record(cls, name: str) -> list:
        seen, real = [], getattr(cls, name)

        def recording(self, graph, *args, **kwargs):
            seen.append(graph)
            return real(self, graph, *args, **kwargs)

        monkeypatch.setattr(cls, name, recording)
        return seen

    return record


@pytest.fixture
def no_pools_backend():
    """The host backend declaring ``graph_pool=False`` (notes "framework has no MemPool"),
    as a backend whose framework cannot capture into a custom-allocator pool does."""
    import dataclasses

    from vmm_backends.host.vmm_api import HostBackend
    from vmm_core.hookspecs import hookimpl
    from vmm_core.registry import BackendRegistry

    class NoPools(HostBackend):
        @hookimpl
        def vmm_capabilities(self, device):
            caps = HostBackend.vmm_capabilities(self, device)
            return dataclasses.replace(caps, graph_pool=False,
                                       notes="framework has no MemPool")

    return BackendRegistry(entry_points=[]).register(NoPools(), name="nopools")


@pytest.fixture
def clean_tags():
    """Close and forget every tagged allocator a test registered."""
    yield
    from vmm_core.memory import tag_state, tagged

    with tag_state.state_lock():
        tag_state.settled_registry()  # what was queued meanwhile is closed too
    tag_state._pending.clear()
    for tag in list(tagged._registry):
        for alloc in tagged._registry.get(tag, []):
            alloc.close()
    tagged._registry.clear()
    tagged._region_allocators.clear()
    tagged._pools.clear()


@pytest.fixture
def fresh_compat(monkeypatch):
    """The torch_memory_saver compat's process-wide state, empty for each test (as in a
    new process), with none of torch_memory_saver's variables set; at the end, no host
    copy is still being made in the background."""
    from vmm_core.integrations.torch_memory_saver import settings, state
    from vmm_core.memory import free_margin, offload

    for name in ("TMS_RETAIN_CPU_BACKUP", "TMS_INIT_ENABLE", "TMS_INIT_ENABLE_CPU_BACKUP",
                 "TMS_INIT_CPU_BACKUP_BACKEND", "TMS_INIT_ENABLE_DISK_BACKUP",
                 "TMS_DISK_BACKUP_DIR", "TMS_DISK_BACKUP_CHUNK_MB"):
        monkeypatch.delenv(name, raising=False)
    state.reset()
    settings.reset()
    yield
    state.reset()
    settings.reset()
    free_margin.set_margin(0)
    assert offload.wait_for_prepared(30)


# ------------------------------------------------------------------ per-platform summary
_counts: dict[str, Counter] = defaultdict(Counter)
_skips: Counter = Counter()  # reason -> tests skipped for it


def _platform_of(nodeid: str) -> str | None:
    if "[" not in nodeid:
        return None
    params = nodeid.rsplit("[", 1)[1].rstrip("]").split("-")
    joined = "-".join(params)
    for p in sorted(PLATFORMS, key=len, reverse=True):
        if joined == p or joined.startswith(p + "-") or joined.endswith("-" + p) \
                or f"-{p}-" in joined:
            return p
    return None


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else \
        str(longrepr)
    return reason.removeprefix("Skipped: ")


def pytest_runtest_logreport(report):
    if report.skipped:
        _skips[_skip_reason(report)] += 1
    platform = _platform_of(report.nodeid)
    if platform is None:
        return
    if report.when == "call":
        _counts[platform][report.outcome] += 1
    elif report.outcome in ("failed", "skipped") and report.when == "setup":
        _counts[platform]["skipped" if report.skipped else "failed"] += 1
    elif report.outcome == "failed":
        _counts[platform]["failed"] += 1


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_terminal_summary(terminalreporter):
    """After pytest's own summary (failures, then the short summary): skips by reason,
    then the platforms, so the counts are the last lines before the totals."""
    yield
    if _skips:
        terminalreporter.section("skipped, by reason")
        for reason, n in _skips.most_common():
            terminalreporter.write_line(f"{n:5d}  {reason}")
    if not _counts:
        return
    terminalreporter.section("contract suite per platform")
    for p in PLATFORMS:
        c = _counts.get(p, Counter())
        terminalreporter.write_line(
            f"platform {p}: {c['passed']} passed, {c['failed']} failed, "
            f"{c['skipped']} skipped")
