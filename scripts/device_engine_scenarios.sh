#!/usr/bin/env bash
# Every engine-runner scenario on the Llama-3-8B shape (random init, bf16) on one GPU,
# each run's JSON, PNG and log into ${OUT:-./out}.
#
#   bash scripts/device_engine_scenarios.sh                 # the parts below, in order
#   PARTS="piecewise ondemand" bash scripts/device_engine_scenarios.sh
#   LAYERS=8 SIZES=1,2,4,8,16,32,64 bash scripts/device_engine_scenarios.sh   # shorter
#   PARTS=executables bash scripts/device_engine_scenarios.sh   # the executables policies
#
# Parts: piecewise (vmm, vllm in ascending and random order), piecewise-keep (keep,
# vmm-keep ascending), ondemand (sglang, vmm-keep, vllm, vmm), whole (sglang and vmm-keep,
# descending and ascending), record-stream (16 layers x 64 MiB, flag off/on, torch and
# GraphPool), executables (two bench runs, piecewise then families, each printing its
# tables and target lines when it ends: vllm and vmm in random order, vmm under each
# policy of EXECUTABLES, default
# "all,budget:25%,budget:25%+ahead,budget:25%+ahead+hint,budget:25%+share+ahead+hint" (the
# budget served inline too, so each "ahead" line compares preparing ahead with it in one
# run, and sharing by update beside the same policy without it);
# each configuration replays the traces of TRACES, default "uniform,zipf,drift", of
# TRACE_STEPS steps each, default 100: graph memory after each trace against vLLM's
# discipline, step time against every executable resident, misses and preparations
# ahead, sleep and the first replays after the wake; each run at most EXEC_TIMEOUT,
# default 480 s, or what is left of DEADLINE), families (vmm, vllm; random).  Not in the default list: space (whole graphs: sglang,
# vmm-keep and the vmm-keep-seed experiment, descending and random; the floor's record
# carries every size captured alone into a fresh pool, each vmm record every space's
# bytes and segments) and space-ondemand (vmm and vmm-seed): which key's space sets the
# physical pool, whether it equals torch's own fresh pool for that size, and whether
# seeding each new space with the largest space's segments closes the gap to SGLang.
#
# Time: a run keeps to DEADLINE.  Each child (one configuration) builds the model
# (about 18 GiB with the cache) and, for piecewise, captures 51 x 33 = 1683 graphs.  The
# children took 20-40 s each on the H100 (2026-11-23): piecewise 5, piecewise-keep 3,
# ondemand 5, whole 5, families 3 (1734 graphs each), record-stream 4; executables 10 (five
# a shape: the floor, vllm and vmm under each of the three policies; each also replays
# three traces of TRACE_STEPS steps and sleeps and wakes: estimated 7-8.5 minutes, the ten
# children of the 2026-11-25 run with one trace of 200 steps took 438 s in all): about
# 15-25 minutes in all, more than one run of this script, which keeps to DEADLINE s
# (default 570) from its start: a part starts only while at least MIN_START s (default
# 120) are left, runs at most PART_TIMEOUT s (default 300) or what is left, and the last
# line names the parts for the next run.  Every line
# is stamped with the time and each configuration prints a line when it ends, so the logs
# give each child's duration even of a run that was cut; each finished configuration's
# record is also appended to NAME.records.jsonl at once.  Suggested runs:
# PARTS="piecewise piecewise-keep ondemand", then PARTS="whole record-stream families",
# then PARTS=executables, then what the last line names.
set -o pipefail
OUT=${OUT:-./out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
LAYERS=${LAYERS:-32}
SIZES=${SIZES:-}
PARTS=${PARTS:-"piecewise piecewise-keep ondemand whole record-stream families executables"}
PART_TIMEOUT=${PART_TIMEOUT:-300}
DEADLINE=${DEADLINE:-570}
MIN_START=${MIN_START:-120}
EXECUTABLES=${EXECUTABLES:-"all,budget:25%,budget:25%+ahead,budget:25%+ahead+hint,budget:25%+share+ahead+hint"}
EXEC_TIMEOUT=${EXEC_TIMEOUT:-480}
TRACE_STEPS=${TRACE_STEPS:-100}
TRACES=${TRACES:-"uniform,zipf,drift"}
bash scripts/device_install.sh "$OUT/install.log" || exit 1
# facts the runs depend on, in the first seconds (each line says what it checked)
python3 - <<'PY' 2>&1 | tee "$OUT/versions.log"
import ctypes
import importlib

import torch

def fact(what, fn):
    try:
        print(f"{what}: {fn()}")
    except Exception as exc:  # a fact that fails is itself the fact
        print(f"{what}: FAILED {type(exc).__name__}: {exc}")

fact("torch", lambda: f"{torch.__version__}, CUDA {torch.version.cuda}, "
                      f"{torch.cuda.get_device_name(0)}")
for name in ("transformers", "numpy", "cuda.bindings", "torch_memory_saver"):
    fact(name, lambda name=name: getattr(importlib.import_module(name), "__version__", "?"))
fact("CUDAGraph(keep_graph=True)", lambda: type(torch.cuda.CUDAGraph(keep_graph=True)).__name__)
fact("torch._C._accelerator_setAllocatorSettings takes graph_capture_record_stream_reuse",
     lambda: torch._C._accelerator_setAllocatorSettings(
         "graph_capture_record_stream_reuse:False") or "yes")
fact("libcuda cuGraphInstantiateWithFlags/Launch/ExecDestroy/ExecUpdate_v2",
     lambda: [bool(getattr(ctypes.CDLL("libcuda.so.1"), n)) for n in
              ("cuGraphInstantiateWithFlags", "cuGraphLaunch", "cuGraphExecDestroy",
               "cuGraphExecUpdate_v2")])

def weak_view():  # the vllm and vmm rows rely on it: same address, the block not held
    from vmm_core import weak_ref_tensors

    t = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    w = weak_ref_tensors(t)
    same = w.data_ptr() == t.data_ptr() and bool(torch.equal(w, t))
    held = torch.cuda.memory_allocated()
    del t
    return f"same address and values {same}, the block freed with the tensor " \
           f"{torch.cuda.memory_allocated() < held}"

def weak_view_in_capture():  # vLLM's last piece: the view is made inside the capture
    from vmm_core import weak_ref_tensors

    g, x = torch.cuda.CUDAGraph(), torch.ones(1024, device="cuda")
    with torch.cuda.graph(g):
        out = weak_ref_tensors(x * 2)
    x.fill_(3)
    g.replay()
    torch.cuda.synchronize()
    return f"replay wrote through it {bool((out == 6).all())}"

fact("weak_ref_tensors on cuda", weak_view)
fact("weak_ref_tensors inside torch.cuda.graph", weak_view_in_capture)
PY
common=(--backend cuda --model llama8b --layers "$LAYERS")
[ -n "$SIZES" ] && common+=(--sizes "$SIZES")
rc=0
left_parts=()
stamp() { while IFS= read -r line; do printf '%(%H:%M:%S)T %s\n' -1 "$line"; done; }
run() {  # run PART ARGS...: one bench call, its JSON, PNG and log (named after the part)
    local name=$1; shift
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt "$MIN_START" ]; then
        echo "== $name: not started, ${left} s left of DEADLINE=${DEADLINE}" \
            | tee "$OUT/$name.log"
        left_parts+=("$name")
        rc=1
        return
    fi
    local limit=$((left < PART_TIMEOUT ? left : PART_TIMEOUT))
    local t0=$SECONDS
    echo "== $name (at most ${limit} s): python3 -m vmm_core.cli bench ${common[*]} $*" \
        | stamp | tee "$OUT/$name.log"
    rm -f "$OUT/$name.records.jsonl"
    timeout "$limit" python3 -m vmm_core.cli bench "${common[@]}" "$@" \
        --json "$OUT/$name.json" --plot "$OUT/$name.png" 2>&1 | stamp | tee -a "$OUT/$name.log"
    local status=${PIPESTATUS[0]}
    [ "$status" = 124 ] && echo "== $name: stopped by its ${limit} s timeout; finished" \
        "configurations are in $name.records.jsonl" | stamp | tee -a "$OUT/$name.log"
    echo "== $name: exit $status after $((SECONDS - t0)) s" | stamp | tee -a "$OUT/$name.log"
    [ "$status" = 0 ] || rc=1
}
for part in $PARTS; do
    case $part in
        piecewise) run piecewise --scenario piecewise --strategies vmm,vllm \
                       --orders ascending,random ;;
        piecewise-keep) run piecewise-keep --scenario piecewise --strategies keep,vmm-keep \
                            --orders ascending ;;
        ondemand) run ondemand --scenario ondemand --strategies sglang,vmm-keep,vllm,vmm ;;
        whole) run whole --scenario whole --strategies sglang,vmm-keep \
                   --orders descending,ascending ;;
        record-stream)  # its own shape: --layers is the number of 64 MiB temporaries
            common_saved=("${common[@]}")
            common=(--backend cuda --layers 16 --sizes 64)
            run record-stream --scenario record-stream
            common=("${common_saved[@]}") ;;
        executables)  # its own timeout: ten children, about 7-8.5 minutes on an H100;
            # piecewise, then on into executables-families (the part a cut run names)
            # first, seconds: one launch of the pool's against torch's replay()
            timeout 60 python3 scripts/probe_launch_path.py 2>&1 | stamp \
                | tee "$OUT/launch_path.log"
            # then, seconds: what a step pays for executables updated before it or beside
            # it, the device's share and the host's apart
            timeout 90 python3 scripts/probe_exec_step.py 2>&1 | stamp \
                | tee "$OUT/exec_step.log"
            part_timeout_saved=$PART_TIMEOUT
            PART_TIMEOUT=$EXEC_TIMEOUT
            run executables --scenario piecewise --strategies vllm,vmm --orders random \
                --executables "$EXECUTABLES" --trace-steps "$TRACE_STEPS" --trace "$TRACES"
            PART_TIMEOUT=$part_timeout_saved ;&
        executables-families)
            part_timeout_saved=$PART_TIMEOUT
            PART_TIMEOUT=$EXEC_TIMEOUT
            run executables-families --scenario families --strategies vllm,vmm \
                --orders random --executables "$EXECUTABLES" --trace-steps "$TRACE_STEPS" \
                --trace "$TRACES"
            PART_TIMEOUT=$part_timeout_saved ;;
        families) run families --scenario families --strategies vmm,vllm --orders random ;;
        space) run space --scenario whole --strategies sglang,vmm-keep,vmm-keep-seed \
                   --orders descending,random ;;
        space-ondemand) run space-ondemand --scenario ondemand --strategies vmm,vmm-seed ;;
        *) echo "unknown part $part" >&2; rc=2 ;;
    esac
done
if [ ${#left_parts[@]} -gt 0 ]; then
    echo "not run for lack of time: ${left_parts[*]}; next run:" \
         "PARTS=\"${left_parts[*]}\" bash scripts/device_engine_scenarios.sh" | stamp
fi
echo "done after ${SECONDS} s" | stamp
exit $rc
