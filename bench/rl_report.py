"""The RL scenario's verdict, table and plot are read off its children's records alone,
so the one-GPU comparison and the torchrun group (:mod:`.rl_group`) judge and print them
the same way, and none of it needs the loop or a device.
"""

from __future__ import annotations

from typing import Any

from . import report
from .group_run import GIB

# its functions are the RL scenario's own (:mod:`.rl` and :mod:`.rl_group` call them)
__all__ = ["TARGET_PLUGIN_SPEEDUP", "TARGET_PLUGIN_WAKE", "ROUNDS"]


def _ok(record) -> bool:
    return "error" not in record and not record["wrong_before_sleep"] and all(
        r["first_replay_ok"] and not r["wrong_sizes"] and r["train_ok"]
        for r in record["steps"])


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def _summarize(records, limit) -> dict:
    """Per strategy: round 1 and the mean of rounds 2..N, with the weights' copy rate
    against the pinned limit (vmm: rounds 2..N are the target of >= 90%)."""
    out = {}
    for r in records:
        if "error" in r:
            out[r["strategy"]] = {"error": r["error"][-300:]}
            continue
        steps = r["steps"]
        parts = {"round 1": steps[:1], "rounds 2..N": steps[1:]}
        entry: dict[str, Any] = {}
        for label, chosen in parts.items():
            if not chosen:
                continue
            e = {key: _mean([s[key] for s in chosen])
                 for key in ("freed_bytes", "sleep_s", "wake_s", "first_replay_s",
                             "host_bytes_awake", "recaptured_graphs", "step_s")}
            own = r.get("pinned_limit_gib_s") or limit  # measured in its own process
            if own and e["sleep_s"] and e["wake_s"]:
                # the bytes this strategy copies (vmm_core's engines: what a sleep copied)
                gib = (r.get("offloaded_bytes") or r["weight_bytes"]) / GIB
                e["sleep_pct_of_limit"] = gib / e["sleep_s"] / own[0]
                e["wake_pct_of_limit"] = gib / e["wake_s"] / own[1]
            entry[label] = e
        entry["correct"] = _ok(r)
        out[r["strategy"]] = entry
    return out


#: the vLLM plugin's target against vLLM's own allocator in the RL step: every round's
#: sleep (round 1, where vLLM pins fresh host memory, and rounds 2..N) this many times
#: faster, every wake at most TARGET_PLUGIN_WAKE of vLLM's (both wake at the pinned copy
#: limit, where a few milliseconds are noise)
TARGET_PLUGIN_SPEEDUP = 2.5
TARGET_PLUGIN_WAKE = 1.10
ROUNDS = ("round 1", "rounds 2..N")


def _targets(summary) -> dict:
    """The vllm-plugin strategy against vllm (vLLM's own allocator), when both ran and
    replayed correctly: the sleep TARGET_PLUGIN_SPEEDUP times faster in round 1 and in
    rounds 2..N (means of the steps), the wake within TARGET_PLUGIN_WAKE in both."""
    plugin, vllm = summary.get("vllm-plugin", {}), summary.get("vllm", {})
    if any(r not in plugin or r not in vllm for r in ROUNDS):
        return {}
    speedups = {r: vllm[r]["sleep_s"] / plugin[r]["sleep_s"] for r in ROUNDS}
    wake_ratio = max(plugin[r]["wake_s"] / vllm[r]["wake_s"] for r in ROUNDS)
    return {"vllm-plugin vs vllm": {
        "sleep_speedup_round_1": speedups["round 1"],
        "sleep_speedup": speedups["rounds 2..N"], "wake_ratio": wake_ratio,
        "target": TARGET_PLUGIN_SPEEDUP, "wake_target": TARGET_PLUGIN_WAKE,
        "met": min(speedups.values()) >= TARGET_PLUGIN_SPEEDUP
        and wake_ratio <= TARGET_PLUGIN_WAKE and plugin["correct"] and vllm["correct"]}}


_HEADER = (f"  {'strategy':11s} {'step':>4s} {'freed GiB':>9s} {'sleep ms':>9s} "
           f"{'wake ms':>9s} {'1st replay ms':>13s} {'host GiB awake':>14s} "
           f"{'recaptures':>10s} wrong")


def _fmt(value, scale=1.0, spec=".1f") -> str:
    return "?" if value is None else format(value * scale, spec)


