#!/usr/bin/env bash
# A prepared, unattended check of pathways-nb on a real accelerator (issue 35, item 4).
#
# Why: the project's machines have no accelerator, so the tests and benchmarks run on CPU devices. This
# script is what to run, with no questions asked and in under 10 minutes, on a host that has one (an
# NVIDIA GPU host or a TPU VM), from a fresh checkout:
#
#     bash benchmarks/accelerator_check.sh [--platform cuda|tpu|cpu] [--budget_s 540] [--output DIR]
#                                          [--devices N] [--python PYTHON] [--venv DIR]
#
# What it does, each step under `timeout` and within the total budget (--budget_s, default 540 s); a
# step that fails is recorded and the next one runs all the same:
#   1. detects the accelerator: NVIDIA with nvidia-smi (cuda); a TPU with /dev/accel* or /dev/vfio/N plus
#      Google's PCI vendor id or an importable libtpu (tpu). --platform forces one; with none found and
#      none forced it exits 2, saying so in one line. --platform cpu runs the whole flow on CPU devices
#      (no plugin), to exercise the script itself on a machine without an accelerator.
#   2. makes a venv (.venv-accel in the checkout, git-ignored, reused while pyproject.toml and the
#      platform are the same; --venv DIR elsewhere) with Python 3.11 or newer, and installs the checkout
#      (pip install -e), pytest, flax and optax (parity.py's Flax step) and the plugin that matches the installed jaxlib exactly: cuda:
#      jax-cuda12-plugin[with-cuda] and jax-cuda12-pjrt of jaxlib's version (CUDA_MAJOR=13: the cuda13
#      ones); tpu: pyproject's `tpu` extra (libtpu), with jax's own `tpu` extra of the installed jax
#      choosing libtpu's version. The first run on a GPU host downloads a few GB of CUDA wheels.
#   3. checks that local JAX sees the devices (their platform, count and kind).
#   4. starts `pathways-nb up --islands 1 --devices_per_host N --platform P` (N: the devices local JAX
#      saw; --devices N: the first N GPUs, or N CPU devices, default 2) on a free port in the background,
#      its logs in DIR/cluster/logs, and waits until it writes its address (up --output DIR/cluster);
#      a trap stops it on any exit: the end, a failure, a timeout, Ctrl-C or SIGTERM.
#   5. against that cluster: (a) a smoke: pathways_nb.connect, jax.devices(), a jitted matmul against
#      numpy, a jit sharded over all N devices, a 64 MiB round trip and a gradient against local CPU;
#      (c) JAX's own test slice, only if JAXSUITE_DIR names a copy of shared/jaxsuite with JAX's tests
#      brought in (its README; JAXSUITE_CAP_S caps it, default 180 s). (b) tests/ is NOT run: every
#      test there starts its own CPU servers (tests/conftest.py) and compares bitwise with local CPU
#      devices, and none can be pointed at another address, so the smoke stands in for it.
#      Then the cluster is stopped, so that the benchmarks, which start their own servers, have the
#      device to themselves (a TPU serves one process at a time):
#      (d) benchmarks/parity.py (with --platform if it has that option; without it, it measures CPU
#      servers against CPU local JAX, and the table says so), (e) benchmarks/proxy_vs_local.py --quick
#      (likewise). In cpu mode both run with small settings.
#   6. prints one table (step | result | seconds | notes) and the benchmarks' tables, and writes them to
#      DIR/summary.md (DIR: --output, default /tmp/accelerator-check-DATE), beside every step's log,
#      the cluster's logs and DIR/check.log (all that was printed), to paste into a closing note.
# Exit status: 0 if no step failed (skipped steps do not count), 1 if one did, 2 for no accelerator or a
# wrong flag.

set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PLATFORM=""
BUDGET_S=540
OUTPUT=""
DEVICES=""
PYTHON=""
VENV=""
RESERVE_S=30      # kept back from every step for stopping the cluster and writing the summary
MIN_STEP_S=15     # a step with less time than this left is skipped ("budget spent")

usage() {
    sed -n '2,/^# wrong flag/p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//'
}

