"""``vmm-core info`` and ``vmm-core bench``, run as a user runs them: in a subprocess."""

from __future__ import annotations

import json
import mmap
import os
import re
import subprocess
import sys

import pytest

from vmm_core.bench.host_demo import working_set

BUILTIN = ("ascend", "cuda", "host", "mlu")


def _env(**extra) -> dict:
    # tests/emulated points VMM_CORE_*_LIB at emulated drivers for the rest of the session;
    # a user's shell has none of that.
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMM_CORE_")}
    env.update(extra)
    return env


def vmm_core_cli(*args, timeout=300, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vmm_core.cli", *args], capture_output=True,
                          text=True, env=_env(**env), timeout=timeout)


def _no_traceback(proc) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def detected() -> list[str]:
    """available_backends() as a fresh process with the same environment sees it."""
    proc = subprocess.run([sys.executable, "-c",
                           "import json, vmm_core; print(json.dumps(vmm_core.available_backends()))"],
                          capture_output=True, text=True, env=_env(), timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_info_explains_every_backend_and_the_active_one(detected):
    proc = vmm_core_cli("info")
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "VMM_CORE_BACKEND=(unset)" in out

    lines = {}
    for name in BUILTIN:
        found = [ln for ln in out.splitlines()
                 if re.match(rf"\s+{name}\s+(usable|unusable)\b", ln)]
        assert len(found) == 1, f"info must have one line for {name}:\n{out}"
        lines[name] = found[0]
        usable = name in detected
        assert (" usable" in found[0]) == usable, found[0]
        reason = found[0].split("):", 1)[1].strip()
        assert reason, f"{name}: a reason must follow the state: {found[0]}"
    if "cuda" not in detected:
        assert "libcuda" in lines["cuda"], lines["cuda"]
    for name in ("ascend", "mlu"):
        if name not in detected:
            assert "not found" in lines[name] and "install" in lines[name], lines[name]

    if detected != ["host"]:
        pytest.skip(f"an accelerator is usable here ({detected}); host is not active")
    active = [ln for ln in out.splitlines() if ln.startswith("active:")]
    assert len(active) == 1 and active[0].startswith("active: host ("), active
    assert f"granularity {mmap.PAGESIZE} B" in out


def test_info_with_forced_host_says_so():
    proc = vmm_core_cli("info", VMM_CORE_BACKEND="host")
    _no_traceback(proc)
    assert proc.returncode == 0
    assert "active: host (forced by VMM_CORE_BACKEND=host)" in proc.stdout


@pytest.mark.parametrize("command", [["info"], ["bench", "--sizes", "1,2"]])
def test_unknown_backend_is_a_one_line_error_listing_choices(command):
    proc = vmm_core_cli(*command, VMM_CORE_BACKEND="nonexistent")
    _no_traceback(proc)
    assert proc.returncode != 0
    errors = [ln for ln in (proc.stdout + proc.stderr).splitlines()
              if "no vmm_core backend named 'nonexistent'" in ln]
    assert len(errors) == 1, proc.stdout + proc.stderr
    choices = errors[0].split("registered backends:", 1)[1]
    for name in BUILTIN:
        assert name in choices
    if command[0] == "bench":  # nothing ran, so the error is the whole output
        assert proc.stdout == ""
        assert proc.stderr.strip() == errors[0]
        assert errors[0].startswith("vmm-core: error: ")


def test_bench_on_host_measures_max_not_sum(tmp_path):
    sizes = [1, 2, 4, 8, 16, 32]
    out_json = tmp_path / "bench.json"
    proc = vmm_core_cli("bench", "--sizes", ",".join(map(str, sizes)),
                        "--orders", "ascending,random", "--json", str(out_json),
                        VMM_CORE_BACKEND="host")
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out_json.read_text())
    assert result["backend"] == "host" and result["ok"] is True
    rows = result["rows"]
    assert [r["order"] for r in rows] == ["ascending", "random"]

    page = mmap.PAGESIZE
    sets = [sum(-(-b // page) * page for b in working_set(t)) for t in sizes]
    for r in rows:
        assert r["aliasing_verified"] is True
        assert r["shapes"] == len(sizes) and r["virtual_spaces"] == len(sizes)
        assert r["largest_working_set_bytes"] == max(sets)
        assert r["sum_of_working_sets_bytes"] == sum(sets)
        # measured (memfd sizes): one working set of physical memory, not the sum
        assert r["physical_bytes"] == r["largest_working_set_bytes"]
        assert r["sum_of_working_sets_bytes"] > r["physical_bytes"]
        assert r["ratio_to_largest"] == pytest.approx(
            r["physical_bytes"] / r["largest_working_set_bytes"])
        assert r["ratio_sum_to_largest"] == pytest.approx(
            r["sum_of_working_sets_bytes"] / r["largest_working_set_bytes"])
        assert r["handles"] >= 1

    # the table shows the same measurement
    table = proc.stdout.splitlines()
    assert any(ln.startswith("order") and "phys/max" in ln for ln in table), proc.stdout
    for r in rows:
        row = [ln for ln in table if ln.split()[:1] == [r["order"]]]
        assert len(row) == 1, proc.stdout
        cols = row[0].split()
        assert int(cols[1]) == r["shapes"]
        assert cols[2] == f"{r['physical_bytes'] / 2**20:.1f}"
        assert cols[4] == f"{r['sum_of_working_sets_bytes'] / 2**20:.1f}"
        assert cols[-1] == "True"
    assert f"wrote {out_json}" in proc.stdout


def test_bench_requesting_an_unusable_backend_fails_cleanly(detected):
    if "cuda" in detected:
        pytest.skip("cuda is usable here")
    proc = vmm_core_cli("bench", "--backend", "cuda", "--sizes", "1")
    _no_traceback(proc)
    assert proc.returncode != 0
    assert proc.stderr.startswith("vmm-core: error: ") and "libcuda" in proc.stderr
