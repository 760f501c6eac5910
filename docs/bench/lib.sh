# Sourced by the scripts in docs/bench, which run from the repository's root: they stop at the first command that
# fails and say which on stderr, with the end of its log where its output went to one.
#   $python   the interpreter: PYTHON if set, else the .venv that `make demo` sets up, else python3
#   logged LOG CMD...       runs CMD with its output in LOG; if it fails, prints LOG's last lines and exits
#   waited PID LOG          waits for a CMD started in the background (`CMD > LOG 2>&1 &`); the same on failure
#   kill_at_exit PID...     a background process (a sampler, a parallel run) ended with the script, however it ends
set -eEuo pipefail
shopt -s inherit_errexit  # command substitutions stop at a failure too
trap 'echo "$0: line $LINENO: exit $? from: $BASH_COMMAND" >&2' ERR
_kill_at_exit=()
trap '[[ ${#_kill_at_exit[@]} -eq 0 ]] || kill "${_kill_at_exit[@]}" 2>/dev/null || true' EXIT

if [[ ! -f pyproject.toml || ! -d lightning_oomb ]]; then
  echo "$0: run it from the repository's root (cd to the folder that holds pyproject.toml)" >&2
  exit 1
fi
if [[ -n ${PYTHON:-} ]]; then python=$PYTHON
elif [[ -x .venv/bin/python ]]; then python=$PWD/.venv/bin/python
else python=python3
fi
if ! "$python" -c "import importlib.util as u, sys
missing = [m for m in ('torch', 'lightning', 'transformers') if u.find_spec(m) is None]
sys.exit(f'{sys.executable} lacks {\", \".join(missing)}' if missing else 0)"; then
  echo "$0: set up .venv with \`make setup\` (or \`make demo\`), or name an interpreter that has lightning_oomb's" \
       "dependencies with PYTHON=..." >&2
  exit 1
fi

_failed() {  # STATUS LOG WHAT...
  local status=$1 log=$2; shift 2
  echo "$0: failed (exit $status): $*" >&2
  echo "--- the last 40 lines of $log:" >&2
  tail -n 40 "$log" >&2 || true
  exit "$status"
}

logged() {
  local log=$1 status=0; shift
  "$@" > "$log" 2>&1 || status=$?
  (( status == 0 )) || _failed "$status" "$log" "$@"
}

waited() {
  local pid=$1 log=$2 status=0
  wait "$pid" || status=$?
  (( status == 0 )) || _failed "$status" "$log" "the run logging to $log"
}

kill_at_exit() { _kill_at_exit+=("$@"); }