die_usage() {
    echo "accelerator_check: $1 (--help says how to run it)" >&2
    exit 2
}

while (($#)); do
    case $1 in
        --platform | --budget_s | --budget-s | --output | --devices | --python | --venv)
            (($# >= 2)) || die_usage "$1 needs a value"
            flag=${1//-/_}
            flag=${flag#__}
            printf -v "${flag^^}" '%s' "$2"
            shift 2
            ;;
        --platform=* | --budget_s=* | --budget-s=* | --output=* | --devices=* | --python=* | --venv=*)
            flag=${1%%=*}
            flag=${flag//-/_}
            flag=${flag#__}
            printf -v "${flag^^}" '%s' "${1#*=}"
            shift
            ;;
        -h | --help)
            usage
            exit 0
            ;;
        *) die_usage "unknown argument: $1" ;;
    esac
done
case $PLATFORM in "" | cuda | tpu | cpu) ;; *) die_usage "--platform $PLATFORM: one of cuda, tpu, cpu" ;; esac
[[ $BUDGET_S =~ ^[0-9]+$ ]] || die_usage "--budget_s $BUDGET_S: a number of seconds"
[[ -z $DEVICES || $DEVICES =~ ^[1-9][0-9]*$ ]] || die_usage "--devices $DEVICES: a positive number"

# -- 1. the accelerator ------------------------------------------------------------------------------

GPU_COUNT=0
DETECTED=""
gpu_names() { nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null || true; }
google_pci() { grep -qsx 0x1ae0 /sys/bus/pci/devices/*/vendor; }
system_libtpu() { python3 -c 'import libtpu' >/dev/null 2>&1; }

if command -v nvidia-smi >/dev/null; then
    GPU_COUNT=$(gpu_names | grep -c . || true)
fi
if ((GPU_COUNT > 0)); then
    DETECTED="cuda: $GPU_COUNT x $(gpu_names | head -n 1) (nvidia-smi)"
elif compgen -G '/dev/accel*' >/dev/null || compgen -G '/dev/vfio/[0-9]*' >/dev/null; then
    if google_pci || system_libtpu; then
        DETECTED="tpu: $(compgen -G '/dev/accel*' | paste -sd' ' -) $(compgen -G '/dev/vfio/[0-9]*' | paste -sd' ' -)"
    fi
fi
if [[ -z $PLATFORM ]]; then
    PLATFORM=${DETECTED%%:*}
    if [[ -z $PLATFORM ]]; then
        echo "accelerator_check: no accelerator found (no GPU from nvidia-smi, no TPU under /dev/accel* or" \
            "/dev/vfio); --platform cuda|tpu forces one, --platform cpu runs the check on CPU devices" >&2
        exit 2
    fi
fi

# -- where everything goes ---------------------------------------------------------------------------

STARTED=$EPOCHREALTIME
DEADLINE=$((${STARTED%.*} + BUDGET_S))
OUT=${OUTPUT:-/tmp/accelerator-check-$(date -u +%Y%m%d-%H%M%S)}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
exec > >(tee -a "$OUT/check.log") 2>&1
VENV=${VENV:-$ROOT/.venv-accel}
PY=$VENV/bin/python
CLUSTER_DIR=$OUT/cluster
UP_PID=""
CHILD_PID=""
ADDRESS=""
export XLA_PYTHON_CLIENT_PREALLOCATE=false # the worker, the local checks and the benchmarks share a GPU
export PYTHONUNBUFFERED=1
CUDA_MAJOR=${CUDA_MAJOR:-12} # the plugin's CUDA: jax-cuda12-plugin (CUDA_MAJOR=13: jax-cuda13-plugin)
DEVICES_NOTE=""
if [[ $PLATFORM == cuda && -n $DEVICES ]]; then # the first N GPUs (of CUDA_VISIBLE_DEVICES, if set)
    if ((GPU_COUNT > 0 && DEVICES > GPU_COUNT)); then
        DEVICES_NOTE="--devices $DEVICES: this host has $GPU_COUNT GPU(s)"
        DEVICES=$GPU_COUNT
    fi
    IFS=, read -ra visible <<<"${CUDA_VISIBLE_DEVICES:-$(seq -s, 0 $((DEVICES - 1)))}"
    CUDA_VISIBLE_DEVICES=$(IFS=,; echo "${visible[*]:0:DEVICES}")
    export CUDA_VISIBLE_DEVICES
elif [[ $PLATFORM == tpu && -n $DEVICES ]]; then
    DEVICES_NOTE="--devices ignored on a TPU: its worker serves every chip"
    DEVICES=""
fi
N=${DEVICES:-}
case $PLATFORM in
    cuda) EXPECTED="gpu|cuda" ;;
    *) EXPECTED=$PLATFORM ;;
esac

# -- the steps' record -------------------------------------------------------------------------------

STEPS=()
RESULTS=()
TIMES=()
NOTES=()
FAILED=0

say() { printf '[%5.0f s] %s\n' "$(since "$STARTED")" "$*"; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }
left_s() { echo $((DEADLINE - ${EPOCHREALTIME%.*})); }

# record STEP RESULT SECONDS NOTE
record() {
    STEPS+=("$1")
    RESULTS+=("$2")
    TIMES+=("$3")
    NOTES+=("${4//|//}")
    case $2 in pass | "done" | skipped*) ;; *) FAILED=1 ;; esac
    say "$1: $2 ($3 s)${4:+ - $4}"
}

# limit_for CAP [MORE_RESERVE]: the seconds a step may take: CAP, or what the budget has left.
limit_for() {
    local left=$(($(left_s) - RESERVE_S - ${2:-0}))
    echo $((left < $1 ? left : $1))
}

# run_step STEP CAP LOG COMMAND...: COMMAND under `timeout`, its output in LOG. Sets RESULT ("pass",
# "FAIL (exit N)", "timeout (N s)" or "skipped: ..."), SECONDS_TAKEN and RC; never stops the script.
run_step() {
    local step=$1 limit=$2 log=$3
    shift 3
    RC=0
    SECONDS_TAKEN=0
    if ((limit < MIN_STEP_S)); then
        RESULT="skipped: budget spent (--budget_s $BUDGET_S)"
        RC=125
        return 0
    fi
    say "$step (at most $limit s; log: ${log#"$OUT"/})"
    local began=$EPOCHREALTIME
    # In the background, waited for: a signal to this script is handled at once (on_signal stops it).
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1 &
    CHILD_PID=$!
    wait "$CHILD_PID" || RC=$?
    CHILD_PID=""
    SECONDS_TAKEN=$(since "$began")
    case $RC in
        0) RESULT=pass ;;
        124 | 137) RESULT="timeout ($limit s)" ;;
        *) RESULT="FAIL (exit $RC)" ;;
    esac
    if ((RC != 0)); then
        echo "---- last lines of $log:"
        tail -n 15 "$log" | sed 's/^/    /'
    fi
}

# -- 2. the venv -------------------------------------------------------------------------------------

# A Python of 3.11 or newer that can make venvs: --python, else the first of these that can.
find_python() {
    local candidate
    for candidate in ${PYTHON:-python3 python3.13 python3.12 python3.11}; do
        if "$candidate" -c 'import sys, venv, ensurepip; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; then
            command -v "$candidate"
            return 0
        fi
    done
    return 1
}

# install_packages PLATFORM VENV PYTHON ROOT CUDA_MAJOR (run under `timeout` in a bash of its own)
install_packages() {
    set -euo pipefail
    local platform=$1 venv=$2 python=$3 root=$4 cuda=$5
    local py=$venv/bin/python stamp=$venv/.accelerator-check want
    # Beside the checkout (a venv made without them is made again): parity.py trains a Flax model with Optax.
    local packages=(pytest flax optax)
    want="$platform${cuda:+ cuda$cuda} ${packages[*]} $(sha256sum "$root/pyproject.toml" | cut -d' ' -f1)"
    if [[ -x $py && -f $stamp && $(cat "$stamp") == "$want" ]]; then
        echo "reusing $venv (installed for $want)"
        return 0
    fi
    [[ -x $py ]] || "$python" -m venv "$venv"
    rm -f "$stamp"
    local pip=("$py" -m pip install --progress-bar off --disable-pip-version-check)
    "${pip[@]}" --upgrade pip
    "${pip[@]}" -e "$root" "${packages[@]}"
    local jax jaxlib
    jax=$("$py" -c 'from importlib.metadata import version; print(version("jax"))')
    jaxlib=$("$py" -c 'from importlib.metadata import version; print(version("jaxlib"))')
    case $platform in
        cuda) "${pip[@]}" "jax-cuda$cuda-plugin[with-cuda]==$jaxlib" "jax-cuda$cuda-pjrt==$jaxlib" \
            "jax==$jax" "jaxlib==$jaxlib" ;;
        tpu) "${pip[@]}" -e "${root}[tpu]" "jax[tpu]==$jax" "jaxlib==$jaxlib" ;;
    esac
    echo "$want" >"$stamp"
}

# -- 4. the cluster ----------------------------------------------------------------------------------

# start_cluster LIMIT: `pathways-nb up` in the background (its own process group); waits for its address.
start_cluster() {
    local limit=$1 waited=0
    rm -rf "$CLUSTER_DIR"
    setsid "$VENV/bin/pathways-nb" up --islands 1 --devices_per_host "$N" --platform "$PLATFORM" \
        --server_port 0 --output "$CLUSTER_DIR" --keep_logs >"$OUT/cluster-up.log" 2>&1 &
    UP_PID=$!
    while ((waited < limit)); do
        if [[ -s $CLUSTER_DIR/address ]]; then
            ADDRESS=$(cat "$CLUSTER_DIR/address")
            return 0
        fi
        kill -0 "$UP_PID" 2>/dev/null || return 1
        sleep 1
        waited=$((waited + 1))
    done
    return 124
}

# Stops `up` (SIGTERM: it stops its processes), then its process group if it has not ended in 30 s.
stop_cluster() {
    [[ -n $UP_PID ]] || return 0
    local pid=$UP_PID waited=0
    UP_PID=""
    kill -TERM "$pid" 2>/dev/null || return 0
    while kill -0 "$pid" 2>/dev/null && ((waited < 30)); do
        sleep 1
        waited=$((waited + 1))
    done
    if kill -0 "$pid" 2>/dev/null; then
        kill -KILL -- "-$pid" 2>/dev/null || true
        return 1
    fi
    wait "$pid" 2>/dev/null || true
}

# -- 5. the smoke against the cluster -----------------------------------------------------------------

write_smoke() {
    cat >"$OUT/smoke.py" <<'PYTHON'
"""The accelerator check's smoke: a cluster's devices through pathways_nb.connect, computing right."""

import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import pathways_nb

address, expected_platform, expected_count = sys.argv[1], sys.argv[2], int(sys.argv[3])
began = time.perf_counter()
pathways_nb.connect(address, timeout_s=60, progress=False)
devices = jax.devices("proxy")
kind = devices[0].device_kind
print(f"ok: connected in {time.perf_counter() - began:.1f} s: {len(devices)} x {devices[0].platform} ({kind})")
assert re.fullmatch(expected_platform, devices[0].platform), (devices[0].platform, expected_platform)
assert len(devices) == expected_count, (len(devices), expected_count)

rng = np.random.default_rng(0)
a = rng.standard_normal((512, 512), np.float32) / 16
b = rng.standard_normal((512, 512), np.float32) / 16
expected = a.astype(np.float64) @ b.astype(np.float64)
matmul = jax.jit(lambda a, b: jnp.matmul(a, b, precision=jax.lax.Precision.HIGHEST))
began = time.perf_counter()
got = np.asarray(matmul(jax.device_put(a, devices[0]), jax.device_put(b, devices[0])))
np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
print(f"ok: jitted 512x512 matmul (precision HIGHEST) = numpy's, {time.perf_counter() - began:.2f} s with compile")
fast = np.asarray(jax.jit(jnp.matmul)(jax.device_put(a, devices[0]), jax.device_put(b, devices[0])))
print(f"ok: at the default precision, the largest difference from numpy is {np.abs(fast - expected).max():.2g}")

mesh = jax.sharding.Mesh(np.array(devices), ("x",))
rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x", None))
x = rng.standard_normal((64 * len(devices), 256), np.float32)
w = rng.standard_normal((256, 128), np.float32) / 16
step = jax.jit(
    lambda x, w: jnp.tanh(jnp.matmul(x, w, precision=jax.lax.Precision.HIGHEST)).sum(axis=0),
    in_shardings=(rows, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())),
)
got = np.asarray(step(jax.device_put(x, rows), w))
np.testing.assert_allclose(got, np.tanh(x.astype(np.float64) @ w).sum(axis=0), rtol=1e-3, atol=1e-3)
print(f"ok: a jit sharded over all {len(devices)} devices (rows split, a sum across them) = numpy's")

host = rng.random(16 << 20, dtype=np.float32)  # 64 MiB
began = time.perf_counter()
on_device = jax.device_put(host, devices[-1]).block_until_ready()
up = time.perf_counter() - began
began = time.perf_counter()
back = np.asarray(on_device)
down = time.perf_counter() - began
assert back.tobytes() == host.tobytes()
print(f"ok: 64 MiB round trip bitwise, host -> device {0.0671 / up:.2f} GB/s, device -> host {0.0671 / down:.2f} GB/s")


def loss(params, x):
    for w in params:
        x = jnp.tanh(x @ w)
    return jnp.mean(x**2)


params = [rng.standard_normal((128, 128), np.float32) / 11 for _ in range(3)]
batch = rng.standard_normal((32, 128), np.float32)
grad = jax.jit(jax.grad(loss))
with jax.default_matmul_precision("highest"):
    remote = grad(jax.device_put(params, devices[0]), jax.device_put(batch, devices[0]))
    local = grad(jax.device_put(params, jax.devices("cpu")[0]), jax.device_put(batch, jax.devices("cpu")[0]))
for r, l in zip(remote, local, strict=True):
    np.testing.assert_allclose(np.asarray(r), np.asarray(l), rtol=1e-3, atol=1e-6)
print("ok: the gradient of a 3-layer MLP = local CPU JAX's")
pathways_nb.disconnect()
print(f"smoke: 6 checks passed on {len(devices)} x {kind}")
PYTHON
}

# run_jax_slice PYTHON JAXSUITE_DIR ADDRESS: shared/jaxsuite's runner against ADDRESS (its knobs in the
# environment), after installing what JAX's tests need into PYTHON's environment if it lacks them.
run_jax_slice() {
    set -euo pipefail
    local py=$1 dir=$2 address=$3
    if ! "$py" -c "import scipy, xdist, hypothesis, absl, pytest_timeout" 2>/dev/null; then
        "$py" -m pip install --progress-bar off --disable-pip-version-check scipy pytest-xdist pytest-timeout \
            hypothesis absl-py
    fi
    exec "$py" "$dir/runner/run_slice.py" "$address"
}

# -- 6. the summary ----------------------------------------------------------------------------------

# bench_output LOG: a step's results: its output less the clients' and servers' log lines (and, for the
# JAX test slice, less pip's).
bench_output() {
    if [[ $1 == */jaxsuite.log ]]; then
        sed -n '/^== results/,$p' "$1"
    else
        grep -v -E '^[WIEF][0-9]{4} |^\s*$|insecure|^\*\*\*' "$1" 2>/dev/null | tail -n 40 || true
    fi
}

