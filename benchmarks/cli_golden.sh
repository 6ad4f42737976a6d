#!/usr/bin/env bash
# Golden CLI outputs of ndplan: each case's stdout, stderr and exit code in $1/NAME.{out,err,rc},
# about 130 commands (every subcommand, its --json and text output, --emit, --explain, --balance,
# --from configs, bad input, a closed pipe). A change meant to leave the CLI as it is (moving code,
# splitting a command) is checked by running it before and after and comparing:
#
#     benchmarks/cli_golden.sh /tmp/before      # at the old commit (WT= another checkout, PY= its python)
#     benchmarks/cli_golden.sh /tmp/after
#     diff -r /tmp/before /tmp/after
#
# Timing that varies run to run is filtered out (the same filter before and after). About 3
# minutes on 2 cores.
set -u
OUT=${1:?usage: golden.sh DIR}
WT=${WT:-$(cd "$(dirname "$0")/.." && pwd)}
PY=${PY:-$WT/.venv/bin/python}
FX=$WT/tests/fixtures/io
rm -rf "$OUT"; mkdir -p "$OUT"
cd "$OUT"   # relative outputs (csv, plots) land here; same absolute path before and after

filter() {  # timing: search header "(1.2 s)", JSON seconds, balance title "(dp, 0.12 s)"
  sed -E -i \
    -e 's/(candidates, [0-9,]+ valid and priced, [0-9,]+ fit )\([0-9.]+ s\)/\1(T s)/' \
    -e 's/"(seconds|solve_seconds)": [0-9.e-]+/"\1": T/' \
    -e 's/(balanced under [0-9.]+ [KMGT]iB \([^,]+, )[0-9.]+ s\)/\1T s)/' \
    "$@"
}

case_() {  # case_ NAME ARGS...
  local name=$1; shift
  "$PY" -m ndplan.cli "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  echo $? > "$OUT/$name.rc"
  filter "$OUT/$name.out" "$OUT/$name.err"
}

L8=(--model llama-3.1-8b)
S8=(search "${L8[@]}" --hardware h100-sxm --devices 8 --gbs 32)
E70=(estimate --model llama-3.1-70b --hardware h100-sxm --devices 64 --tp 8 --pp 4 --sp --zero 1 --gbs 256 --seq 4096 --recompute selective)
B70=(balance --model llama-3.1-70b --hardware h100-sxm --devices 64 --tp 8 --pp 4 --sp --zero 1 --gbs 256 --memory-limit 36GiB)

# top level
case_ help --help
case_ version --version
for c in models hardware check estimate balance search inspect report calibrate; do case_ help-$c $c --help; done

# models, hardware
case_ models models
case_ models-json models --json
case_ models-one models --model deepseek-v3
case_ models-one-json models --model qwen3-30b-a3b --json
case_ hardware hardware
case_ hardware-json hardware --json
case_ hardware-one hardware h100-sxm

# check
case_ check-valid check --model deepseek-v3 --devices 512 --tp 2 --pp 8 --ep 64 --etp 1 --gbs 1024
case_ check-runtime-invalid check --model deepseek-v3 --devices 512 --tp 2 --pp 8 --ep 64 --etp 1 --gbs 1024 --runtime megatron
case_ check-invalid check "${L8[@]}" --devices 8 --tp 3
case_ check-invalid-json check "${L8[@]}" --devices 8 --tp 3 --json
case_ check-from check --from "$FX/megatron_llama3_70b.sh" --model llama-3.1-70b
case_ check-from-json check --from "$FX/torchtitan_llama3_70b.toml" --devices 64 --json
case_ check-hardware-bad check "${L8[@]}" --hardware tpu-v9

