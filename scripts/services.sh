#!/usr/bin/env bash
# Makes sure the services the tests use are up: PostgreSQL, PgBouncer in
# transaction pooling mode in front of it, and NATS with JetStream. Starts
# what is installed but down, installs PgBouncer when it is missing, and
# changes nothing that already works. Run it at the repository's root, or
# from anywhere as bash path/to/scripts/services.sh.
#
# When DATABASE_URL is not set and its default (the local server's postgres
# role, database "test") refuses the login, it creates, only if absent, a
# dedicated role and database for the tests, idempotency_test, and uses
# them; it says what it created and never alters an existing role or
# database.
#
# Sourced by scripts/test.sh, it exports DATABASE_URL and PGBOUNCER_URL,
# and sets started_pgbouncer to the pid of a PgBouncer it started.
set -euo pipefail

default_url=postgres://postgres:postgres@127.0.0.1:5432/test?sslmode=disable
dedicated_url=postgres://idempotency_test:idempotency_test@127.0.0.1:5432/idempotency_test?sslmode=disable
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
started_pgbouncer=""

log() { printf 'services: %s\n' "$*" >&2; }
done_=() # what each service's check found or did, for the one-line summary
did() { done_+=("$*"); }

wait_for() { # wait_for SECONDS CMD...
	local deadline=$((SECONDS + $1)); shift
	until "$@" >/dev/null 2>&1; do
		if ((SECONDS >= deadline)); then return 1; fi
		sleep 0.5
	done
}

as_postgres() { # runs a command as the postgres OS user
	if [ "$(id -un)" = postgres ]; then "$@"
	elif command -v runuser >/dev/null; then runuser -u postgres -- "$@"
	else su postgres -s /bin/sh -c "$(printf '%q ' "$@")"
	fi
}

can_login() { psql "$1" -qAtc 'SELECT 1' >/dev/null 2>&1; }

postgres() {
	if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
		if ! command -v pg_ctlcluster >/dev/null || [ ! -d /etc/postgresql ]; then
			log "PostgreSQL is not reachable on 127.0.0.1:5432 and no local cluster is installed."
			log "Install PostgreSQL (apt-get install postgresql) or set DATABASE_URL."
			return 1
		fi
		local version
		version=$(ls /etc/postgresql | sort -V | tail -n 1)
		log "starting PostgreSQL $version"
		pg_ctlcluster --skip-systemctl-redirect "$version" main start || true
		wait_for 60 pg_isready -q -h 127.0.0.1 -p 5432 || { log "PostgreSQL did not start"; return 1; }
	fi
	if [ -n "${DATABASE_URL:-}" ]; then
		can_login "$DATABASE_URL" || { log "cannot log in with DATABASE_URL (password not shown); fix it or unset it"; return 1; }
		return 0
	fi
	if can_login "$default_url"; then
		DATABASE_URL=$default_url
		return 0
	fi
	# The local server refuses the default login (password or peer
	# authentication): use a role and database of the tests' own.
	if ! can_login "$dedicated_url"; then
		local psql=(psql -v ON_ERROR_STOP=1 -qAt -d postgres)
		if [ -z "$(as_postgres "${psql[@]}" -c "SELECT 1 FROM pg_roles WHERE rolname = 'idempotency_test'")" ]; then
			as_postgres "${psql[@]}" -c "CREATE ROLE idempotency_test LOGIN PASSWORD 'idempotency_test'"
			log "created the role idempotency_test (password idempotency_test) for the tests"
		fi
		if [ -z "$(as_postgres "${psql[@]}" -c "SELECT 1 FROM pg_database WHERE datname = 'idempotency_test'")" ]; then
			as_postgres "${psql[@]}" -c "CREATE DATABASE idempotency_test OWNER idempotency_test"
			log "created the database idempotency_test, owned by idempotency_test"
		fi
		can_login "$dedicated_url" || {
			log "cannot log in as idempotency_test on 127.0.0.1: allow it in pg_hba.conf (host idempotency_test idempotency_test 127.0.0.1/32 scram-sha-256), or set DATABASE_URL"
			return 1
		}
	fi
	DATABASE_URL=$dedicated_url
}

