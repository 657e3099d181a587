package idempotency

import (
	"strings"
)

// statements are the SQL texts of a store, rendered once for its table.
type statements struct {
	lock, lookup, probe      string
	savepoint                string
	rollbackToSavepoint      string
	insert, insertIfAbsent   string
	deleteExpiredKey, extend string
	deleteExpired            string
	inspect, forget          string
}

// renderStatements renders the statements for the table named by ident, a
// quoted and possibly schema-qualified identifier.
func renderStatements(ident string) statements {
	// The advisory lock of a key is a 64-bit hash of the key table's OID,
	// the scope and the key: stores on two tables never share locks, and
	// the lock space of the application's own advisory locks is left alone
	// in all but a 2^-64 chance per pair. The OID is looked up by name on
	// every call (a syscache hit), so a table that was recreated is
	// followed, and a missing table fails with 42P01.
	lockKey := "hashtextextended($2, hashtextextended($1, " + quoteLiteral(ident) + "::regclass::oid::bigint))"
	r := strings.NewReplacer("{{table}}", ident, "{{lock_key}}", lockKey)
	const columns = `method, fingerprint, state, response_type, response, status, metadata, expires_at <= now()`
	return statements{
		// Transaction-scoped: released by COMMIT or ROLLBACK, whatever
		// happens to the process, and safe behind a transaction pooler.
		lock:   r.Replace(`SELECT pg_try_advisory_xact_lock({{lock_key}}), now()`),
		lookup: r.Replace(`SELECT ` + columns + ` FROM {{table}} WHERE scope = $1 AND key = $2`),
		// One statement outside any transaction, for duplicates: the stored
		// result if there is one, and whether the key's lock was free (it
		// is taken and released within the statement). Its snapshot is
		// older than the lock attempt, so "free and no row" is confirmed
		// under the lock before anything runs.
		probe: r.Replace(`SELECT l.free, k.method, k.fingerprint, k.state, k.response_type, k.response, k.status, k.metadata, k.expires_at <= now()
FROM (SELECT pg_try_advisory_xact_lock({{lock_key}}) AS free) l
LEFT JOIN {{table}} k ON k.scope = $1 AND k.key = $2`),
		// Taken after the lock: rolling back to a savepoint releases the
		// locks taken after it, and a final error must keep the key's.
		savepoint:           "SAVEPOINT idempotency_call",
		rollbackToSavepoint: "ROLLBACK TO SAVEPOINT idempotency_call",
		// The one write of a call's key: its result, with the COMMIT. A
		// plain INSERT, so that a row that exists after all (written by a
		// caller that did not take the lock) fails the statement and turns
		// the COMMIT into a ROLLBACK instead of committing the handler's
		// writes without their key. The TTL counts from here.
		insert: r.Replace(insertRow),
		// For a key whose handler ended the transaction itself: outside any
		// transaction, claim the key for the error if nothing else has.
		insertIfAbsent: r.Replace(insertRow + `
ON CONFLICT (scope, key) DO NOTHING`),
		deleteExpiredKey: r.Replace(`DELETE FROM {{table}} WHERE scope = $1 AND key = $2 AND expires_at <= now()`),
		// After a commit that took a large part of the TTL: count the TTL
		// from the commit, so a retry right after the call still replays.
		extend: r.Replace(`UPDATE {{table}} SET expires_at = clock_timestamp() + $3 * interval '1 microsecond'
WHERE scope = $1 AND key = $2 AND expires_at < clock_timestamp() + $3 * interval '1 microsecond'`),
		inspect: r.Replace(`SELECT method, state, created_at, expires_at, expires_at <= now(), response_type, response, status, fingerprint
FROM {{table}} WHERE scope = $1 AND key = $2`),
		forget: r.Replace(`DELETE FROM {{table}} WHERE scope = $1 AND key = $2`),
		// No FOR UPDATE: locking each row first would write a lock record
		// per key to the WAL on top of its delete. Two cleaners racing for
		// the same rows only means one of them deletes fewer.
		deleteExpired: r.Replace(`DELETE FROM {{table}}
WHERE ctid = ANY (ARRAY(SELECT ctid FROM {{table}} WHERE expires_at <= now() ORDER BY expires_at LIMIT $1))
AND expires_at <= now()`),
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
FROM (SELECT clock_timestamp() AS t) c
WHERE 1 / ($11::timestamptz IS NULL OR now() = $11)::int = 1`

// quoteLiteral quotes s as an SQL string literal that means the same
// whatever standard_conforming_strings says.
func quoteLiteral(s string) string {
	return "E'" + strings.NewReplacer(`\`, `\\`, "'", "''").Replace(s) + "'"
}