# estimate
case_ est-text "${E70[@]}"
case_ est-json "${E70[@]}" --json
case_ est-explain "${E70[@]}" --explain
case_ est-emit-megatron "${E70[@]}" --emit megatron
case_ est-emit-torchtitan "${E70[@]}" --emit torchtitan
case_ est-emit-mindformers estimate "${L8[@]}" --hardware h100-sxm --devices 8 --tp 2 --gbs 16 --emit mindformers
case_ est-emit-hyperparallel estimate "${L8[@]}" --hardware h100-sxm --devices 8 --tp 2 --gbs 16 --emit hyperparallel --json
case_ est-limit estimate --from "$FX/megatron_llama3_70b.sh" --model llama-3.1-70b --hardware h100-sxm --runtime megatron --memory-limit 70GiB
case_ est-limit-json estimate --from "$FX/megatron_llama3_70b.sh" --model llama-3.1-70b --hardware h100-sxm --runtime megatron --memory-limit 70GiB --json
case_ est-overlap estimate --model qwen3-235b-a22b --hardware h100-sxm --devices 256 --tp 4 --sp --pp 8 --vpp 4 --schedule interleaved --ep 8 --etp 1 --zero 1 --gbs 2048 --runtime megatron --overlap tp=on,ep_dispatch=node_dedup
case_ est-inert estimate "${L8[@]}" --hardware h100-sxm --devices 8 --gbs 16 --loss-parallel --selective-policy keep-matmuls --cp-kind ring --moe-imbalance 1.2
case_ est-compile estimate "${L8[@]}" --hardware h100-sxm --devices 8 --tp 2 --gbs 16 --compile model+loss --selective-policy torchtitan-op --recompute selective --no-loss-parallel
case_ est-fp8 estimate "${L8[@]}" --hardware h100-sxm --devices 8 --gbs 16 --precision megatron-fp8
case_ est-dispatcher estimate --model mixtral-8x7b --hardware h100-sxm --devices 16 --ep 8 --gbs 64 --runtime megatron --moe-dispatcher allgather
case_ est-overlimit estimate --model llama-3.1-70b --hardware h100-sxm --devices 8 --gbs 16
case_ est-from-tt estimate --from "$FX/torchtitan_llama3_70b.toml" --hardware h100-sxm --devices 64
case_ est-no-world estimate --from "$FX/torchtitan_llama3_70b.toml" --hardware h100-sxm
case_ est-plot-svg "${E70[@]}" --plot est.svg
case_ est-missing-hw estimate "${L8[@]}" --devices 8

# balance
case_ bal-text "${B70[@]}"
case_ bal-emit "${B70[@]}" --emit megatron
case_ bal-json "${B70[@]}" --emit megatron --json
case_ bal-heuristic "${B70[@]}" --heuristic --json
case_ bal-tt balance "${L8[@]}" --hardware h100-sxm --devices 8 --tp 2 --pp 4 --vpp 2 --schedule interleaved --gbs 64 --emit torchtitan
case_ bal-moe balance --model qwen3-30b-a3b --hardware h100-sxm --devices 16 --pp 2 --ep 8 --zero 1 --gbs 256 --runtime megatron --memory-limit 60GiB --recompute-module-sets common --emit megatron
case_ bal-stepup balance --model llama-3.1-70b --hardware h100-sxm --devices 64 --tp 8 --pp 4 --sp --zero 1 --gbs 256 --memory-limit 34GiB --emit megatron
case_ bal-neither balance "${L8[@]}" --hardware h100-sxm --devices 8 --pp 4 --vpp 2 --schedule dualpipev --gbs 64 --recompute full --zero 1 --memory-limit 53GiB
case_ bal-nofit balance "${L8[@]}" --hardware h100-sxm --devices 8 --pp 4 --vpp 2 --schedule interleaved --gbs 64 --memory-limit 10GiB
case_ bal-inert balance "${L8[@]}" --hardware h100-sxm --devices 8 --pp 4 --gbs 64 --loss-parallel --cp-kind ring --selective-policy keep-matmuls
case_ bal-dualpipev balance "${L8[@]}" --hardware h100-sxm --devices 8 --pp 4 --vpp 2 --schedule dualpipev --gbs 64 --recompute full --runtime megatron --memory-limit 50GiB --emit megatron --json
case_ bal-keep balance "${L8[@]}" --hardware h100-sxm --devices 8 --tp 8 --gbs 8 --recompute none --runtime megatron --memory-limit 79GiB --emit megatron
case_ bal-stepup-mf balance --model llama-3.1-70b --hardware h100-sxm --devices 64 --tp 8 --pp 4 --sp --zero 1 --gbs 256 --emit mindformers --memory-limit 36GiB
case_ bal-exit1 balance --model llama-3.1-70b --hardware h100-sxm --devices 64 --tp 8 --pp 4 --sp --zero 1 --gbs 256 --emit mindformers --memory-limit 34GiB
case_ bal-exit1-json balance --model llama-3.1-70b --hardware h100-sxm --devices 64 --tp 8 --pp 4 --sp --zero 1 --gbs 256 --emit mindformers --memory-limit 34GiB --json