# pgbouncer makes PGBOUNCER_URL name a PgBouncer in transaction pooling mode
# in front of DATABASE_URL's database. A PGBOUNCER_URL given is used as it
# is. Otherwise it reuses the PgBouncer this checkout started before, or
# starts one on a free port: its files live in a directory of this checkout
# (.services/pgbouncer; under /tmp when the postgres user cannot reach the
# checkout), and .services/pgbouncer.url tells the tests where it listens.
# It never stops a process it did not start; scripts/test.sh stops the one
# it started.
pgbouncer() {
	local user db
	user=$(url_part user); db=$(url_part dbname)
	if [ -n "${PGBOUNCER_URL:-}" ]; then
		can_login "${PGBOUNCER_URL%%&default_query_exec_mode=*}" || {
			log "cannot log in through PGBOUNCER_URL (password not shown); fix it, or unset it and a PgBouncer of this checkout's own is started"
			return 1
		}
		did "PgBouncer from PGBOUNCER_URL"
		return 0
	fi
	local state=$root/.services dir
	mkdir -p "$state"
	dir=$(pgbouncer_dir "$state")
	local pidfile=$dir/pgbouncer.pid urlfile=$state/pgbouncer.url pid=""
	pid=$(cat "$pidfile" 2>/dev/null || true)
	if ours "$pid" "$dir" && [ -f "$urlfile" ] && can_login "$(sed 's/&default_query_exec_mode=.*//' "$urlfile")"; then
		PGBOUNCER_URL=$(cat "$urlfile")
		export PGBOUNCER_URL
		did "PgBouncer of this checkout reused (pid $pid, port $(port_of "$PGBOUNCER_URL"))"
		return 0
	fi
	if ours "$pid" "$dir"; then # ours, but it does not answer
		log "pgbouncer: stopping this checkout's unresponsive pgbouncer $pid"
		kill "$pid" 2>/dev/null || true
		wait_for 10 bash -c "! kill -0 $pid" || kill -9 "$pid" 2>/dev/null || true
	fi
	rm -f "$pidfile" "$urlfile"
	if ! type -P pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ]; then
		log "installing pgbouncer (apt-get install pgbouncer)"
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer >/dev/null || { log "could not install pgbouncer"; return 1; }
	fi
	local bin port url
	bin=$(type -P pgbouncer || echo /usr/sbin/pgbouncer)
	for port in $(seq 16432 16531); do
		if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then continue; fi # taken
		write_pgbouncer_ini "$dir" "$port" "$db" "$user"
		# PgBouncer refuses to run as root.
		if [ "$(id -u)" = 0 ]; then as_postgres "$bin" -q -d "$dir/pgbouncer.ini"; else "$bin" -q -d "$dir/pgbouncer.ini"; fi 2>>"$dir/start.log" || continue
		url="postgres://$user@127.0.0.1:$port/$db?sslmode=disable&default_query_exec_mode=exec"
		if answers "${url%%&default_query_exec_mode=*}" "$dir"; then
			PGBOUNCER_URL=$url
			export PGBOUNCER_URL
			printf '%s\n' "$url" >"$urlfile"
			started_pgbouncer=$(cat "$pidfile")
			did "PgBouncer started on 127.0.0.1:$port (pid $started_pgbouncer, files in $dir)"
			return 0
		fi
		# Another program took the port first, or it failed: see its log.
		pid=$(cat "$pidfile" 2>/dev/null || true)
		if ours "$pid" "$dir"; then kill "$pid" 2>/dev/null || true; fi
		rm -f "$pidfile"
	done
	log "pgbouncer did not start on any port of 16432-16531; see $dir/pgbouncer.log and $dir/start.log"
	return 1
}

