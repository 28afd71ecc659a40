#!/usr/bin/env bash
# Render the unit for a throwaway workspace and check it the way systemd reads
# it. No running systemd is needed, only systemd-analyze.
#
#   verify    must print nothing: it exits 0 on unknown keys and on many bad
#             values, so any output at all is a failure.
#   security  the exposure score must be at most 2.0.
#
# Also verifies the --user-unit rendering and, when logrotate is installed,
# the logrotate rules. CI runs this; so does tests/test_systemd_unit.py.
# Exit 0 when every check passes, 1 otherwise.
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(dirname "$here")
python=${PYTHON:-$repo/.venv/bin/python}
[ -x "$python" ] || python=python3
# systemd 252 takes the threshold as an integer on its internal 0-100 scale
# (the score it prints, times ten) and refuses "2.0" outright.
max_exposure=${MAX_EXPOSURE:-20}

fail() { echo "check-unit: FAIL: $*" >&2; exit 1; }
command -v systemd-analyze >/dev/null || fail "systemd-analyze not found (apt-get install systemd)"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# A space and a '%' in the workspace path exercise the quoting and the
# specifier escaping: a mistake there makes verify complain.
ws="$tmp/work space %i"
mkdir -p "$ws/runs" "$ws/data" "$ws/prompts" "$tmp/venv/bin" "$tmp/xdg" "$tmp/config"
chmod 700 "$tmp/xdg"
printf '[daemon]\nshutdown_timeout_s = 45\n' >"$ws/config.toml"
# verify checks that ExecStart's program exists and is executable (it does not
# run it): a stub keeps the check independent of where the real venv lives.
printf '#!/bin/sh\nexit 0\n' >"$tmp/venv/bin/skilltrain"
chmod 755 "$tmp/venv/bin/skilltrain"

render() {
    # verify does not look users up, so the recommended "skilltrain" user need
    # not exist here. "nobody" would not do: verify warns about it.
    if ! "$python" -m skilltrain.daemon.commands.service_unit --workspace "$ws" --venv "$tmp/venv" "$@" \
        >"$tmp/render.out" 2>&1; then
        cat "$tmp/render.out" >&2
        fail "rendering failed: install-service $*"
    fi
}

verify() {
    local unit=$1 out
    shift
    if ! out=$(systemd-analyze "$@" verify "$unit" 2>&1) || [ -n "$out" ]; then
        printf '%s\n' "$out" >&2
        fail "systemd-analyze${*:+ $*} verify $(basename "$unit") printed the lines above"
    fi
}

# --- the system unit ---
render --user skilltrain --group skilltrain --output "$tmp/skilltrain.service"
verify "$tmp/skilltrain.service"
if ! report=$(systemd-analyze security --offline=true --threshold="$max_exposure" \
    "$tmp/skilltrain.service" 2>&1); then
    printf '%s\n' "$report" >&2
    fail "exposure above $max_exposure/10 (or security failed to run)"
fi
grep '✗' <<<"$report" || true
score=$(sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p' <<<"$report")
[ -n "$score" ] || fail "no exposure score in: $report"
echo "check-unit: system unit verified; exposure $score (max $((max_exposure / 10)).$((max_exposure % 10)))"

# --- the per-user unit (systemctl --user) ---
render --user-unit --output "$tmp/user/skilltrain.service"
export XDG_RUNTIME_DIR="$tmp/xdg" XDG_CONFIG_HOME="$tmp/config"
verify "$tmp/user/skilltrain.service" --user
user_score=$(systemd-analyze --user security --offline=true "$tmp/user/skilltrain.service" 2>&1 \
    | sed -n 's/.*Overall exposure level for [^:]*: \([0-9.]*\).*/\1/p')
echo "check-unit: user unit verified; exposure ${user_score:-?} (not gated: no User=)"

# --- the logrotate rules ---
if command -v logrotate >/dev/null; then
    # logrotate resolves the su/create accounts, so use ones that exist here.
    render --user root --group root --print --logrotate-output "$tmp/logrotate.conf"
    touch "$ws/runs/skilltrain.jsonl"
    if ! out=$(logrotate --debug --state "$tmp/logrotate.state" "$tmp/logrotate.conf" 2>&1) \
        || grep -qi '^error' <<<"$out"; then
        printf '%s\n' "$out" >&2
        fail "logrotate rejected the rules"
    fi
    echo "check-unit: logrotate rules parsed"
else
    echo "check-unit: logrotate not installed; its rules were not checked"
fi
echo "check-unit: OK"