# search
case_ s-text "${S8[@]}"
case_ s-json "${S8[@]}" --json
case_ s-csv "${S8[@]}" --csv s.csv --top 5
case_ s-fix "${S8[@]}" --fix tp=2 schedule=1f1b --top 3
case_ s-fix-json search "${L8[@]}" --hardware h100-sxm --devices 16 --gbs 64 --fix tp=2 --top 3 --json
case_ s-dims-fixed "${S8[@]}" --dims tp pp --fix tp=2 --top 1 --json
case_ s-emit-megatron "${S8[@]}" --memory-limit 30GiB --runtime megatron --balance one-setting --emit megatron
case_ s-emit-tt "${S8[@]}" --top 3 --emit torchtitan
case_ s-emit-tt-json search "${L8[@]}" --hardware h100-sxm --devices 8 --gbs 64 --seq 8192 --top 3 --fix zero=2 --emit torchtitan --precision fsdp-bf16 --json
case_ s-emit-mindformers "${S8[@]}" --top 2 --emit mindformers
case_ s-explain "${S8[@]}" --top 2 --explain
case_ s-balance "${S8[@]}" --fix tp=2 --balance --top 3
case_ s-balance-json "${S8[@]}" --fix tp=2 --balance --top 3 --json
case_ s-nofit "${S8[@]}" --memory-limit 1GiB
case_ s-nofit-json "${S8[@]}" --memory-limit 1GiB --json
case_ s-nofit-csv "${S8[@]}" --memory-limit 1GiB --csv empty.csv
case_ s-nofit-devices search --model llama-3.1-70b --hardware h100-sxm --devices 2 --gbs 16 --dims tp pp zero recompute
case_ s-invalid-fix search "${L8[@]}" --hardware h100-sxm --devices 8 --gbs 32 --fix cp=3
case_ s-from-tt search --from "$FX/torchtitan_llama3_70b.toml" --hardware h100-sxm --devices 64 --dims recompute --json
case_ s-from-meg search --from "$FX/megatron_llama3_70b.sh" --model llama-3.1-70b --hardware h100-sxm --dims tp --top 3
case_ s-from-hsdp search --from "$FX/hyperparallel_qwen3_moe_hsdp.yaml" --hardware h100-sxm --dims pp --top 3
case_ s-moe-sets search --model qwen3-30b-a3b --hardware h100-sxm --devices 16 --gbs 64 --runtime megatron --fix ep=8 tp=1 pp=2 --recompute-module-sets common --top 3
case_ s-offload-sets search --model qwen3-30b-a3b --hardware h100-sxm --devices 16 --gbs 64 --runtime megatron --fix ep=8 tp=1 pp=2 schedule=interleaved --offload-module-sets common --top 3 --json
case_ s-fp8 "${S8[@]}" --top 1 --precision megatron-fp8
case_ s-runs search --model llama-3.1-8b --hardware h100-sxm --devices 16 --gbs 64 --fix tp=2 sp=1 --dims pp schedule pipeline_runs --top 3 --emit torchtitan

