# Sourced by scripts/test.sh first: `attnbench_on_exit CMD [ARG...]` registers a clean-up that
# runs when test.sh exits, however it exits (success, failure, Ctrl-C, TERM), latest first.
# The pre steps use it to stop what they started, and only that.
# shellcheck shell=bash
_attnbench_exit_cmds=()
attnbench_on_exit() { _attnbench_exit_cmds+=("$(printf '%q ' "$@")"); }
_attnbench_run_exit_cmds() {
  local i
  for ((i = ${#_attnbench_exit_cmds[@]} - 1; i >= 0; i--)); do
    eval "${_attnbench_exit_cmds[i]}" || true
  done
}
trap _attnbench_run_exit_cmds EXIT
trap 'exit 130' INT
trap 'exit 143' TERM
