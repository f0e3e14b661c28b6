#!/usr/bin/env bash
# What the bench needs besides its Python packages (`pip install -e '.[bench]'`):
# Debian's wrk (the HTTP load generator), redis-server (the baseline) and
# PostgreSQL 15 (pgbench, and the cluster the numbers are measured on).
# Installed when missing, so no comparison is ever skipped for want of a tool.
# bench/run.py runs this itself when something is missing.
set -euo pipefail
missing=()
command -v wrk >/dev/null 2>&1 || missing+=(wrk)
command -v redis-server >/dev/null 2>&1 || [ -x /usr/bin/redis-server ] || missing+=(redis-server)
[ -x /usr/lib/postgresql/15/bin/pgbench ] || missing+=(postgresql-15)
if [ ${#missing[@]} -eq 0 ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "bench/setup.sh: missing ${missing[*]}; run: sudo apt-get install -y ${missing[*]}" >&2
    exit 1
fi
echo "bench/setup.sh: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
apt-get install -y -qq "${missing[@]}" >/dev/null
# The packages start their own services where a service manager runs; the
# bench starts its own servers on free ports and leaves those alone.
