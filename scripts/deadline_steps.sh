# Sourced by the device scripts that run their steps against one deadline
# (device_distributed.sh, device_tms.sh); not a command of its own.  They set DEADLINE
# (seconds for the whole script), MIN_START (the least a step starts with), STEP (the
# steps asked for) and OUT (the folder of the logs) first.
#   say TEXT                     one line, with the time and the seconds since the start
#   wanted NAME                  whether STEP names the step
#   step NAME CAP LOG COMMAND... run COMMAND within min(CAP, time left of DEADLINE) into
#                                $OUT/LOG, or say why it was not started; sets last_rc,
#                                failed=1 on a non-zero exit, and adds NAME=rc:seconds
#                                (124: timed out) to summary
summary=""
failed=0
last_rc=0
say() { echo "[$(date +%H:%M:%S) +${SECONDS}s] $*"; }
wanted() { case " $STEP " in *" $1 "*) return 0 ;; esac; return 1; }
step() {
    local name=$1 cap=$2 log=$3; shift 3
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt "$MIN_START" ]; then
        say "$name: not started, ${left} s left of DEADLINE=$DEADLINE; run: $*" | tee "$OUT/$log"
        summary="$summary $name=skipped"; return 0
    fi
    [ "$cap" -gt "$left" ] && cap=$left
    say "$name (at most $cap s): $*"
    local t0=$SECONDS
    timeout "$cap" "$@" 2>&1 | tee "$OUT/$log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" = 124 ] && say "$name: stopped by its $cap s timeout" | tee -a "$OUT/$log"
    [ "$rc" = 0 ] || failed=1
    last_rc=$rc
    summary="$summary $name=${rc}:$((SECONDS - t0))s"
}