write_summary() {
    local versions="" total
    total=$(since "$STARTED")
    if [[ -x $PY ]]; then
        versions=$("$PY" -c 'import sys; from importlib.metadata import version as v
print("python", sys.version.split()[0] + ", jax", v("jax") + ", jaxlib", v("jaxlib"))' 2>/dev/null || true)
    fi
    {
        echo "# Accelerator check, $(date -u '+%Y-%m-%d %H:%M UTC')"
        echo
        echo "- host: $(hostname), $(nproc) cores; platform: $PLATFORM (detected: ${DETECTED:-none}); ${N:-?} device(s)${KIND:+ ($KIND)}"
        echo "- checkout: $(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo '?')$(git -C "$ROOT" diff --quiet 2>/dev/null || echo ' (with local changes)'); ${versions:-no venv}"
        echo "- total wall time: $total s of a $BUDGET_S s budget; everything in $OUT"
        echo
        echo "| step | result | seconds | notes |"
        echo "|---|---|---:|---|"
        local i
        for i in "${!STEPS[@]}"; do
            echo "| ${STEPS[i]} | ${RESULTS[i]} | ${TIMES[i]} | ${NOTES[i]} |"
        done
        local name log
        for name in smoke parity proxy_vs_local jaxsuite; do
            log=$OUT/$name.log
            [[ -s $log ]] || continue
            echo
            echo "### $name (${log#"$OUT"/})"
            echo
            echo '```text'
            bench_output "$log"
            echo '```'
        done
    } >"$OUT/summary.md"
}

FINISHED=0
finish() {
    local rc=$?
    ((FINISHED)) && return 0
    FINISHED=1
    trap - EXIT INT TERM
    if [[ -n $UP_PID ]]; then
        local began=$EPOCHREALTIME
        if stop_cluster; then
            record "cluster stop (on exit)" pass "$(since "$began")" "exit status $rc"
        else
            record "cluster stop (on exit)" "FAIL (killed)" "$(since "$began")" "exit status $rc"
        fi
    fi
    write_summary
    echo
    cat "$OUT/summary.md"
    echo
    echo "(written to $OUT/summary.md; all output in $OUT/check.log)"
    if ((rc == 0 && FAILED)); then rc=1; fi
    exit "$rc"
}
on_signal() {
    say "interrupted"
    if [[ -n $CHILD_PID ]]; then
        kill -TERM "$CHILD_PID" 2>/dev/null || true
        wait "$CHILD_PID" 2>/dev/null || true
    fi
    record "interrupted" "FAIL (signal)" 0 "the check was stopped before its end"
    exit 130
}
trap finish EXIT
trap on_signal INT TERM

# -- the run -----------------------------------------------------------------------------------------

say "accelerator check: platform $PLATFORM (detected: ${DETECTED:-none}), budget $BUDGET_S s, results in $OUT"
record detect pass 0 "${DETECTED:-none found}; running --platform $PLATFORM${DEVICES_NOTE:+; $DEVICES_NOTE}"

# 2. venv + install
VENV_OK=0
if ! HOST_PYTHON=$(find_python); then
    record "venv + install" "FAIL" 0 "no Python 3.11 or newer with venv and ensurepip (--python PATH gives one)"
else
    run_step "venv + install" "$(limit_for 360)" "$OUT/install.log" \
        bash -c "$(declare -f install_packages); install_packages \"\$@\"" _ "$PLATFORM" "$VENV" "$HOST_PYTHON" "$ROOT" \
        "$([[ $PLATFORM == cuda ]] && echo "$CUDA_MAJOR")"
    note="$($HOST_PYTHON --version 2>&1) -> ${VENV/#"$ROOT"\//}"
    grep -q '^reusing ' "$OUT/install.log" 2>/dev/null && note+=" (reused)"
    record "venv + install" "$RESULT" "$SECONDS_TAKEN" "$note"
    [[ $RC == 0 ]] && VENV_OK=1
fi

# 3. local JAX sees the device
KIND=""
if ((VENV_OK)); then
    local_env=(env "JAX_PLATFORMS=$PLATFORM")
    [[ $PLATFORM == cpu ]] && local_env+=("JAX_NUM_CPU_DEVICES=${DEVICES:-2}")
    run_step "local JAX" "$(limit_for 120)" "$OUT/local-jax.log" "${local_env[@]}" "$PY" -c '
import jax
d = jax.devices()
print(f"LOCAL {d[0].platform} {len(d)} {d[0].device_kind}")'
    seen=$(grep '^LOCAL ' "$OUT/local-jax.log" 2>/dev/null | tail -n 1 || true)
    read -r _ local_platform local_count KIND <<<"${seen:-LOCAL ? 0 }" || true
    if [[ $RC == 0 && ! $local_platform =~ ^($EXPECTED)$ ]]; then
        RESULT="FAIL (platform $local_platform)"
    fi
    record "local JAX" "$RESULT" "$SECONDS_TAKEN" "${local_count} x ${local_platform} (${KIND:-?})"
    if [[ -z $N ]]; then
        N=$local_count
        [[ $N == 0 && $PLATFORM == cuda ]] && N=$GPU_COUNT
        [[ $N == 0 ]] && N=1
    fi
else
    record "local JAX" "skipped: no venv" 0 ""
fi

# 4. the cluster
if ((VENV_OK)); then
    limit=$(limit_for 150)
    if ((limit < MIN_STEP_S)); then
        record "cluster up" "skipped: budget spent (--budget_s $BUDGET_S)" 0 ""
    else
        say "cluster up: pathways-nb up --islands 1 --devices_per_host $N --platform $PLATFORM (at most $limit s)"
        began=$EPOCHREALTIME
        rc=0
        start_cluster "$limit" || rc=$?
        case $rc in
            0) record "cluster up" pass "$(since "$began")" "$ADDRESS, 1 island x 1 host x $N $PLATFORM device(s)" ;;
            124) record "cluster up" "timeout ($limit s)" "$(since "$began")" "see cluster-up.log, cluster/logs/" ;;
            *) record "cluster up" "FAIL (up ended)" "$(since "$began")" "$(tail -n 1 "$OUT/cluster-up.log")" ;;
        esac
        if ((rc != 0)); then
            tail -n 15 "$OUT/cluster-up.log" | sed 's/^/    /'
            stop_cluster || true
        fi
    fi
