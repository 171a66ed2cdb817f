"""``vmm-core info`` and ``vmm-core bench``, run as a user runs them: in a subprocess."""

from __future__ import annotations

import json
import mmap
import os
import re
import subprocess
import sys

import pytest

from vmm_bench.host_demo import working_set

BUILTIN = ("ascend", "cuda", "host", "mlu")


def _env(**extra) -> dict:
    # tests/emulated points VMM_CORE_*_LIB at emulated drivers for the rest of the session;
    # a user's shell has none of that.
    env = {k: v for k, v in os.environ.items() if not k.startswith("VMM_CORE_")}
    env.update(extra)
    return env


def vmm_core_cli(*args, timeout=300, cwd=None, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vmm_core.cli", *args], capture_output=True,
                          text=True, env=_env(**env), timeout=timeout, cwd=cwd)


def _no_traceback(proc) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def detected() -> list[str]:
    """available_backends() as a fresh process with the same environment sees it."""
    proc = subprocess.run([sys.executable, "-c",
                           "import json, vmm_core; "
                           "print(json.dumps(vmm_core.available_backends()))"],
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


def test_info_and_bench_give_one_exit_status_per_kind_of_backend_failure(detected):
    """An unknown name was 2 from info and 6 from bench."""
    for command in (["info"], ["bench", "--sizes", "1,2"]):
        proc = vmm_core_cli(*command, VMM_CORE_BACKEND="nonexistent")
        assert proc.returncode == 2, (command, proc.stderr)  # a bad value: nothing ran
        if "cuda" not in detected:
            proc = vmm_core_cli(*command, VMM_CORE_BACKEND="cuda")
            assert proc.returncode == 6, (command, proc.stderr)  # cannot run here
            assert "libcuda" in proc.stderr


def test_python_dash_m_vmm_core_is_the_cli():
    proc = subprocess.run([sys.executable, "-m", "vmm_core", "info"], capture_output=True,
                          text=True, env=_env(VMM_CORE_BACKEND="host"), timeout=120)
    assert proc.returncode == 0, proc.stderr
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

    # the demo ends by saying what this CPU run proves and what it cannot, measured numbers
    held = max(r["physical_bytes"] for r in rows) / 2**20
    proves = (f"What this CPU run proves: {len(sizes)} virtual ranges mapped the same "
              f"{held:.1f} MiB of physical pages in every order (a write through one was read "
              f"back through all of them), the allocator's bookkeeping held 1.00x the largest "
              f"working set, and sleep/wake gave every byte back (offload) and every page back "
              f"(discard).")
    assert result["summary"].splitlines()[0] == proves
    assert "graph memory" in result["summary"] and "GPU" in result["summary"]
    assert table[-3:] == result["summary"].splitlines() + [f"wrote {out_json}"]
    for r in rows:
        assert r["sleep_wake_verified"] is True
        assert r["sleep_wake"]["asleep_offload_bytes"] == 0
        assert r["sleep_wake"]["asleep_discard_bytes"] == 0
    # every column of the table is explained under it
    for column in ("shapes", "physical MiB", "max set MiB", "sum MiB", "handles", "switch ms",
                   "aliased", "sleep/wake"):
        assert any(ln.startswith(f"  {column} ") for ln in table), column
    assert proc.stderr == ""  # not a terminal: no progress bar


def test_bench_requesting_an_unusable_backend_fails_cleanly(detected):
    if "cuda" in detected:
        pytest.skip("cuda is usable here")
    proc = vmm_core_cli("bench", "--backend", "cuda", "--sizes", "1")
    _no_traceback(proc)
    assert proc.returncode != 0
    assert proc.stderr.startswith("vmm-core: error: ") and "libcuda" in proc.stderr


FACTORY = """
import torch

def make(*, device, dtype, max_batch, seed):
    w = torch.randn(16, 16, generator=torch.Generator().manual_seed(seed)).to(device, dtype)
    return (lambda x: torch.relu(x @ w)), torch.zeros(max_batch, 16, device=device, dtype=dtype)

def bad_return(device, max_batch):
    return torch.zeros(max_batch, 16)
"""


def test_bench_on_host_checks_a_factory_before_device_time_is_spent(tmp_path):
    (tmp_path / "my_model.py").write_text(FACTORY)
    out_json = tmp_path / "bench.json"
    proc = vmm_core_cli("bench", "--model", "my_model:make", "--sizes", "1,2,4",
                        "--orders", "random", "--json", str(out_json), cwd=tmp_path,
                        VMM_CORE_BACKEND="host")
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert ("--model my_model:make: built on the CPU in float32 and run once eagerly at "
            "batch 4: factory my_model:make (inputs [4, 16] float32), outputs [4, 16]. Its "
            "graphs are captured only on a device backend") in proc.stdout
    result = json.loads(out_json.read_text())
    assert result["model"]["outputs"] == [[4, 16]]
    assert [r["order"] for r in result["rows"]] == ["random"]


def test_bench_on_host_resolves_but_does_not_build_the_builtin_models():
    import importlib.util

    if importlib.util.find_spec("transformers") is None:  # its absence: the test below
        pytest.skip("transformers is not installed (the 'bench' extra)")
    proc = vmm_core_cli("bench", "--model", "llama", "--sizes", "1,2", "--orders",
                        "ascending", VMM_CORE_BACKEND="host")
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "--model llama: a built-in model; its graphs are captured only on a device " \
           "backend" in proc.stdout


@pytest.mark.parametrize("args, message", [
    (["--model", "my_model"], "--model 'my_model': expected a built-in model ('mlp', "
                              "'llama', 'llama8b') or 'package.module:factory'"),
    (["--model", "not_there:make"], "--model 'not_there:make': importing 'not_there' failed "
                                    "with ModuleNotFoundError"),
    (["--model", "my_model:bad_return"], "--model 'my_model:bad_return': the factory must "
                                         "return (fn, example_inputs); it returned a Tensor"),
])
def test_bench_model_mistakes_are_one_line_errors(tmp_path, args, message):
    (tmp_path / "my_model.py").write_text(FACTORY)
    proc = vmm_core_cli("bench", *args, "--sizes", "1,2", cwd=tmp_path,
                        VMM_CORE_BACKEND="host")
    _no_traceback(proc)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = _without_library_warnings(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("vmm-core: error: "), proc.stderr
    assert message in lines[0]


def _without_library_warnings(stderr: str) -> list[str]:
    """stderr lines minus Python warnings other packages print (torch without numpy warns
    'Failed to initialize NumPy' with its source line): not ours to keep to one line."""
    lines, skip_source = [], False
    for line in stderr.strip().splitlines():
        if re.match(r"^\S+:\d+: \w*Warning: ", line):
            skip_source = True
            continue
        if skip_source and line.startswith("  "):
            skip_source = False
            continue
        skip_source = False
        lines.append(line)
    return lines


def _run_on_a_terminal(*args) -> tuple[int, str]:
    """Run the CLI with stderr on a pseudo-terminal (as a user's shell has it)."""
    import pty
    import threading

    master, slave = pty.openpty()
    chunks = []

    def read():
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    proc = subprocess.run([sys.executable, "-m", "vmm_core.cli", *args], stdout=subprocess.PIPE,
                          stderr=slave, env=_env(VMM_CORE_BACKEND="host", TERM="xterm"),
                          timeout=300)
    os.close(slave)
    reader.join(timeout=10)
    os.close(master)
    return proc.returncode, b"".join(chunks).decode(errors="replace")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs a Linux pty")
def test_bench_draws_a_progress_bar_on_a_terminal_unless_quiet():
    pytest.importorskip("tqdm")
    args = ("bench", "--sizes", "1,2,4,8", "--orders", "ascending,random")
    rc, terminal = _run_on_a_terminal(*args)
    assert rc == 0
    assert "host ascending" in terminal and "host random" in terminal, terminal
    assert "4/4" in terminal and "shape" in terminal, terminal
    rc, terminal = _run_on_a_terminal(*args, "--quiet")
    assert rc == 0
    assert terminal == ""


# ---------------------------------------------------------------- checked before any work
@pytest.mark.parametrize("args, code, message", [
    (["--scenario", "bogus"], 2, "--scenario bogus: unknown; choose from decode, piecewise"),
    (["--scenario", "decode,piecewise"], 2, "run them in separate calls"),
    (["--strategies", "bogus"], 2, "argument --strategies: bogus: choose from "),
    (["--sleep-rows", "bogus"], 2, "argument --sleep-rows: bogus: choose from vmm,grid,"),
    (["--modes", "vmm,bogus"], 2, "argument --modes: bogus: choose from "),
    (["--sleep-gib=-5,abc"], 2, "argument --sleep-gib: '-5,abc': comma-separated sizes in GiB"),
    (["--sleep-gib", "0"], 2, "argument --sleep-gib: '0'"),
    (["--sleep-only", "--sleep-gib", "1e-12"], 2, f"--sleep-gib 1e-12: below one page of the "
     f"host backend ({mmap.PAGESIZE} bytes, its granularity); the least is "
     f"{mmap.PAGESIZE / 2**30!r}"),
    (["--sleep", "--sleep-gib", "0.5,100000"], 2, "--sleep-gib 100000: the sleep benchmark "
     "holds twice the largest size in host memory, and this machine has "),
    (["--layers", "-3"], 2, "argument --layers: '-3': an integer >= 1"),
    (["--hidden", "0"], 2, "argument --hidden: '0': an integer >= 1"),
    (["--sizes", "0"], 2, "argument --sizes: '0': comma-separated batch sizes >= 1"),
    (["--orders", "sideways"], 2, "argument --orders: sideways: choose from "),
    (["--executables", "all,budget:0"], 2,
     "argument --executables: 'budget:0': the budget must be a count >= 1"),
    (["--executables", "budget:150%"], 2,
     "argument --executables: 'budget:150%': the budget must be a percentage from 1 to 100"),
    (["--executables", "half"], 2, "argument --executables: 'half': not a policy; write all "
                                   "| framework | budget:N"),
    (["--trace-steps", "0"], 2, "argument --trace-steps: '0': an integer >= 1"),
    (["--repeat", "0"], 2, "argument --repeat: '0': an integer >= 1"),
    (["--scenario", "exec-cache"], 2, "--scenario exec-cache: graph executables under a "
                                      "budget or shared by update are GraphPool's own"),
    (["--json", "/nonexistent/dir/out.json"], 4,
     "--json /nonexistent/dir/out.json: directory /nonexistent/dir does not exist"),
    (["--plot", "/nonexistent/dir/out.png"], 4,
     "--plot /nonexistent/dir/out.png: directory /nonexistent/dir does not exist"),
    (["--json", "."], 4, "--json .: is a directory; give a file path"),
    # permissions say yes to root here, yet no file can be made: a real write tells
    (["--json", "/proc/out.json"], 4, "--json /proc/out.json: cannot be created ("),
    (["--plot", "/sys/out.png"], 4, "--plot /sys/out.png: cannot be created ("),
    # opens, yet takes no byte: a byte written and flushed tells
    (["--json", "/dev/full"], 4, "--json /dev/full: cannot be written (No space left on "
                                 "device); choose another path"),
])
def test_bad_values_are_one_line_errors_before_any_work(tmp_path, args, code, message):
    proc = vmm_core_cli("bench", "--sizes", "1,2", *args, cwd=tmp_path, VMM_CORE_BACKEND="host")
    _no_traceback(proc)
    assert proc.returncode == code, proc.stdout + proc.stderr
    assert proc.stdout == "", "nothing may run before the values are checked"
    lines = _without_library_warnings(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("vmm-core: error: "), proc.stderr
    assert message in lines[0]
    assert list(tmp_path.iterdir()) == []


def test_the_output_check_leaves_an_existing_file_and_accepts_a_sink(tmp_path):
    from vmm_bench.cli import _check_writable

    kept = tmp_path / "earlier.json"
    kept.write_text('{"kept": true}')
    _check_writable("--json", str(kept))
    assert kept.read_text() == '{"kept": true}'
    _check_writable("--json", os.devnull)
    _check_writable("--json", str(tmp_path / "new.json"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["earlier.json"]


def test_sizes_beyond_one_virtual_space_name_the_flag_not_an_internal_method():
    proc = vmm_core_cli("bench", "--sizes", "1,200000", VMM_CORE_BACKEND="host")
    _no_traceback(proc)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = _without_library_warnings(proc.stderr)
    assert len(lines) == 1 and lines[0].startswith("vmm-core: error: --sizes 200000: "), lines
    assert "pass --sizes of at most about" in lines[0]
    assert "switch_to_new_virtual_space" not in lines[0] and "reserve_bytes" not in lines[0]
    assert "order" not in proc.stdout  # no shape ran


def test_a_factory_whose_function_raises_is_a_one_line_model_error(tmp_path):
    (tmp_path / "my_model.py").write_text(FACTORY + """
def raising(*, device, dtype, max_batch, seed):
    def fn(x):
        raise RuntimeError("shapes do not match")
    return fn, torch.zeros(max_batch, 16)
""")
    proc = vmm_core_cli("bench", "--model", "my_model:raising", "--sizes", "1,2", cwd=tmp_path,
                        VMM_CORE_BACKEND="host")
    _no_traceback(proc)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    lines = _without_library_warnings(proc.stderr)
    assert lines == ["vmm-core: error: --model 'my_model:raising': the function the factory "
                     "returned raised RuntimeError when run eagerly at batch 2: shapes do not "
                     "match"], proc.stderr


def _cli_without(module: str, *args, cwd=None) -> subprocess.CompletedProcess:
    """The CLI in a process where ``module`` cannot be imported (an extra not installed)."""
    code = (f"import sys; sys.modules[{module!r}] = None; from vmm_core.cli import main; "
            f"sys.exit(main({list(args)!r}))")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_env(VMM_CORE_BACKEND="host"), timeout=300, cwd=cwd)


@pytest.mark.parametrize("module, args, message", [
    ("transformers", ["--model", "llama"], "--model llama needs transformers, which is not "
                                           "installed: pip install 'vmm_core[bench]'"),
    ("transformers", ["--model", "llama8b"], "--model llama8b needs transformers, which is "
                                             "not installed: pip install 'vmm_core[bench]'"),
    ("matplotlib", ["--plot", "out.png"], "--plot out.png needs matplotlib, which is not "
                                          "installed: pip install 'vmm_core[plot]'"),
])
def test_a_missing_extra_is_named_before_any_work(tmp_path, module, args, message):
    proc = _cli_without(module, "bench", "--sizes", "1,2", *args, cwd=tmp_path)
    _no_traceback(proc)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert proc.stdout == ""
    lines = _without_library_warnings(proc.stderr)
    assert len(lines) == 1 and message in lines[0], proc.stderr


def test_the_host_run_draws_the_plot_it_was_asked_for(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "host.png"
    proc = vmm_core_cli("bench", "--sizes", "1,2,4", "--orders", "ascending", "--plot",
                        str(out), VMM_CORE_BACKEND="host")
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"wrote {out}" in proc.stdout


@pytest.mark.parametrize("args, note", [
    (["--modes", "vmm"], "note: --modes: graph pool strategies need device graphs; ignored"),
    (["--scenario", "piecewise", "--strategies", "vmm"],
     "note: --strategies: piecewise strategies need device graphs; ignored here"),
    (["--scenario", "piecewise"], "note: --scenario piecewise: captures device graphs"),
    (["--strategies", "vmm"], "note: --strategies: scenario decode does not use it"),
    (["--executables", "budget:2"], "note: --executables: scenario decode does not use it"),
    (["--scenario", "piecewise", "--executables", "budget:2"],
     "note: --executables: the engine-runner scenarios replay device graphs; ignored here"),
    (["--sleep-gib", "1"], "note: --sleep-gib: used only with --sleep or --sleep-only"),
    (["--sleep-rows", "vmm"], "note: --sleep-rows: used only with --sleep or --sleep-only"),
    (["--scenario", "rl", "--strategies", "tms-compat"],
     "note: --strategies: rl strategies need device graphs; ignored here"),
    (["--sleep-only", "--sleep-gib", "0.01"],
     "note: --sleep-only: sleep/wake bandwidth is measured on a device"),
    (["--sleep", "--sleep-gib", "0.01"], "note: --sleep: sleep/wake bandwidth is measured"),
    (["--layers", "2"], "note: --layers: configure --model, which this run does not build"),
    (["--dtype", "float16"], "note: --dtype: configure --model, which this run does not"),
])
def test_every_flag_the_host_cannot_honour_says_so_in_one_line(args, note):
    proc = vmm_core_cli("bench", "--sizes", "1,2", "--orders", "ascending", *args,
                        VMM_CORE_BACKEND="host")
    _no_traceback(proc)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert len([ln for ln in proc.stdout.splitlines() if ln.startswith(note)]) == 1, \
        proc.stdout


def test_help_has_no_raw_markup_and_explains_every_flag_and_exit_code():
    for command in (["--help"], ["bench", "--help"]):
        proc = vmm_core_cli(*command)
        assert proc.returncode == 0
        assert "``" not in proc.stdout, proc.stdout
        for code in range(7):
            assert re.search(rf"^  {code}  \S", proc.stdout, re.M), (code, proc.stdout)
    help_text = vmm_core_cli("bench", "--help").stdout
    flat = " ".join(help_text.split())
    # the defaults --help gives are the ones a run takes, on a device and on the host
    assert "(default 4,16 on a device, 0.5 on a backend without one)" in flat, flat
    for flag in ("--orders ORDERS", "--seed SEED"):
        line = next(ln for ln in help_text.splitlines() if ln.strip().startswith(flag))
        assert len(line.strip()) > len(flag) + 5, f"{flag} has no help text"
    from vmm_bench.scenarios import SCENARIOS

    for name, scenario in SCENARIOS.items():  # the one list of scenarios
        assert re.search(rf"^  {re.escape(name)}\s+{re.escape(scenario.description[:30])}",
                         help_text, re.M), name


def test_strategies_follow_the_piecewise_list():
    from vmm_bench.cli import bench_spec
    from vmm_bench.peers import DISCIPLINES
    from vmm_core.cli import build_parser

    spec = bench_spec(build_parser().parse_args(["bench", "--scenario", "piecewise"]))
    assert spec.engine.strategies == tuple(DISCIPLINES)
    for name in DISCIPLINES:
        parsed = build_parser().parse_args(["bench", "--strategies", name])
        assert parsed.strategies == name


def test_a_new_scenario_is_one_entry_for_help_checks_and_dispatch(monkeypatch, capsys):
    """What a new benchmark relies on: one table entry, nothing else to edit."""
    import types

    import vmm_core
    from vmm_bench import runner, scenarios
    from vmm_bench.cli import bench_spec
    from vmm_core.cli import build_parser

    ran = []
    module = types.ModuleType("demo_scenario_module")
    module.run = lambda spec, backend: ran.append((spec.scenario, spec.sizes)) or {"ok": True}
    monkeypatch.setitem(sys.modules, "demo_scenario_module", module)
    monkeypatch.setitem(scenarios.SCENARIOS, "demo",
                        scenarios.Scenario("a scenario added in one line",
                                           "demo_scenario_module:run"))
    assert "a scenario added in one line" in build_parser().format_help() + \
        build_parser()._subparsers._group_actions[0].choices["bench"].format_help()
    spec = bench_spec(build_parser().parse_args(["bench", "--scenario", "demo", "--sizes",
                                                 "1,2", "--sleep", "--model", "my:factory"]))
    device = types.SimpleNamespace(graph_ops=lambda i: types.SimpleNamespace(device_type="gpu"),
                                   name="fake")
    monkeypatch.setattr(vmm_core, "select_backend",
                        lambda name: types.SimpleNamespace(backend=device, reason="test"))
    assert runner.run_bench(spec) == {"ok": True}
    assert ran == [("demo", (1, 2))]
    out = capsys.readouterr().out
    assert "note: --sleep: scenario demo does not measure sleep/wake" in out
    assert "note: --model my:factory: scenario demo builds its own model" in out
    # a scenario that declares it takes --model and --sleep gets no such note
    monkeypatch.setitem(scenarios.SCENARIOS, "demo", scenarios.Scenario(
        "a scenario added in one line", "demo_scenario_module:run", uses_model=True,
        uses_sleep=True))
    assert runner.run_bench(spec) == {"ok": True}
    assert "note:" not in capsys.readouterr().out


def test_ranks_checking_one_new_output_path_at_once_all_pass_and_leave_nothing(tmp_path):
    """The ranks of one torchrun check the same ``--json`` path at the same moment: each
    tries a file of its own beside it, so none sees another's trial as the path already
    taken, and the directory holds nothing after."""
    import threading

    from vmm_bench.cli import _check_writable

    path = str(tmp_path / "out.json")
    errors: list = []
    start = threading.Barrier(8)

    def rank():
        start.wait()
        for _ in range(200):
            try:
                _check_writable("--json", path)
            except Exception as error:  # noqa: BLE001 - collected and asserted below
                errors.append(error)
                return

    threads = [threading.Thread(target=rank) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert list(tmp_path.iterdir()) == []
