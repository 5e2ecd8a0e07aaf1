#!/usr/bin/env bash
# `make fuzz`: builds each harness in fuzz/ with clang's libFuzzer, AddressSanitizer and UndefinedBehaviorSanitizer
# over the front's own parsers and answer encoders (worker/serve/_front_parse.c, _front_infer.c; llhttp's sources
# from the system, as setup.py takes them), runs each for SECONDS (default 60) from the seeds in fuzz/seeds/ and the
# corpus it grew before (build/fuzz/corpus/, kept between runs), and prints one line per harness: the executions run,
# the coverage reached (libFuzzer's edge counters, "cov", and features, "ft", llhttp's included), the corpus size, and
# the share of the lines and branches of the front's own code it is for (a parser's file less the encoder beside it,
# or the encoder) that the corpus runs (llvm-cov, over a build instrumented for it; FUZZ_COVERAGE=0 leaves that
# out). A crash stops with its input saved under build/fuzz/ and the
# command that reproduces it.
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${1:-60}
LLHTTP_DIR=${LLHTTP_DIR:-/usr/share/llhttp}
LLHTTP_INCLUDE=${LLHTTP_INCLUDE:-/usr/share/include/llhttp}
CC=${FUZZ_CC:-clang}
OUT=build/fuzz
mkdir -p "$OUT"
FLAGS=(-g -O1 -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined -Iworker/serve -I"$LLHTTP_INCLUDE")

# Every harness, in the order run (tests/unit/test_fuzz_harnesses.py checks that each fuzz/*.c is one).
HARNESSES=(http1 infer_body json_answer model_infer model_infer_answer)
PARSE_SOURCES="worker/serve/_front_parse.c $LLHTTP_DIR/llhttp.c $LLHTTP_DIR/api.c $LLHTTP_DIR/http.c"
declare -A SOURCES=(
    [http1]="$PARSE_SOURCES"
    [infer_body]="$PARSE_SOURCES"
    [json_answer]="$PARSE_SOURCES"
    [model_infer]="worker/serve/_front_infer.c"
    [model_infer_answer]="worker/serve/_front_infer.c"
)

# Each harness's own code: its file, then after a ':' the functions of it the harness is for, or after ':!' those it
# is not for (a parser's harness is not for the encoder in its file).
JSON_ANSWER_FUNCTIONS="json_answer|json_answer_bound|answer_values|put|format_float"
INFER_RESPONSE_FUNCTIONS="infer_response|infer_response_size|answer_sizes|varint_size|put_varint|delimited_size"
INFER_RESPONSE_FUNCTIONS+="|put_delimited"
declare -A OWN=(
    [http1]="_front_parse.c:!$JSON_ANSWER_FUNCTIONS"
    [infer_body]="_front_parse.c:!$JSON_ANSWER_FUNCTIONS"
    [json_answer]="_front_parse.c:$JSON_ANSWER_FUNCTIONS"
    [model_infer]="_front_infer.c:!$INFER_RESPONSE_FUNCTIONS"
    [model_infer_answer]="_front_infer.c:$INFER_RESPONSE_FUNCTIONS"
)

printf '%-18s %12s %8s %8s %8s %10s  %s\n' harness executions cov ft corpus exec/s "own lines, branches run"

for name in "${HARNESSES[@]}"; do
    # shellcheck disable=SC2086  # the sources are a list
    "$CC" "${FLAGS[@]}" "fuzz/$name.c" ${SOURCES[$name]} -o "$OUT/$name"
    corpus="$OUT/corpus/$name"
    mkdir -p "$corpus"
    log="$OUT/$name.log"
    # FUZZ_RUNS: that many inputs instead of SECONDS (a check that does not depend on the machine's speed)
    budget=("-max_total_time=$SECONDS_EACH")
    [ -n "${FUZZ_RUNS:-}" ] && budget=("-runs=$FUZZ_RUNS")
    if ! (cd "$OUT" && "./$name" "${budget[@]}" -print_final_stats=1 -artifact_prefix="$name-" \
            "corpus/$name" "../../fuzz/seeds/$name") >"$log" 2>&1; then
        tail -40 "$log"
        echo "make fuzz: $name found a crash (above); its input is $OUT/$name-*; reproduce: $OUT/$name $OUT/$name-*" >&2
        exit 1
    fi
    executions=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
    done_line=$(grep -E '^#[0-9]+[[:space:]]+DONE' "$log" | tail -1)
    cov=$(sed -n 's/.* cov: \([0-9]*\).*/\1/p' <<<"$done_line")
    ft=$(sed -n 's/.* ft: \([0-9]*\).*/\1/p' <<<"$done_line")
    corp=$(sed -n 's/.* corp: \([0-9]*\).*/\1/p' <<<"$done_line")
    rate=$(sed -n 's/.* exec\/s: \([0-9]*\).*/\1/p' <<<"$done_line")
    own=""
    if [ "${FUZZ_COVERAGE:-1}" = 1 ]; then
        # shellcheck disable=SC2086
        clang -g -O0 -fprofile-instr-generate -fcoverage-mapping -fsanitize=fuzzer -Iworker/serve -I"$LLHTTP_INCLUDE" \
            "fuzz/$name.c" ${SOURCES[$name]} -o "$OUT/$name.coverage"
        (cd "$OUT" && LLVM_PROFILE_FILE="$name.profraw" "./$name.coverage" -runs=0 "corpus/$name" \
            "../../fuzz/seeds/$name" >/dev/null 2>&1)
        llvm-profdata merge -sparse "$OUT/$name.profraw" -o "$OUT/$name.profdata"
        own_file=${OWN[$name]%%:*}
        functions=${OWN[$name]#"$own_file:"}
        others=0
        [ "${functions:0:1}" = "!" ] && others=1 && functions=${functions:1}
        # one line per function: its name (a static one's as file:name), regions, missed, cover, lines, missed, cover,
        # branches, missed, cover
        own=$(llvm-cov report "$OUT/$name.coverage" -instr-profile="$OUT/$name.profdata" -show-functions \
            "worker/serve/$own_file" | awk -v names="^($functions)\$" -v others="$others" '
                NF == 10 && $1 != "TOTAL" && $2 ~ /^[0-9]+$/ {
                    sub(/^[^ ]*:/, "", $1)
                    if (($1 ~ names) != others) {lines += $5; lines_missed += $6; branches += $8; branches_missed += $9}
                }
                END {printf "%.2f%% of %d, %.2f%% of %d\n", lines ? 100 * (lines - lines_missed) / lines : 0, lines,
                     branches ? 100 * (branches - branches_missed) / branches : 0, branches}')
    fi
    printf '%-18s %12s %8s %8s %8s %10s  %s\n' "$name" "$executions" "$cov" "$ft" "$corp" "$rate" "$own"
done