else
    record "cluster up" "skipped: no venv" 0 ""
fi

# 5a. the smoke
if [[ -n $ADDRESS ]]; then
    write_smoke
    run_step "smoke (connect, jit, sharding, transfers, grad)" "$(limit_for 150)" "$OUT/smoke.log" \
        "$PY" "$OUT/smoke.py" "$CLUSTER_DIR/address" "$EXPECTED" "$N"
    record "smoke (connect, jit, sharding, transfers, grad)" "$RESULT" "$SECONDS_TAKEN" \
        "$(grep -E '^smoke:|Error|assert' "$OUT/smoke.log" 2>/dev/null | tail -n 1 || true)"
else
    record "smoke (connect, jit, sharding, transfers, grad)" "skipped: no cluster" 0 ""
fi

# 5b. tests/
record "tests/ (pytest)" "skipped: cannot target this cluster" 0 \
    "tests/conftest.py starts its own CPU servers and compares bitwise with local CPU: the smoke stands in"

# 5c. JAX's own test slice (optional)
if [[ -z ${JAXSUITE_DIR:-} ]]; then
    record "JAX test slice" "skipped: JAXSUITE_DIR not set" 0 "optional: a copy of shared/jaxsuite with JAX's tests"
elif [[ ! -d $JAXSUITE_DIR/tests || ! -f $JAXSUITE_DIR/runner/run_slice.py ]]; then
    record "JAX test slice" "skipped: no tests/ in JAXSUITE_DIR" 0 "bring JAX's tests in ($JAXSUITE_DIR/README.md)"
