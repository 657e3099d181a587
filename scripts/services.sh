#!/usr/bin/env bash
# Makes sure the services the tests use are up: PostgreSQL, PgBouncer in
# transaction pooling mode in front of it, and NATS with JetStream. Starts
# what is installed but down, installs PgBouncer when it is missing, and
# changes nothing that already works.
#
# When DATABASE_URL is not set and its default (the local server's postgres
# role, database "test") refuses the login, it creates, only if absent, a
# dedicated role and database for the tests, idempotency_test, and uses
# them; it says what it created and never alters an existing role or
# database.
#
# Sourced by scripts/test.sh, it exports DATABASE_URL and PGBOUNCER_URL.
set -euo pipefail

default_url=postgres://postgres:postgres@127.0.0.1:5432/test?sslmode=disable
dedicated_url=postgres://idempotency_test:idempotency_test@127.0.0.1:5432/idempotency_test?sslmode=disable
pgbouncer_port=6432

log() { printf 'services: %s\n' "$*" >&2; }

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

# pgbouncer runs PgBouncer 1.18 or later in transaction pooling mode on
# 127.0.0.1:6432, in front of DATABASE_URL's server and database, with its
# files in /tmp/idempotency-pgbouncer.
pgbouncer() {
	local user db
	user=$(url_part user); db=$(url_part dbname)
	export PGBOUNCER_URL=${PGBOUNCER_URL:-postgres://$user@127.0.0.1:$pgbouncer_port/$db?sslmode=disable&default_query_exec_mode=exec}
	if can_login "${PGBOUNCER_URL%%&default_query_exec_mode=*}"; then return 0; fi
	if ! type -P pgbouncer >/dev/null && [ ! -x /usr/sbin/pgbouncer ]; then
		log "installing pgbouncer (apt-get install pgbouncer)"
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq pgbouncer >/dev/null || { log "could not install pgbouncer"; return 1; }
	fi
	local dir=/tmp/idempotency-pgbouncer bin
	bin=$(type -P pgbouncer || echo /usr/sbin/pgbouncer)
	mkdir -p "$dir"
	cat >"$dir/pgbouncer.ini" <<EOF
[databases]
$db = host=127.0.0.1 port=5432 dbname=$db
[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $pgbouncer_port
unix_socket_dir =
auth_type = trust
auth_file = $dir/userlist.txt
pool_mode = transaction
max_client_conn = 500
default_pool_size = 40
ignore_startup_parameters = extra_float_digits
logfile = $dir/pgbouncer.log
pidfile = $dir/pgbouncer.pid
EOF
	printf '"%s" "%s"\n' "$user" "$(url_part password)" >"$dir/userlist.txt"
	chmod -R a+rwX "$dir"
	# A pid file left by an instance of ours that died (or hangs, since it
	# does not answer) would stop the new one from starting.
	if [ -f "$dir/pgbouncer.pid" ]; then
		local old
		old=$(cat "$dir/pgbouncer.pid" 2>/dev/null || true)
		if [ -n "$old" ] && kill -0 "$old" 2>/dev/null && grep -q pgbouncer "/proc/$old/cmdline" 2>/dev/null; then
			log "stopping the unresponsive pgbouncer $old"
			kill "$old" 2>/dev/null || true
			wait_for 10 bash -c "! kill -0 $old" || kill -9 "$old" 2>/dev/null || true
		fi
		rm -f "$dir/pgbouncer.pid"
	fi
	log "starting pgbouncer (transaction pooling) on 127.0.0.1:$pgbouncer_port"
	# PgBouncer refuses to run as root.
	if [ "$(id -u)" = 0 ]; then as_postgres "$bin" -d "$dir/pgbouncer.ini"; else "$bin" -d "$dir/pgbouncer.ini"; fi
	wait_for 30 can_login "${PGBOUNCER_URL%%&default_query_exec_mode=*}" || { log "pgbouncer did not start; see $dir/pgbouncer.log"; return 1; }
}

# url_part FIELD: user, password or dbname of DATABASE_URL.
url_part() {
	local rest=${DATABASE_URL#*://} userinfo=postgres db
	case $rest in *@*) userinfo=${rest%%@*}; rest=${rest#*@} ;; esac
	db=${rest#*/}; db=${db%%\?*}
	case $1 in
	user) printf '%s' "${userinfo%%:*}" ;;
	password) case $userinfo in *:*) printf '%s' "${userinfo#*:}" ;; esac ;;
	dbname) printf '%s' "${db:-test}" ;;
	esac
}

nats() {
	if (exec 3<>/dev/tcp/127.0.0.1/4222) 2>/dev/null; then return 0; fi
	if [ ! -x /usr/sbin/nats-server ]; then
		log "NATS is not reachable on 127.0.0.1:4222 and /usr/sbin/nats-server is not installed (apt-get install nats-server)"
		return 1
	fi
	log "starting nats-server with JetStream"
	mkdir -p /var/lib/nats-server /var/log
	start-stop-daemon --start --oknodo --background --exec /usr/sbin/nats-server -- \
		-a 127.0.0.1 -p 4222 -js -sd /var/lib/nats-server -l /var/log/nats-server.log
	wait_for 30 bash -c 'exec 3<>/dev/tcp/127.0.0.1/4222' || { log "NATS did not start"; return 1; }
}

postgres
export DATABASE_URL
pgbouncer
nats
