# Sourced by scripts/test.sh before pytest: make Debian's chromium available for the dashboard
# browser test (tests/test_dashboard_browser.py) and require that test to really run.
# Quiet and idempotent: installs only when no chromium is on PATH.
_attnbench_chromium() {
  local exe
  exe="$(command -v chromium || true)"
  if [ -z "$exe" ]; then
    local sudo=""
    [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
    echo "pre-chromium: installing Debian's chromium (one time)" >&2
    if $sudo apt-get update -qq >/dev/null 2>&1 &&
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        chromium >/dev/null 2>&1; then
      exe="$(command -v chromium || true)"
    fi
    # On failure the browser test fails (ATTNBENCH_REQUIRE_BROWSER) and says why; the other
    # tests still run.
    [ -n "$exe" ] || echo "pre-chromium: could not install chromium with apt-get" >&2
  fi
  if [ -n "$exe" ]; then export ATTNBENCH_CHROMIUM="$exe"; fi
  export ATTNBENCH_REQUIRE_BROWSER=1
}
_attnbench_chromium
unset -f _attnbench_chromium