elif [[ -z $ADDRESS ]]; then
    record "JAX test slice" "skipped: no cluster" 0 ""
else
    # Its own venv (README step 2) if it has one, else ours with what its tests need.
    slice_py=$JAXSUITE_DIR/venv/bin/python
    slice_env=(env)
    if [[ ! -x $slice_py ]]; then
        slice_py=$PY
        slice_env+=(NO_SHIM=1)
    fi
    # Leaves the benchmarks about 4 minutes (2 in cpu mode).
    limit=$(limit_for "${JAXSUITE_CAP_S:-180}" "$([[ $PLATFORM == cpu ]] && echo 120 || echo 240)")
    mkdir -p "$OUT/jaxsuite"
    [[ -f $JAXSUITE_DIR/results/baseline_slice.json ]] && cp "$JAXSUITE_DIR/results/baseline_slice.json" "$OUT/jaxsuite/"
    run_step "JAX test slice" "$limit" "$OUT/jaxsuite.log" "${slice_env[@]}" VENV_PY="$slice_py" \
        RESULTS_DIR="$OUT/jaxsuite" NUM_DEVICES="$N" RUN_TIMEOUT=$((limit > 60 ? limit - 30 : 30)) \
        SLICE_TEST_TIMEOUT=60 bash -c "$(declare -f run_jax_slice); run_jax_slice \"\$@\"" _ \
        "$slice_py" "$JAXSUITE_DIR" "$ADDRESS"
    # It passes when the runner finishes: how many of JAX's tests pass is in the notes.
    [[ $RESULT == pass ]] && RESULT="done"
    note=$(grep -E '^[0-9]+ passed, ' "$OUT/jaxsuite.log" 2>/dev/null | tail -n 1 || true)
    grep -q 'exceeded RUN_TIMEOUT' "$OUT/jaxsuite.log" 2>/dev/null && note+="; cut at its time limit (not run: crashed)"
    record "JAX test slice" "$RESULT" "$SECONDS_TAKEN" "$note"
