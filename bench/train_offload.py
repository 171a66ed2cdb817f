"""``vmm-core bench --scenario train-offload``: a training step with the whole process in
tagged memory, as RL frameworks (slime, miles, AReaL) run their training processes under
torch_memory_saver's ``TMS_INIT_ENABLE``, against the same step without it.

Each configuration runs in a fresh process started as their launchers start one:

* ``plain``: nothing routed (the reference);
* ``vmm``: ``LD_PRELOAD`` of the library beside vmm_core's torch_memory_saver alias,
  ``TMS_INIT_ENABLE=1``, ``TMS_INIT_ENABLE_CPU_BACKUP=1``;
* ``torch_memory_saver``: the same variables with its own preload library (found as
  its ``utils`` finds it), when the released package is importable.

A child builds a stack of transformer encoder layers (``--layers``, default 8;
``--hidden``, default 2048; ``--heads``, default 16; ``--dtype``, default bfloat16) and
AdamW, runs 3 steps to warm up, then times ``--steps`` steps (default 20; each a
forward, a backward and an optimizer step, synchronized); then pauses and resumes the
whole process twice (``pause()`` / ``resume()`` with no tag, as the launchers' actors
do), timing both and the device memory a pause frees, and checks that every parameter
and the optimizer's state came back bit-exact and that the next step runs.  Target:
``vmm``'s median step within 1.05x of ``plain``'s.
"""

from __future__ import annotations

import os
import statistics
import time

from .children import run_child as run_child_process
from .spec import BenchSpec

__all__ = ["run_train_offload_bench", "run_child", "CONFIGS", "TARGET_STEP_RATIO"]

CONFIGS = ("plain", "vmm", "torch_memory_saver")
TARGET_STEP_RATIO = 1.05
_DEFAULTS = {"layers": 8, "hidden": 2048, "heads": 16}
_BATCH, _SEQ = 8, 512


def _env(config: str) -> dict | str:
    """The child's environment, or why the configuration cannot run here."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("TMS_") and k != "LD_PRELOAD"}
    if config == "plain":
        return env
    if config == "vmm":
        from vmm_core.integrations.torch_memory_saver import preload_path

        alias = os.path.dirname(preload_path())
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != alias)
        env["LD_PRELOAD"] = preload_path()
    else:
        import importlib.util

        spec = importlib.util.find_spec("torch_memory_saver")
        if spec is None or spec.origin is None or "tms_alias" in spec.origin:
            return "torch_memory_saver is not installed here"
        from torch_memory_saver.utils import get_binary_path_from_package

        try:
            env["LD_PRELOAD"] = str(get_binary_path_from_package(
                "torch_memory_saver_hook_mode_preload"))
        except Exception as exc:  # noqa: BLE001 - its own lookup says what is missing
            return f"its preload library was not found: {exc}"
    env.update(TMS_INIT_ENABLE="1", TMS_INIT_ENABLE_CPU_BACKUP="1")
    return env


def run_train_offload_bench(spec: BenchSpec, backend) -> dict:
    records, notes = [], {}
    for config in CONFIGS:
        env = _env(config)
        if isinstance(env, str):
            notes[config] = env
            print(f"  {config}: {env}; skipped", flush=True)
            continue
        extra = ("--steps", str(spec.rl.steps)) if "steps" in spec.given else ()
        argv = spec.child_argv(f"train-offload:{config}", backend.name, model="train",
                               scenario="train-offload", extra=extra)
        record, rc, stderr = run_child_process(argv, env=env)
        if record is None or rc not in (0, 1):
            record = {"config": config, "error": f"child exited {rc}: {stderr[-3000:]}"}
        records.append(record)
        _say(record)
    out = {"kind": "train-offload", "records": records, "notes": notes}
    out["targets"] = _targets(records)
    out["ok"] = all("error" not in r and r.get("restored", True) for r in records) and \
        all(t["met"] for t in out["targets"].values())
    for name, t in out["targets"].items():
        print(f"target {name} (<= {t['target']:g}x): {t['ratio']:.3f}x: "
              f"{'met' if t['met'] else 'NOT met'}")
    return out


def _targets(records: list[dict]) -> dict:
    by = {r["config"]: r for r in records if "error" not in r}
    plain = by.get("plain")
    if plain is None:
        return {}
    out = {}
    for config in ("vmm", "torch_memory_saver"):
        if config in by:
            ratio = by[config]["step_ms_median"] / plain["step_ms_median"]
            out[f"{config} step vs plain"] = {
                "ratio": ratio, "target": TARGET_STEP_RATIO,
                "met": ratio <= TARGET_STEP_RATIO or config != "vmm"}
    return out


def _say(record: dict) -> None:
    if "error" in record:
        print(f"  {record['config']}: failed: {record['error'][-600:]}", flush=True)
        return
    line = (f"  {record['config']:20s} step {record['step_ms_median']:8.2f} ms (median of "
            f"{record['steps']})")
    if record.get("pause_s"):
        line += (f"; pause {1e3 * record['pause_s'][-1]:.0f} ms, resume "
                 f"{1e3 * record['resume_s'][-1]:.0f} ms, freed "
                 f"{record['freed_bytes'] / 2**30:.2f} GiB, every byte back "
                 f"{record['restored']}")
    print(line, flush=True)


# ---------------------------------------------------------------- the child
def run_child(spec: BenchSpec) -> tuple[dict, bool]:
    import torch

    config = spec.child.config.split(":", 1)[1] if spec.child else "plain"
    options = {**_DEFAULTS, **{k: v for k, v in spec.model.options.items() if k in _DEFAULTS}}
    dtype = getattr(torch, spec.model.dtype)
    steps = spec.rl.steps if "steps" in spec.given else 20
    tms = None
    if config != "plain":
        from torch_memory_saver import torch_memory_saver as tms
    torch.manual_seed(spec.seed)
    d = options["hidden"]
    model = torch.nn.Sequential(*[
        torch.nn.TransformerEncoderLayer(d, options["heads"], 4 * d, batch_first=True,
                                         device="cuda", dtype=dtype)
        for _ in range(options["layers"])])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(_BATCH, _SEQ, d, device="cuda", dtype=dtype)

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        loss = model(x).float().square().mean()
        loss.backward()
        opt.step()
        return float(loss)

    for _ in range(3):
        step()
    torch.cuda.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    record = {"config": config, "steps": steps, "layers": options["layers"], "hidden": d,
              "dtype": spec.model.dtype, "torch": torch.__version__,
              "device": torch.cuda.get_device_name(0),
              "step_ms_median": 1e3 * statistics.median(times),
              "step_ms_mean": 1e3 * statistics.mean(times),
              "params_bytes": sum(p.numel() * p.element_size() for p in model.parameters())}
    ok = True
    if tms is not None:
        state = [t.detach().clone() for t in _tensors(model, opt)]
        pauses, resumes, freed = [], [], 0
        for _ in range(2):
            torch.cuda.synchronize()
            free0 = torch.cuda.mem_get_info()[0]
            t0 = time.perf_counter()
            tms.pause()
            t1 = time.perf_counter()
            freed = torch.cuda.mem_get_info()[0] - free0
            tms.resume()
            torch.cuda.synchronize()
            pauses.append(t1 - t0)
            resumes.append(time.perf_counter() - t1)
        restored = all(torch.equal(a, b) for a, b in zip(_tensors(model, opt), state))
        loss = step()
        ok = restored and loss == loss
        record.update(pause_s=pauses, resume_s=resumes, freed_bytes=freed, restored=restored)
    return record, ok


def _tensors(model, opt) -> list:
    import torch

    return [p for p in model.parameters()] + [
        v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
