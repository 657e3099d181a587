#!/usr/bin/env bash
# What PostgreSQL itself spends on the engine's statement sets, measured by
# pgbench alone (no Go): interleaved rounds of each script against a database
# of its own (pgbench_idempotency, recreated), 8 clients, prepared statements.
# Prints, per script, the median throughput and the median PostgreSQL CPU per
# transaction (user and system time of the server's backends, read from the
# postmaster's reaped children in /proc, so the local server only), and both
# as ratios against plain and floor_lib.
#
#   plain          BEGIN; a business INSERT; COMMIT
#   floor_pk       + one key row pipelined with the COMMIT, a table with only its primary key
#   floor_lib      the same on the library's table (primary key and expiry index): the floor
#   eng_v3         the engine before the row claim: try-lock and lookup, SAVEPOINT; handler; key row, COMMIT
#   eng_row        the issue's row claim: try-lock, INSERT running ON CONFLICT DO NOTHING, SAVEPOINT; handler; UPDATE, COMMIT
#   eng_v4         the engine before eng_v5: one INSERT ... WHERE the session and transaction locks ON CONFLICT DO NOTHING;
#                  handler; the UPDATE (by primary key here: pgbench cannot carry the claim's ctid) releasing the
#                  session lock, in a failing count wrapper, COMMIT
#   eng_v4_cte     eng_v4 with the claim written as a data-modifying CTE (measured, and not taken)
#   eng_v5         eng_v4 with what the claim reports, the claim's SAVEPOINT, the release of the session's
#                  advisory locks in the commit's statement, and the session's reset after the COMMIT
#   eng_v5_noreset              eng_v5 without the session's reset (what the six reset statements cost)
#   eng_v5_noreset_noprepared   the same, and without the look for statements prepared with SQL's PREPARE
#   eng_v5_fnreset              eng_v5 with the reset in one call of a PL/pgSQL function (measured, and not taken)
#   eng_v5_plaininsert          eng_v5 with the claim a plain INSERT, no ON CONFLICT (measured, and not taken)
#   eng_v5_noxactlock           eng_v5 without the claim's transaction-level advisory lock (measured, and not taken)
#
# Usage: run.sh [rounds] [seconds]   (needs the local PostgreSQL; SCRIPTS="..." to choose)
set -u
here=$(cd "$(dirname "$0")" && pwd)
rounds=${1:-6}; secs=${2:-5}; clients=${CLIENTS:-8}
P="psql -h 127.0.0.1 -U postgres -q"
db=pgbench_idempotency
$P -d postgres -c "DROP DATABASE IF EXISTS $db" -c "CREATE DATABASE $db" >/dev/null 2>&1
$P -d $db >/dev/null <<'SQL'
CREATE TABLE ledger (id bigserial PRIMARY KEY, amount bigint NOT NULL, created_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE keys_pk (scope text NOT NULL, key text NOT NULL, method text NOT NULL, fingerprint bytea NOT NULL, state text NOT NULL, response_type text, response bytea, status bytea, metadata bytea, created_at timestamptz NOT NULL DEFAULT now(), completed_at timestamptz, expires_at timestamptz NOT NULL, PRIMARY KEY (scope, key));
CREATE TABLE keys_lib (LIKE keys_pk INCLUDING ALL);
CREATE INDEX ON keys_lib (expires_at);
ALTER TABLE keys_lib SET (fillfactor = 90); -- as migration 004 sets it
CREATE SCHEMA idempotency_bench;
CREATE FUNCTION idempotency_bench.reset_session() RETURNS void LANGUAGE plpgsql AS $$BEGIN
SET SESSION AUTHORIZATION DEFAULT; RESET ALL; EXECUTE 'CLOSE ALL'; DISCARD TEMP; DISCARD SEQUENCES; UNLISTEN *; END$$;
SQL
datadir=$($P -d $db -Atc 'SHOW data_directory')
postmaster=$(head -n 1 "$datadir/postmaster.pid" 2>/dev/null || sudo -u postgres head -n 1 "$datadir/postmaster.pid")
ticks=$(getconf CLK_TCK)
server_cpu() { # utime + stime + cutime + cstime of the postmaster, in ticks
	awk '{sub(/^.*\) /, ""); print $12 + $13 + $14 + $15}' "/proc/$postmaster/stat"
}
scripts=${SCRIPTS:-plain floor_pk floor_lib eng_v3 eng_row eng_v4 eng_v4_cte eng_v5}
declare -A tps cpu
for r in $(seq 1 "$rounds"); do
	set -- $scripts; n=$#; order=""
	for i in $(seq 0 $((n-1))); do j=$(( (i + r) % n + 1 )); order="$order ${!j}"; done
	line="round $r:"
	for s in $order; do
		before=$(server_cpu)
		out=$(pgbench -h 127.0.0.1 -U postgres -n -M prepared -c "$clients" -j 2 -T "$secs" -f "$here/$s.sql" $db 2>&1)
		sleep 0.2 # the backends exit and are reaped
		after=$(server_cpu)
		t=$(printf '%s\n' "$out" | sed -n 's/^tps = \([0-9.]*\).*/\1/p')
		x=$(printf '%s\n' "$out" | sed -n 's/^number of transactions actually processed: \([0-9]*\).*/\1/p')
		c=$(awk -v a="$after" -v b="$before" -v x="$x" -v k="$ticks" 'BEGIN{printf "%.1f", (a-b)/k*1e6/x}')
		tps[$s]="${tps[$s]:-} $t"; cpu[$s]="${cpu[$s]:-} $c"; line="$line $s=${t%.*}/${c}us"
	done
	echo "$line"
done
med() { tr ' ' '\n' | grep -v '^$' | sort -g | awk '{a[NR]=$1} END{print (NR%2)?a[(NR+1)/2]:(a[NR/2]+a[NR/2+1])/2}'; }
p=$(echo ${tps[plain]} | med); f=$(echo ${tps[floor_lib]:-${tps[plain]}} | med)
pc=$(echo ${cpu[plain]} | med); fc=$(echo ${cpu[floor_lib]:-${cpu[plain]}} | med)
printf '%-12s %8s %9s %9s %10s %11s\n' script tps /plain /floor_lib "cpu/tx" "cpu/floor"
for s in $scripts; do
	m=$(echo ${tps[$s]} | med); c=$(echo ${cpu[$s]} | med)
	awk -v s="$s" -v m="$m" -v p="$p" -v f="$f" -v c="$c" -v fc="$fc" 'BEGIN{printf "%-12s %8.0f %8.3fx %8.3fx %8.1fus %10.3fx\n", s, m, m/p, m/f, c, c/fc}'
done
