#!/usr/bin/env bash
# The project's test command: starts the services the tests need when they
# are down, then runs every test of every Go module in the repository (the
# library and the examples that live in modules of their own) with the race
# detector. Every module runs even when an earlier one failed; the script
# fails at the end if any did. A PgBouncer it started for the run is
# stopped at the end; one that was already there is left alone.
#
# The tests use at most about 60 of PostgreSQL's connections at once (two
# test binaries at a time, two parallel tests in each, and PgBouncer's 20
# server connections); the script checks that the server has that many
# free before it starts.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/services.sh
if [ -n "$started_pgbouncer" ]; then
	trap 'kill "$started_pgbouncer" 2>/dev/null || true' EXIT
fi

needed=60
free=$(psql "$DATABASE_URL" -qAtc "SELECT current_setting('max_connections')::int - current_setting('superuser_reserved_connections')::int
	- (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')")
if ((free < needed)); then
	echo "test: PostgreSQL has $free connections free; the tests need up to $needed at once." >&2
	echo "test: close other clients of the server, raise max_connections, or set DATABASE_URL to another server." >&2
	exit 1
fi

failed=()
for mod in $(git ls-files --cached --others --exclude-standard -- '*go.mod' | xargs -n1 dirname | sort); do
	echo "==> go test ./... in $mod"
	# -p and -parallel fixed, so that the connections the tests use at
	# once do not grow with the machine's cores.
	if ! (cd "$mod" && go test -race -count=1 -p 2 -parallel 2 -timeout 15m ./...); then
		failed+=("$mod")
	fi
done
if ((${#failed[@]})); then
	echo "FAILED modules: ${failed[*]}" >&2
	exit 1
fi
echo "all modules passed"
