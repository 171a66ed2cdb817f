#!/usr/bin/env bash
# The scripts here write many files (a log, a JSON, a picture and a records file per
# benchmark part); to fetch one file from the GPU machine instead, end a run with this:
# everything under $OUT becomes one $OUT/all.tgz.
#   bash scripts/device_engine_scenarios.sh; bash scripts/device_pack.sh
OUT=${OUT:-./out}
[ -d "$OUT" ] || exit 0
tmp=$(mktemp /tmp/device_out.XXXXXX.tgz) || exit 1
tar czf "$tmp" -C "$OUT" . && find "$OUT" -mindepth 1 -delete && mv "$tmp" "$OUT/all.tgz" \
    && echo "packed into $OUT/all.tgz ($(du -h "$OUT/all.tgz" | cut -f1))"