# answers URL DIR waits until a login through URL works (0) or the
# PgBouncer of DIR is gone (1), 15 seconds at most.
answers() {
	local deadline=$((SECONDS + 15)) pid
	while ((SECONDS < deadline)); do
		if can_login "$1"; then return 0; fi
		pid=$(cat "$2/pgbouncer.pid" 2>/dev/null || true)
		if [ -n "$pid" ] && ! kill -0 "$pid" 2>/dev/null; then return 1; fi
		sleep 0.2
	done
	return 1
}

# pgbouncer_dir STATE prints the directory of this checkout's PgBouncer:
# STATE/pgbouncer when the postgres user (as whom PgBouncer runs when the
# script runs as root) can write there, else one under /tmp named after the
# checkout.
pgbouncer_dir() {
	local dir=$1/pgbouncer
	mkdir -p "$dir"
	if [ "$(id -u)" = 0 ]; then
		chmod a+rwx "$dir"
		if ! as_postgres test -w "$dir"; then
			dir=/tmp/idempotency-pgbouncer-$(printf '%s' "$root" | cksum | cut -d' ' -f1)
			mkdir -p "$dir"
			chmod a+rwx "$dir"
		fi
	fi
	printf '%s' "$dir"
}

# ours PID DIR: PID is a pgbouncer running on DIR's configuration, which
# only this checkout writes.
ours() {
	[ -n "$1" ] && kill -0 "$1" 2>/dev/null &&
		tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null | grep -q "pgbouncer.* $2/pgbouncer.ini"
}

write_pgbouncer_ini() { # DIR PORT DB USER
	cat >"$1/pgbouncer.ini" <<INI
[databases]
$3 = host=$(hp=$(url_part hostport); printf '%s' "${hp%:*}") port=$(hp=$(url_part hostport); case $hp in *:*) printf '%s' "${hp##*:}" ;; *) printf 5432 ;; esac) dbname=$3
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $2
unix_socket_dir =
auth_type = trust
auth_file = $1/userlist.txt
pool_mode = transaction
max_client_conn = 500
; Server connections count against PostgreSQL's max_connections, which the
; suite shares with whatever else runs there: a bound, and idle ones closed
; soon.
default_pool_size = 20
max_db_connections = 20
server_idle_timeout = 10
ignore_startup_parameters = extra_float_digits
logfile = $1/pgbouncer.log
pidfile = $1/pgbouncer.pid
INI
	printf '"%s" "%s"\n' "$4" "$(url_part password)" >"$1/userlist.txt"
	chmod a+rw "$1/pgbouncer.ini" "$1/userlist.txt"
}

# url_part FIELD: user, password, hostport or dbname of DATABASE_URL.
url_part() {
	local rest=${DATABASE_URL#*://} userinfo=postgres db
	case $rest in *@*) userinfo=${rest%%@*}; rest=${rest#*@} ;; esac
	db=${rest#*/}; db=${db%%\?*}
	local hostport=${rest%%/*}
	case $1 in
	user) printf '%s' "${userinfo%%:*}" ;;
	password) case $userinfo in *:*) printf '%s' "${userinfo#*:}" ;; esac ;;
	dbname) printf '%s' "${db:-test}" ;;
	hostport) printf '%s' "$hostport" ;;
	esac
}

# port_of URL prints the port of a postgres:// URL.
port_of() { local hp=${1#*@}; hp=${hp%%/*}; printf '%s' "${hp##*:}"; }

nats() {
	if (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; then did "NATS up"; return 0; fi
	if [ ! -x /usr/sbin/nats-server ]; then
		log "NATS is not reachable on 127.0.0.1:4222 and /usr/sbin/nats-server is not installed (apt-get install nats-server)"
		return 1
	fi
	log "starting nats-server with JetStream"
	mkdir -p /var/lib/nats-server /var/log
	start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
		-a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
	wait_for 30 bash -c 'exec 3<>/dev/tcp/127.0.0.1/4222' || { log "NATS did not start"; return 1; }
	did "NATS started"
}

postgres
export DATABASE_URL
did "PostgreSQL up ($(url_part user)@$(url_part hostport)/$(url_part dbname))"
pgbouncer
nats
log "$(IFS=';'; printf '%s' "${done_[*]}" | sed 's/;/; /g')"
