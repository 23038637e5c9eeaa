#!/bin/bash
# ftflow on one GPU beside plain baselines, on a bare GPU machine (python3 3.12 with torch and
# transformers, no Ray, DeepSpeed or Prefect, nothing kept between commands), with the site that
# build_site.sh made carried along in .gpu/:
#   bash bench/gpu/check.sh        # from the project root; ends by CHECK_DEADLINE_S (520 s) + ~20 s
# `ftflow doctor`, then ftflow at its defaults and at ZeRO-2/3 (batch 256), a plain bf16 loop and the HF
# Trainer on the same rows and model, `ftflow infer` on 100k rows beside a plain GPU loop. Everything it
# prints, each step's output and each run's log, stall reports and manifest go to $OUT (else /tmp/out);
# the summary at the end has one line per measurement, each naming the card. `largest` (bench/largest.py),
# `e2e` and `e2e-b256` run
# bench/end_to_end.py (the whole job against the HF Trainer script) only when named in STEPS, and
# `engines` (`ftflow infer` with each other inference.engine, after infer) too.
set -uo pipefail
T0=$(date +%s)
here=$(cd "$(dirname "$0")" && pwd); R=$(cd "$here/../.." && pwd); cd "$R" || exit 2
S=/tmp/site; O=${OUT:-/tmp/out}; mkdir -p "$O"; RES=$O/results.txt; : > "$RES"
exec > >(tee "$O/check.txt") 2>&1
DEADLINE=${CHECK_DEADLINE_S:-520}  # a step killed at its limit may take ~20 s more (SIGINT, then SIGKILL 15 s later)
# The steps to run (a rerun after a fix needs only some): STEPS="zero2-b256 profile infer". Doctor runs
# first, the ftflow runs in the order given, then profile (only when named), baselines and infer.
STEPS=" ${STEPS:-doctor default zero2-b256 zero3-b256 baselines infer} "
want(){ [[ $STEPS == *" $1 "* ]]; }
el(){ echo $(( $(date +%s) - T0 )); }
log(){ echo "[$(el)s] $*"; }
result(){ echo "$*" >> "$RES"; echo "$*"; }
# Seconds a step may run: its own cap, less what the steps after it keep (reserve), before the deadline.
allow(){ local t=$(( DEADLINE - $(el) - $2 )); (( t > $1 )) && t=$1; echo "$t"; }
quiet(){ grep -vE "logging\.cc|━|^\s*@|^\s*$" "$@"; }  # Ray's C++ stack lines filled a killed run's whole tail
stop_ray(){ python3 -m ray.scripts.scripts stop --force >/dev/null 2>&1; }  # a run killed at its limit leaves Ray holding the GPU

[ -f .gpu/site.tar.xz ] || { echo "no .gpu/site.tar.xz: build it here with 'bash bench/gpu/build_site.sh', carry .gpu"; exit 2; }
[ -f $S/.done ] || { rm -rf $S && mkdir -p $S && xz -T0 -dc .gpu/site.tar.xz | tar -xf - -C $S && touch $S/.done; } \
  || { echo "unpacking .gpu/site.tar.xz failed"; exit 2; }
export PYTHONPATH=$S:$R PATH=$S/bin:$PATH PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1 \
  PREFECT_SERVER_ANALYTICS_ENABLED=false TORCH_EXTENSIONS_DIR=/tmp/torch_extensions
log "site unpacked"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
CARD=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
python3 -c "import platform; from importlib.metadata import version as v
print('python', platform.python_version(), *(f'{p} {v(p)}' for p in ('torch', 'ray', 'deepspeed', 'prefect', 'transformers')))"
rev=$(git rev-parse --short HEAD 2>/dev/null) && { git diff --quiet HEAD 2>/dev/null || rev+=" + uncommitted changes"; }
echo "ftflow at ${rev:-a commit this copy does not say (no .git)}"

if want doctor; then
log "ftflow doctor"; t1=$(date +%s)
timeout -s INT -k 10 120 python3 -m ftflow.cli doctor --storage-root /tmp/art > "$O/doctor.txt" 2>&1; rc=$?
quiet "$O/doctor.txt" | tail -30
result "RESULT ftflow doctor: exit $rc$( ((rc == 124)) && echo ' (killed at 120 s)'), $(( $(date +%s) - t1 )) s"
stop_ray
fi