def _print(records, summary, first, limit, targets=None) -> None:
    print(f"\nrl: {first.get('model_description')}; {first.get('device')}, torch "
          f"{first.get('torch')}")
    if first:
        print(f"weights {first['weight_bytes'] / GIB:.2f} GiB of tensors (offloaded), KV "
              f"cache {first['kv_bytes'] / GIB:.2f} GiB and graph memory discarded (vmm)")
    for r in records:
        if "error" not in r and r.get("offloaded_bytes"):
            print(f"  {r['strategy']}: a sleep copies {r['offloaded_bytes'] / GIB:.2f} GiB "
                  f"to the host")
    if limit:
        print(f"pinned copy limit measured in this run: {limit[0]:.1f} / {limit[1]:.1f} GiB/s")
    print(_HEADER)
    for r in records:
        for line in _rows(r):
            print(line)
    print("\nround 1 / mean of rounds 2..N:")
    for strategy, entry in summary.items():
        if "error" in entry:
            continue
        for label in ("round 1", "rounds 2..N"):
            e = entry.get(label)
            if e is None:
                continue
            pct = ""
            if "sleep_pct_of_limit" in e:
                pct = (f" (copies at {e['sleep_pct_of_limit']:.0%} / "
                       f"{e['wake_pct_of_limit']:.0%} of the limit)")
            print(f"  {strategy:11s} {label:12s}: freed {_fmt(e['freed_bytes'], 1 / GIB, '.2f')}"
                  f" GiB, sleep {_fmt(e['sleep_s'], 1e3)} ms, wake {_fmt(e['wake_s'], 1e3)} "
                  f"ms, first replay {_fmt(e['first_replay_s'], 1e3)} ms, recaptures "
                  f"{_fmt(e['recaptured_graphs'], 1, '.0f')}{pct}")
        print(f"  {strategy:11s} every replay correct: {entry['correct']}")
    for r in records:
        graphs = [st for st in r.get("steps", ()) if "graph_memory_asleep" in st]
        if graphs and "error" not in r:
            awake, asleep = graphs[-1]["graph_memory_awake"], graphs[-1]["graph_memory_asleep"]
            print(f"  {r['strategy']}: graph memory {awake['device_bytes'] / 2**20:.1f} MiB "
                  f"on the device awake; asleep {asleep['device_bytes'] / 2**20:.1f} MiB on "
                  f"the device, {asleep['host_bytes'] / 2**20:.1f} MiB on the host (step "
                  f"{graphs[-1]['step']})")
    for name, t in (targets or {}).items():
        print(f"target {name} (every round's sleep >= {t['target']:g}x faster, every wake "
              f"<= {t['wake_target']:g}x the time): sleep {t['sleep_speedup_round_1']:.2f}x "
              f"faster in round 1, {t['sleep_speedup']:.2f}x in rounds 2..N, wake at most "
              f"{t['wake_ratio']:.2f}x the time: {'met' if t['met'] else 'NOT met'}")


def _rows(r, prefix: str = "") -> list[str]:
    """One strategy's steps as rows of the table (freed GiB, sleep, wake, first replay
    ms, host GiB held awake, recaptures, wrong sizes)."""
    if "error" in r:
        return [f"{prefix}  {r['strategy']:11s} FAILED: {r['error'][-200:]}"]
    return [f"{prefix}  {r['strategy']:11s} {s['step']:4d} {s['freed_bytes'] / GIB:9.2f} "
            f"{s['sleep_s'] * 1e3:9.1f} {s['wake_s'] * 1e3:9.1f} "
            f"{s['first_replay_s'] * 1e3:13.1f} "
            f"{_fmt(s['host_bytes_awake'], 1 / GIB, '.2f'):>14s} "
            f"{s['recaptured_graphs']:10d} {len(s['wrong_sizes'])}" for s in r["steps"]]


def _plot(records, path: str, title: str) -> bool:
    """Two panels: device memory freed by each sleep, and step time (sleep + wake +
    first replay), per step and strategy.  False without matplotlib."""
    plt = report.pyplot()
    if plt is None:
        return False
    ok = [r for r in records if "error" not in r]
    fig, (freed, step) = plt.subplots(1, 2, figsize=(13, 5))
    for r in ok:
        xs = [s["step"] for s in r["steps"]]
        freed.plot(xs, [s["freed_bytes"] / GIB for s in r["steps"]], marker="o",
                   label=r["strategy"])
        step.plot(xs, [s["step_s"] * 1e3 for s in r["steps"]], marker="o",
                  label=r["strategy"])
    freed.set_xlabel("step")
    freed.set_ylabel("device memory freed by sleep (GiB)")
    step.set_xlabel("step")
    step.set_ylabel("sleep + wake + first replay (ms)")
    step.set_yscale("log")
    for ax in (freed, step):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    report.save_figure(fig, path, dpi=120)
    return True
