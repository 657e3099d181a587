#!/usr/bin/env bash
# Makes sure the services the tests use are up: PostgreSQL (with the role,
# password and database of DATABASE_URL's default) and NATS with JetStream.
# Starts what is installed but down; changes nothing that already works.
set -euo pipefail

: "${DATABASE_URL:=postgres://postgres:postgres@127.0.0.1:5432/test?sslmode=disable}"
export DATABASE_URL

log() { printf 'services: %s\n' "$*" >&2; }

wait_for() { # wait_for SECONDS CMD...
	local deadline=$((SECONDS + $1)); shift
	until "$@" >/dev/null 2>&1; do
		if ((SECONDS >= deadline)); then return 1; fi
		sleep 0.5
	done
}

as_postgres() { # runs psql as the postgres OS user, over the local socket
	if [ "$(id -un)" = postgres ]; then psql -v ON_ERROR_STOP=1 -qAt "$@"
	elif command -v runuser >/dev/null; then runuser -u postgres -- psql -v ON_ERROR_STOP=1 -qAt "$@"
	else su postgres -s /bin/sh -c "psql -v ON_ERROR_STOP=1 -qAt $(printf '%q ' "$@")"
	fi
}

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
	if psql "$DATABASE_URL" -qAtc 'SELECT 1' >/dev/null 2>&1; then
		return 0
	fi
	# Reachable but refusing us: on a machine with password or peer auth,
	# give the role the password of the default URL and create the database.
	log "cannot log in with DATABASE_URL; creating role and database as the postgres OS user"
	local user pass db
	user=$(psql_url_part user); pass=$(psql_url_part password); db=$(psql_url_part dbname)
	as_postgres -d postgres -c "DO \$\$ BEGIN
		IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '$user') THEN CREATE ROLE \"$user\" LOGIN SUPERUSER; END IF;
		ALTER ROLE \"$user\" PASSWORD '$pass';
	END \$\$;"
	if [ -z "$(as_postgres -d postgres -c "SELECT 1 FROM pg_database WHERE datname = '$db'")" ]; then
		as_postgres -d postgres -c "CREATE DATABASE \"$db\" OWNER \"$user\""
	fi
	psql "$DATABASE_URL" -qAtc 'SELECT 1' >/dev/null || { log "still cannot connect to $db as $user"; return 1; }
}

# psql_url_part FIELD: user, password or dbname of DATABASE_URL (defaults as in
# the default URL).
psql_url_part() {
	local rest=${DATABASE_URL#*://} userinfo=postgres:postgres db
	case $rest in *@*) userinfo=${rest%%@*}; rest=${rest#*@} ;; esac
	db=${rest#*/}; db=${db%%\?*}
	case $1 in
	user) printf '%s' "${userinfo%%:*}" ;;
	password) case $userinfo in *:*) printf '%s' "${userinfo#*:}" ;; *) printf 'postgres' ;; esac ;;
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
nats
