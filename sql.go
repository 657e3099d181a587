package idempotency

import (
	"strings"

	"github.com/exactlyonce/idempotency/internal/schema"
)

// statements are the SQL texts of a store, rendered once for its table.
type statements struct {
	lock, lookup, probe              string
	lockSession, holdSession, unlock string
	holdXact                         string
	savepoint, rollbackToSavepoint   string
	sameTransaction                  string
	insert, insertIfAbsent           string
	deleteExpiredKey, extend         string
	deleteExpired                    string
	inspect, lockForget, forget      string
}

// renderStatements renders the statements for the table named by ident, a
// quoted and schema-qualified identifier. Every statement names the table
// with its schema and PostgreSQL's own functions with pg_catalog, so that
// nothing a handler does to the session (SET LOCAL search_path, for a
// tenant's schema) can move the engine's reads and writes elsewhere.
func renderStatements(ident string) statements {
	// The advisory lock of a key is a 64-bit hash of the key table's OID,
	// the scope and the stored key: stores on two tables never share locks,
	// and the lock space of the application's own advisory locks is left
	// alone in all but a 2^-64 chance per pair. The OID is looked up by name
	// on every call (a syscache hit), so a table that was recreated is
	// followed, and a missing table fails with 42P01.
	lockKey := func(key string) string {
		return "pg_catalog.hashtextextended(" + key + ", pg_catalog.hashtextextended($1, " + schema.QuoteLiteral(ident) + "::pg_catalog.regclass::pg_catalog.oid::bigint))"
	}
	r := strings.NewReplacer("{{table}}", ident, "{{lock_key}}", lockKey("$2"), "{{lock_key_k}}", lockKey("k"))
	const columns = `method, fingerprint, state, response_type, response, status, metadata, expires_at <= pg_catalog.now()`
	return statements{
		// Transaction-scoped: released by COMMIT or ROLLBACK, whatever
		// happens to the process, and safe behind a transaction pooler. It
		// also reads the transaction's start (for the INSERT's guard), its
		// isolation level (a lookup is only current at READ COMMITTED
		// unless the key was locked before the transaction began) and
		// whether it can write at all.
		lock: r.Replace(`SELECT pg_catalog.pg_try_advisory_xact_lock({{lock_key}}), pg_catalog.now(),
pg_catalog.current_setting('transaction_isolation') IN ('repeatable read', 'serializable'), pg_catalog.current_setting('transaction_read_only')::bool`),
		lookup: r.Replace(`SELECT ` + columns + ` FROM {{table}} WHERE scope = $1 AND key = $2`),
		// The same lock held by the session, across the end of a
		// transaction: taken before a REPEATABLE READ or SERIALIZABLE
		// transaction begins, so that its snapshot sees whatever the key's
		// previous holder committed, and while a handler holds tx.Conn(), so
		// that a COMMIT it sends there does not let a duplicate in. It is
		// always released in the same round trip that ends the call's
		// transaction, before the COMMIT (see Store.finish), so no pooled
		// connection is ever left holding it.
		lockSession: r.Replace(`SELECT pg_catalog.pg_try_advisory_lock({{lock_key}})`),
		holdSession: r.Replace(`SELECT pg_catalog.pg_advisory_lock({{lock_key}})`),
		// For a transaction that must hold the key until its COMMIT once the
		// session lets go of it; only taken while the session holds the key,
		// so it never waits.
		holdXact: r.Replace(`SELECT pg_catalog.pg_advisory_xact_lock({{lock_key}})`),
		unlock:   r.Replace(`SELECT pg_catalog.pg_advisory_unlock({{lock_key}})`),
		// One statement outside any transaction, for duplicates: the stored
		// result if there is one, and whether the key's lock was free (it
		// is taken and released within the statement). Its snapshot is
		// older than the lock attempt, so "free and no row" is confirmed
		// under the lock before anything runs.
		probe: r.Replace(`SELECT l.free, k.method, k.fingerprint, k.state, k.response_type, k.response, k.status, k.metadata, k.expires_at <= pg_catalog.now()
FROM (SELECT pg_catalog.pg_try_advisory_xact_lock({{lock_key}}) AS free) l
LEFT JOIN {{table}} k ON k.scope = $1 AND k.key = $2`),
		// Taken after the lock: rolling back to a savepoint releases the
		// locks taken after it, and a final error must keep the key's.
		savepoint:           "SAVEPOINT idempotency_call",
		rollbackToSavepoint: "ROLLBACK TO SAVEPOINT idempotency_call",
		// Whether the connection is still in the transaction the claim began
		// at $1, for the paths where the INSERT's guard does not run.
		sameTransaction: `SELECT pg_catalog.now() = $1`,
		// The one write of a call's key: its result, with the COMMIT. A
		// plain INSERT, so that a row that exists after all (written by a
		// caller that did not take the lock) fails the statement and turns
		// the COMMIT into a ROLLBACK instead of committing the handler's
		// writes without their key. The TTL counts from here.
		insert: r.Replace(insertRow),
		// For a key whose call could not commit its result with its writes:
		// outside any transaction, store the key's final error unless
		// another call stored a result first.
		insertIfAbsent: r.Replace(insertRow + `
ON CONFLICT (scope, key) DO NOTHING`),
		deleteExpiredKey: r.Replace(`DELETE FROM {{table}} WHERE scope = $1 AND key = $2 AND expires_at <= pg_catalog.now()`),
		// After a commit that took a large part of the TTL: count the TTL
		// from the commit, so a retry right after the call still replays.
		extend: r.Replace(`UPDATE {{table}} SET expires_at = pg_catalog.clock_timestamp() + $3 * interval '1 microsecond'
WHERE scope = $1 AND key = $2 AND expires_at < pg_catalog.clock_timestamp() + $3 * interval '1 microsecond'`),
		// The first of the stored keys $2 (a key in each transport's
		// namespace) that has a row.
		inspect: r.Replace(`SELECT key, method, state, created_at, expires_at, expires_at <= pg_catalog.now(), response_type, response, status, fingerprint, metadata
FROM {{table}} WHERE scope = $1 AND key = ANY($2::text[]) ORDER BY pg_catalog.array_position($2::text[], key) LIMIT 1`),
		// Forget's: the locks of the stored keys $2 (as Inspect's), all of
		// them free; then the first that has a row is deleted.
		lockForget: r.Replace(`SELECT pg_catalog.bool_and(pg_catalog.pg_try_advisory_xact_lock({{lock_key_k}})) FROM pg_catalog.unnest($2::text[]) AS k`),
		forget: r.Replace(`DELETE FROM {{table}} WHERE scope = $1 AND key = (SELECT key FROM {{table}} WHERE scope = $1 AND key = ANY($2::text[])
ORDER BY pg_catalog.array_position($2::text[], key) LIMIT 1)`),
		// No FOR UPDATE: locking each row first would write a lock record
		// per key to the WAL on top of its delete. Two cleaners racing for
		// the same rows only means one of them deletes fewer.
		deleteExpired: r.Replace(`DELETE FROM {{table}}
WHERE ctid = ANY (ARRAY(SELECT ctid FROM {{table}} WHERE expires_at <= pg_catalog.now() ORDER BY expires_at LIMIT $1))
AND expires_at <= pg_catalog.now()`),
	}
}

// insertRow writes a key's row; created_at is when it was written, and the
// TTL counts from then.
//
// $11, when set, is the start of the call's transaction (its now(), read by
// the claim): if the handler ended that transaction and began another, the
// division by zero fails the statement, and the COMMIT after it turns into
// a ROLLBACK, instead of the key committing apart from the handler's
// earlier writes. It costs nothing, where a RELEASE of the call's savepoint
// (which would fail the same way) costs a statement and a subtransaction
// end.
const insertRow = `INSERT INTO {{table}} (scope, key, method, fingerprint, state, response_type, response, status, metadata, created_at, expires_at)
SELECT $1, $2, $3, $4, $5, NULLIF($6, ''), $7, $8, $10, c.t, c.t + $9 * interval '1 microsecond'
FROM (SELECT pg_catalog.clock_timestamp() AS t) c
WHERE 1 / ($11::timestamptz IS NULL OR pg_catalog.now() = $11)::int = 1`
