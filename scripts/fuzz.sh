#!/usr/bin/env bash
# Runs every cargo-fuzz target in fuzz/ for a bounded time each, one after the other, and
# prints a summary: executions run and crashes found per target.
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]     (default 60 s, every target)
#
# Installs cargo-fuzz from crates.io when it is missing. cargo-fuzz passes nightly-only flags
# (-Zsanitizer=address, sanitizer coverage); the stable toolchain accepts them with
# RUSTC_BOOTSTRAP=1, so no nightly toolchain is needed. Corpora grow in fuzz/corpus/<target>
# and crashing inputs land in fuzz/artifacts/<target>/ (both ignored by git); reproduce one
# with `RUSTC_BOOTSTRAP=1 cargo fuzz run --fuzz-dir fuzz <target> <file>`.
#
# Exit status: 0 when every target ran to its time limit without a crash.
set -euo pipefail

secs="${1:-60}"
shift || true
cd "$(dirname "$0")/.."

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "fuzz.sh: installing cargo-fuzz from crates.io" >&2
    cargo install cargo-fuzz --locked
fi

export RUSTC_BOOTSTRAP=1
# Pin the stable toolchain where rustup manages toolchains (a rust-toolchain file or a nightly
# default would otherwise decide).
if command -v rustup >/dev/null 2>&1; then
    export RUSTUP_TOOLCHAIN=stable
fi

if [ "$#" -gt 0 ]; then
    targets=("$@")
else
    mapfile -t targets < <(cargo fuzz list --fuzz-dir fuzz)
fi

# Release build with debug assertions (so integer overflow panics) and AddressSanitizer.
cargo fuzz build --fuzz-dir fuzz --debug-assertions

logdir="fuzz/logs"
mkdir -p "$logdir"
summary=()
failed=0
for t in "${targets[@]}"; do
    mkdir -p "fuzz/corpus/$t"
    log="$logdir/$t.log"
    stamp="$logdir/$t.start"
    touch "$stamp"
    echo "fuzz.sh: $t for ${secs} s" >&2
    extra=()
    asan="${ASAN_OPTIONS:-}"
    case "$t" in
        # The store server serves each connection on its own thread, which is still
        # finishing when an input ends; LeakSanitizer then reports the thread's start-up
        # allocations (its boxed closure, its TLS destructor list) as leaked. Those are freed
        # when the thread exits a moment later, so leak checks are off for this target, both
        # libFuzzer's after each input and LeakSanitizer's at exit.
        store_server)
            extra+=(-detect_leaks=0)
            asan="${asan:+$asan:}detect_leaks=0"
            ;;
    esac
    set +e
    ASAN_OPTIONS="$asan" cargo fuzz run --fuzz-dir fuzz --debug-assertions "$t" "fuzz/corpus/$t" -- \
        -max_total_time="$secs" -print_final_stats=1 -timeout=30 -rss_limit_mb=4096 \
        "${extra[@]}" >"$log" 2>&1
    rc=$?
    set -e
    execs=$(grep -o 'stat::number_of_executed_units: *[0-9]*' "$log" | grep -o '[0-9]*$' | tail -1)
    # Only artifacts of this run count.
    crashes=$(find "fuzz/artifacts/$t" -type f -newer "$stamp" \( -name 'crash-*' \
        -o -name 'leak-*' -o -name 'timeout-*' -o -name 'oom-*' \) 2>/dev/null | wc -l)
    corpus=$(find "fuzz/corpus/$t" -type f | wc -l)
    if [ "$rc" -ne 0 ]; then
        failed=1
        echo "fuzz.sh: $t failed (exit $rc); the end of its log ($log):" >&2
        tail -40 "$log" >&2
    fi
    summary+=("$(printf '%-18s exit %-3s executions %-10s corpus %-6s crash/leak/timeout/oom files %s' \
        "$t" "$rc" "${execs:-?}" "$corpus" "$crashes")")
done

echo
echo "fuzz.sh: ${secs} s per target"
printf '%s\n' "${summary[@]}"
exit "$failed"