fi

# The cluster stops before the benchmarks, which start servers of their own.
if [[ -n $UP_PID ]]; then
    began=$EPOCHREALTIME
    if stop_cluster; then
        errors=$(cat "$CLUSTER_DIR"/logs/*.log 2>/dev/null | grep -c -E '^E[0-9]{4} |ERROR|Traceback' || true)
        record "cluster stop" pass "$(since "$began")" "$errors error line(s) in cluster/logs/"
    else
        record "cluster stop" "FAIL (killed after 30 s)" "$(since "$began")" "see cluster-up.log"
    fi
fi

# 5d, 5e. the benchmarks
# has_platform SCRIPT: whether a benchmark takes --platform (another change may give it one).
has_platform() {
    local help
    help=$("$PY" "$ROOT/benchmarks/$1" --help 2>&1 || true)
    [[ $help == *--platform* ]]
}

# Adds --platform to the array named $2 when the benchmark $1 has that option; PLATFORM_NOTE says which.
add_platform() {
    local -n benchmark_args=$2
    PLATFORM_NOTE=""
    if has_platform "$1"; then
        benchmark_args+=(--platform "$PLATFORM")
        PLATFORM_NOTE=", --platform $PLATFORM"
    elif [[ $PLATFORM != cpu ]]; then
        PLATFORM_NOTE="; CPU servers vs CPU local JAX: $1 has no --platform"
    fi
}

if ((VENV_OK)); then
    if [[ $PLATFORM == cpu ]]; then
        parity_args=(--targets_ms "2.3,10" --seconds 0.5 --rounds 1)
    else
        parity_args=(--targets_ms "0.5,1,2.3,5,10" --seconds 1 --rounds 3)
    fi
    add_platform parity.py parity_args
    parity_note="--targets_ms ${parity_args[1]}$PLATFORM_NOTE"
    run_step "parity.py" "$(limit_for 240 60)" "$OUT/parity.log" \
        "$PY" "$ROOT/benchmarks/parity.py" "${parity_args[@]}"
    at_parity=$(grep -E 'at or above' "$OUT/parity.log" 2>/dev/null | sed -e 's/ (the paper.*//' -e 's/ at or above / >= /' \
        -e 's/ of local / /' | paste -sd';' - | sed 's/;/; /g' || true)
    record "parity.py" "$RESULT" "$SECONDS_TAKEN" "$parity_note${at_parity:+; $at_parity}"

    pvl_args=(--quick)
    add_platform proxy_vs_local.py pvl_args
    pvl_note="--quick$PLATFORM_NOTE"
    run_step "proxy_vs_local.py" "$(limit_for 150)" "$OUT/proxy_vs_local.log" \
        "$PY" "$ROOT/benchmarks/proxy_vs_local.py" "${pvl_args[@]}"
    record "proxy_vs_local.py" "$RESULT" "$SECONDS_TAKEN" "$pvl_note"
else
    record "parity.py" "skipped: no venv" 0 ""
    record "proxy_vs_local.py" "skipped: no venv" 0 ""
fi

say "done"