[ -d /tmp/bert ] || python3 bench/gpu/make_model.py /tmp/bert bench/gpu/tok base | tail -1   # no weights fit in the carry
log "model made"

if want sdpa; then t=$(allow 60 0); log "sdpa: what a new sequence length costs each attention backend: limit $t s"
  timeout -k 5 "$t" python3 bench/gpu/sdpa_shapes.py /tmp/bert 256 > "$O/sdpa.txt" 2>&1
  grep "^RESULT" "$O/sdpa.txt" >> "$RES"; grep "^RESULT" "$O/sdpa.txt" || tail -5 "$O/sdpa.txt"
fi

# e2e NAME CAP ARGS...: bench/end_to_end.py (issue 41), the whole job of `ftflow run` (2nd run, and with
# a running stack unless --no-stack) against the HF Trainer script (torch's attention, and without
# cuDNN's as ftflow runs), ARGS added to its fields: its table, the targets, each run's summary.
e2e(){ local name=$1 cap=$2; shift 2
  local t; t=$(allow "$cap" 20)
  if (( t < 120 )); then result "RESULT $name: skipped, $(( DEADLINE - $(el) )) s left"; return; fi
  log "$name: bench/end_to_end.py, limit $t s, $*"; rm -rf "/tmp/$name"
  timeout -s INT -k 15 "$t" python3 bench/end_to_end.py --keep "/tmp/$name" --set model.name_or_path=/tmp/bert "$@" \
    > "$O/$name.txt" 2>&1; local rc=$?
  log "$name: exit $rc"; (( rc )) && quiet "$O/$name.txt" | tail -"${LOG_TAIL:-25}"
  grep -E "^\||^target|^over|^\([a-c2]+\) " "$O/$name.txt" | tee -a "$RES"
  local m; for m in $(ls -tr /tmp/"$name"/root/runs/*/manifest.json 2>/dev/null); do
    mkdir -p "$O/$name/$(basename "$(dirname "$m")")"; cp "$m" "$O/$name/$(basename "$(dirname "$m")")/"
    result "$(python3 bench/gpu/summary.py "$name $(basename "$(dirname "$m")")" "$(dirname "$m")" 0 -)"; done
  stop_ray; }
declare -A E2E=([e2e]="360" [e2e-run]="300 --no-stack" [e2e-b256]="220 --no-stack --set train.zero_stage=2 --set train.batch_size=256")
for step in $STEPS; do [ -n "${E2E[$step]:-}" ] && e2e "$step" ${E2E[$step]}; done

# A stall report (every worker's stack, the GPUs) under the run's stall/ when no step shows for 45 s.
STALL=(); grep -q "stall_warning_s" tasks/core/config.py && STALL=(--set train.stall_warning_s=45)
FTFLOW_RUN=(python3 -m ftflow.cli run --set model.name_or_path=/tmp/bert --set storage_root=/tmp/art)  # every run's
# ftflow run NAME CAP TRAIN_S ARGS...: the run's limit is CAP (keeping 90 s for the baselines after the
# runs), training's own train.timeout_s TRAIN_S. A working run: ~30-60 s of start-up, the epoch (~17 s of
# compute on an H100 at batch 32), evaluation, batch inference of the test split and the report.
ft(){ local name=$1 cap=$2 train_s=$3; shift 3
  local t; t=$(allow "$cap" "$( want baselines && echo 90 || echo 30 )")
  if (( t < 60 )); then result "RESULT ftflow $name: skipped, $(( DEADLINE - $(el) )) s left"; return; fi
  (( train_s > t - 40 )) && train_s=$(( t - 40 ))
  log "ftflow $name: limit $t s, train.timeout_s=$train_s, $*"
  touch "$O/.mark"; local t1; t1=$(date +%s)
  timeout -s INT -k 15 "$t" "${FTFLOW_RUN[@]}" --set train.timeout_s="$train_s" "${STALL[@]}" "$@" > "$O/$name.txt" 2>&1
  local rc=$? secs=$(( $(date +%s) - t1 ))
  log "$name: exit $rc after $secs s"; quiet "$O/$name.txt" | tail -12
  local run; run=$(find /tmp/art/runs -mindepth 1 -maxdepth 1 -type d -newer "$O/.mark" 2>/dev/null | head -1)
  if [ -n "$run" ]; then
    mkdir -p "$O/$name"; cp -r "$run/logs" "$run/stall" "$run/manifest.json" "$run/report/report.md" "$O/$name/" 2>/dev/null
    local f; f=$(ls -t "$O/$name"/logs/*.log 2>/dev/null | head -1)
    [ -n "$f" ] && { echo "--- $name: the last lines of its log"; quiet "$f" | tail -"${LOG_TAIL:-15}"; }
  fi
  result "$(python3 bench/gpu/summary.py "$name" "${run:-none}" "$rc" "$secs")"
  stop_ray; }
declare -A RUN=([default]="230 120" [zero2-b256]="170 100 --set train.zero_stage=2 --set train.batch_size=256"
  [zero3-b256]="170 100 --set train.zero_stage=3 --set train.batch_size=256"
  [zero2-b256-check]="170 100 --set train.zero_stage=2 --set train.batch_size=256
    --set train.deepspeed={\"bf16\":{\"check_grad_overflow\":true}}"
  [default-zero1]="170 100 --set train.zero_stage=1"
  [default-autocast]="170 100 --set train.precision=fp32
    --set train.deepspeed={\"torch_autocast\":{\"enabled\":true,\"dtype\":\"bfloat16\"}}"
  [offload]="170 120 --set train.zero_stage=3 --set train.offload_optimizer=true --set train.offload_params=true
    --set train.activation_offload=true --set train.max_steps=10")
for step in $STEPS; do [ -n "${RUN[$step]:-}" ] && ft "$step" ${RUN[$step]}; done

# profile: where a training step's time goes. ftflow at its defaults for 2 epochs; once its first
# progress line shows, py-spy samples the training worker for 20 s (every thread, as a speedscope
# file and as one text dump) beside `nvidia-smi dmon` (the GPU's utilisation per second).
# PROFILE_ARGS replaces the run's settings: PROFILE_ARGS="--set train.epochs=3 --set train.batch_size=256".
if want profile; then t=$(allow 150 30)
if (( t >= 90 )); then
  log "profile: limit $t s"; mkdir -p "$O/profile"
  timeout -s INT -k 15 "$t" "${FTFLOW_RUN[@]}" ${PROFILE_ARGS:---set train.epochs=2} > "$O/profile.txt" 2>&1 & run_pid=$!
  until grep -q "^  train: " "$O/profile.txt" 2>/dev/null || ! kill -0 $run_pid 2>/dev/null; do sleep 1; done
  worker=$(pgrep -f "ray::RayTrainWorker" | head -1)
  if [ -n "$worker" ]; then
    log "profile: sampling the training worker (pid $worker) for 20 s"
    nvidia-smi dmon -s u -c 20 > "$O/profile/dmon.txt" 2>&1 & dmon=$!
    py-spy record -p "$worker" -d 20 -r 100 -f speedscope -o "$O/profile/worker.speedscope.json" > "$O/profile/record.txt" 2>&1
    py-spy dump -p "$worker" > "$O/profile/dump.txt" 2>&1; wait $dmon
    python3 bench/gpu/profile_top.py "$O/profile/worker.speedscope.json" 40 > "$O/profile/top.txt" 2>&1
    head -100 "$O/profile/top.txt"
    result "RESULT profile: GPU utilisation over 20 s of steps: $(awk '$1 ~ /^[0-9]+$/ { s += $2; n++ } END { if (n) printf "%.0f%% (mean of %d samples)", s / n, n; else print "-" }' "$O/profile/dmon.txt")"
  else result "RESULT profile: no training worker was found"; fi
  kill -INT $run_pid 2>/dev/null; wait $run_pid 2>/dev/null; stop_ray
else result "RESULT profile: skipped, $(( DEADLINE - $(el) )) s left"; fi
fi

if want baselines; then t=$(allow 150 0); log "plain bf16 loop and HF Trainer, batches ${BASELINE_BATCHES:-32,256}: limit $t s"
if (( t >= 30 )); then
  timeout -k 10 "$t" python3 bench/gpu/baselines.py /tmp/bert data/rotten_tomatoes/train.jsonl "${BASELINE_BATCHES:-32,256}" > "$O/baselines.txt" 2>&1
  grep "^RESULT" "$O/baselines.txt" >> "$RES"; grep "^RESULT" "$O/baselines.txt" || tail -5 "$O/baselines.txt"
else result "RESULT baselines: skipped, $(( DEADLINE - $(el) )) s left"; fi
fi

m=$(ls -td /tmp/art/runs/*/model 2>/dev/null | head -1); t=$(allow 100 30)
corpus(){ [ -d /tmp/corpus ] || python3 bench/gpu/corpus.py data/rotten_tomatoes/train.jsonl /tmp/corpus 100000 16; }  # the 100k rows infer and engines label
if ! want infer; then :
elif [ -z "$m" ]; then result "RESULT ftflow infer: skipped, no run exported a model"
elif (( t < 45 )); then result "RESULT ftflow infer: skipped, $(( DEADLINE - $(el) )) s left"
else
  corpus
  log "ftflow infer, 100,000 rows: limit $t s"; t1=$(date +%s)
  timeout -s INT -k 10 "$t" python3 -m ftflow.cli infer "$m" /tmp/corpus /tmp/preds --device gpu --batch-size 256 > "$O/infer.txt" 2>&1
  rc=$?; secs=$(( $(date +%s) - t1 )); quiet "$O/infer.txt" | tail -6
  result "RESULT ftflow infer, batch 256: $(grep -oP '^rows/s:\s*\K[\d,]+' "$O/infer.txt" || echo '-') rows/s (its job), 100,000 rows, $secs s wall with start-up, exit $rc"
  stop_ray; t=$(allow 90 0)  # infer_base.py: no-cudnn, then torch's default
  if (( t >= 20 )); then timeout -k 5 "$t" python3 bench/gpu/infer_base.py "$m" /tmp/corpus 2>&1 | grep "^RESULT" | tee -a "$RES"
  else result "RESULT plain GPU inference loop: skipped, $(( DEADLINE - $(el) )) s left"; fi
fi

# engines (only when named, after infer: its model and corpus): `ftflow infer` on the same 100k rows with
# each other inference.engine (issue 41): torch.compile, and DeepSpeed-Inference's injected kernels
# (their CUDA op compiles at its first use: minutes on a fresh machine).
for engine in compile deepspeed; do want engines || break
  t=$(allow 150 0)
  [ -n "$m" ] && corpus
  if [ -z "$m" ] || (( t < 45 )); then result "RESULT ftflow infer, engine $engine: skipped"; continue; fi
  log "ftflow infer, 100,000 rows, engine $engine: limit $t s"; t1=$(date +%s)
  timeout -s INT -k 10 "$t" python3 -m ftflow.cli infer "$m" /tmp/corpus "/tmp/preds-$engine" --device gpu --batch-size 256 \
    --engine "$engine" > "$O/infer-$engine.txt" 2>&1
  rc=$?; secs=$(( $(date +%s) - t1 )); quiet "$O/infer-$engine.txt" | tail -6
  result "RESULT ftflow infer, engine $engine, batch 256: $(grep -oP '^rows/s:\s*\K[\d,]+' "$O/infer-$engine.txt" || echo '-') rows/s (its job), $secs s wall with start-up, exit $rc"
  stop_ray
done

# largest (only when named): bench/largest.py (issue 56), the largest Llama-style model each one-GPU strategy
# trains, its weights drawn on the device from a config (model.init: random), bf16, full and LoRA: the whole
# job per size. LARGEST_ONLY and LARGEST_SIZES replace its strategies and ladder. The disk (64 GiB) bounds
# what completes: a full fine-tuning checkpoint takes ~16 bytes a parameter, an export 2 (bf16 from 1B parameters).
if want largest; then t=$(allow 560 0); log "largest: limit $t s"
  timeout -s INT -k 15 "$t" python3 bench/largest.py --only "${LARGEST_ONLY:-zero3-1w-offload,lora-zero3-1w}" \
    --sizes "${LARGEST_SIZES:-1.0B,2.9B,8.2B,14B,30B}" > "$O/largest.txt" 2>&1
  grep -E "^\||<!--" "$O/largest.txt" | tee -a "$RES"; quiet "$O/largest.txt" | tail -5; stop_ray
fi

log "summary, $CARD"
awk -v card="$CARD" '{ sub(/^RESULT /, card " | "); print }' "$RES"
# The run tool brings back at most 8 files: all but these two travel as one tarball.
tar -czf /tmp/runs.tar.gz -C "$O" --exclude=./check.txt --exclude=./results.txt . \
  && find "$O" -mindepth 1 ! -name check.txt ! -name results.txt -delete && mv /tmp/runs.tar.gz "$O/"