# inspect
for f in "$FX"/*; do b=$(basename "$f"); case_ inspect-$b inspect "$f"; done
case_ inspect-json inspect "$FX/torchtitan_llama3_70b.toml" --json

# report (estimate_result uses the shared --memory-limit)
case_ report-estimate report "${L8[@]}" --hardware h100-sxm --devices 8 --gbs 16 --memory-limit 70GiB -o report.html

# generated files: dates and matplotlib's random ids filtered
sed -E -i -e 's/<dc:date>[^<]*</<dc:date>D</' -e 's/\b[mp][0-9a-f]{10}\b/ID/g' "$OUT/est.svg"
sed -E -i -e 's/20[0-9]{2}-[0-9]{2}-[0-9]{2} [0-9]{2}:[0-9]{2} UTC/DATE UTC/g' "$OUT/report.html"

# bad input
case_ bad-model check --model llama-9
case_ bad-missing-model check
case_ bad-schedule check "${L8[@]}" --schedule bogus
case_ bad-int check "${L8[@]}" --tp two
case_ bad-command frobnicate
case_ bad-flag-typo "${S8[@]}" --memroy-limit 30GiB
case_ bad-flag-json "${S8[@]}" --jsno
case_ bad-mem-abc "${S8[@]}" --memory-limit abc
case_ bad-mem-neg "${S8[@]}" --memory-limit -5GiB
case_ bad-mem-zero balance "${L8[@]}" --hardware h100-sxm --devices 8 --gbs 16 --pp 2 --memory-limit 0GiB
case_ bad-mem-above balance "${L8[@]}" --hardware h100-sxm --devices 8 --gbs 16 --pp 2 --memory-limit 300GiB --json
case_ bad-mem-above-est estimate "${L8[@]}" --hardware h100-sxm --devices 8 --memory-limit 300GiB
case_ bad-empty-mem "${S8[@]}" --memory-limit ""
case_ bad-empty-mem-eq "${S8[@]}" --memory-limit=
case_ bad-empty-csv "${S8[@]}" --csv ""
case_ bad-empty-fix "${S8[@]}" --fix tp=2 " "
case_ bad-empty-hw hardware ""
case_ bad-empty-model models --model ""
case_ bad-top "${S8[@]}" --top 0
case_ bad-fix-form "${S8[@]}" --fix tp
case_ bad-fix-twice "${S8[@]}" --fix tp=2 tp=4
case_ bad-csv-file-folder "${S8[@]}" --csv s.csv/x.csv  # (s.csv: written by s-csv above)
case_ bad-csv-folder "${S8[@]}" --csv /tmp
case_ bad-search-gbs search "${L8[@]}" --hardware h100-sxm --devices 8
case_ bad-search-hw search "${L8[@]}" --devices 8 --gbs 8
case_ bad-search-model search --hardware h100-sxm --devices 8 --gbs 8
case_ bad-sets-both "${S8[@]}" --recompute-modules core_attn --recompute-module-sets common
case_ bad-overlap "${S8[@]}" --overlap megatron,tp=on,tp=off
case_ bad-switches estimate "${L8[@]}" --hardware h100-sxm --devices 8 --sp --no-sp
case_ bad-emit estimate "${L8[@]}" --hardware h100-sxm --devices 8 --emit nemo
case_ bad-imbalance estimate --model mixtral-8x7b --hardware h100-sxm --devices 8 --moe-imbalance 1.2
case_ bad-gbs-huge "${S8[@]}" --gbs 1099511627776
case_ bad-plan-missing check "${L8[@]}" --plan /nonexistent.yaml
case_ bad-from-missing estimate --from /nonexistent.sh --hardware h100-sxm

# the console script and a closed pipe
"$WT/.venv/bin/ndplan" models --json > "$OUT/script-models.out" 2> "$OUT/script-models.err"; echo $? > "$OUT/script-models.rc"
( "$PY" -m ndplan.cli models --json | head -c 100 ) > "$OUT/pipe-head.out" 2> "$OUT/pipe-head.err"
"$PY" -c 'import sys; from ndplan.cli import main; sys.exit(main(["models","--json"]))' 2>&1 | head -3 > "$OUT/pipe-head2.out"
"$PY" -m ndplan.cli search --model llama-3.1-8b --hardware h100-sxm --devices 8 --gbs 32 --json 2>"$OUT/pipe-search.err" | head -c 50 > "$OUT/pipe-search.out"; echo "${PIPESTATUS[0]}" > "$OUT/pipe-search.rc"
exit 0
