package idempotency

import (
	"strings"

	"github.com/exactlyonce/idempotency/internal/schema"
)

// statements are the SQL texts of a store, rendered once for its table.
type statements struct {
	// table is the key table, quoted and schema-qualified, for the
	// statements built per request (Store.List's).
	table                             string
	claim, finish                     string
	deleteExpiredIfHeld, unlockIfHeld string
	probe, lookup                     string
	abandon, insertFinal              string
	recordStep, stepLock              string
	releaseCheck                      string
	endSession, endSessionWait        string
	claimStatus                       string
	deleteExpiredKey, extend          string
	deleteExpired                     string
	inspect, lockForget, forget       string
	inspectSteps, forgetSteps         string
	forgetFailed                      string
	rolePrivileges                    string
}

// renderStatements renders the statements for the table named by ident, a
// quoted and schema-qualified identifier. Every statement names the table
// with its schema and PostgreSQL's own functions with pg_catalog, so that
// nothing a handler does to the session (SET LOCAL search_path, for a
// tenant's schema) can move the engine's reads and writes elsewhere. No
// statement depends on how the session formats values either: bytea
// columns are read as base64 text and times as microseconds since the
// epoch, and no time is sent, so bytea_output, DateStyle, IntervalStyle,
// TimeZone and extra_float_digits change nothing, in any query mode.
// Parameters carry explicit types, for the query modes that send them
// untyped.
//
// Behind a connection pooler (pooled), the key's lock is the transaction's
// alone: a session's lock would stay on the server connection whenever a
// handler ended the call's transaction, where another client of the
// pooler could inherit it.
func renderStatements(ident string, pooled bool) statements {
	// The advisory lock of a key is a 64-bit hash of the key table's OID,
	// the scope and the stored key: stores on two tables never share locks,
	// and the lock space of the application's own advisory locks is left
	// alone in all but a 2^-64 chance per pair. The OID is looked up by name
	// on every call (a syscache hit), so a table that was recreated is
	// followed, and a missing table fails with 42P01.
	lockKey := func(key string) string {
		return "pg_catalog.hashtextextended(" + key + ", pg_catalog.hashtextextended($1::pg_catalog.text, " + schema.QuoteLiteral(ident) + "::pg_catalog.regclass::pg_catalog.oid::bigint))"
	}
	record := func(alias string) string {
		c := func(col string) string { return alias + col }
		b64 := func(col string) string { return "pg_catalog.encode(" + alias + col + ", 'base64')" }
		return strings.Join([]string{c("method"), b64("fingerprint"), c("state"), c("response_type"), b64("response"), b64("status"), b64("metadata"),
			c("expires_at") + " <= pg_catalog.now()"}, ", ")
	}
	key := lockKey("$2::pg_catalog.text")
	claimLock := "pg_catalog.pg_try_advisory_lock(" + key + ") AND pg_catalog.pg_try_advisory_xact_lock(" + key + ")"
	unlock := "pg_catalog.pg_advisory_unlock(" + key + ")"
	if pooled {
		claimLock, unlock = "pg_catalog.pg_try_advisory_xact_lock("+key+")", "true"
	}
	r := strings.NewReplacer("{{table}}", ident, "{{lock_key}}", key, "{{lock_key_k}}", lockKey("k"),
		"{{record}}", record(""), "{{record_k}}", record("k."), "{{claim_lock}}", claimLock, "{{unlock}}", unlock,
		"{{release_held}}", releaseHeldColumns)
	return statements{
		table: ident,
		// The claim, in one statement, the first of the call's transaction:
		// the key's lock, without waiting for it, and, if it was free, the
		// key's row in the state running. It returns a row only when it
		// inserted one (see statements.missed for the other case), with who
		// made the claim: its transaction, its session's backend and the
		// transaction's start, which tell what became of the claim once
		// its connection is lost (see claimFate).
		//
		// The row is what no handler can undo. It is written in the call's
		// transaction, so a crash or a rollback takes it away with the
		// handler's writes, and a handler that commits the transaction
		// itself (on tx.Conn(), or by any SQL at all) commits the claim
		// with them: a running row that is committed is a key whose handler
		// may have committed anything, which every later caller finds and
		// none runs again (see abandon). The primary key decides: of two
		// writers of one key, the second's INSERT finds the first's row,
		// committed or not. At REPEATABLE READ and SERIALIZABLE, a row
		// committed after the transaction's snapshot fails the INSERT with
		// a serialization failure, and the engine claims again; the INSERT
		// reads no index page with the snapshot, so SERIALIZABLE's conflict
		// tracking stays off the key table.
		//
		// The lock is taken twice, for the session and for the
		// transaction. The session's survives whatever the handler does to
		// the transaction (a ROLLBACK, then statements outside any
		// transaction), so duplicates keep waiting until the engine has
		// settled the key; finish releases it in the statement that stores
		// the result, and the transaction's covers the COMMIT after it. A
		// duplicate that does not get the lock inserts nothing, so it never
		// waits on the holder's uncommitted row. The WHERE is evaluated
		// once, left to right: a session lock not granted asks no more.
		claim: r.Replace(claimInsert + ` FROM (SELECT pg_catalog.clock_timestamp() AS now) t
WHERE {{claim_lock}}
ON CONFLICT (scope, key) DO NOTHING
RETURNING ctid, pg_catalog.current_setting('transaction_isolation') IN ('repeatable read', 'serializable'),
pg_catalog.txid_current(), pg_catalog.pg_backend_pid(), (extract(epoch FROM pg_catalog.now()) * 1000000)::bigint`),
		// After a claim that inserted nothing (the lock was held, or the key
		// has a row), in the same round trip as the call's ROLLBACK: an
		// expired row is deleted if the session got the lock, which is then
		// released, and the key is probed (see probe) for what it holds.
		deleteExpiredIfHeld: r.Replace(`DELETE FROM {{table}} WHERE scope = $1::text AND key = $2::text AND expires_at <= pg_catalog.now()
AND pg_catalog.pg_try_advisory_xact_lock({{lock_key}})`),
		// Releases the session's lock if it holds it: the transaction's try
		// succeeds then (a session's locks do not exclude each other), and
		// fails if another session holds it, which is left alone.
		// After a COMMIT that took a large part of the TTL: count the TTL
		// from its end, so a retry right after the call still replays.
		extend: r.Replace(`UPDATE {{table}} SET expires_at = pg_catalog.clock_timestamp() + $3::bigint * interval '1 microsecond'
WHERE scope = $1::text AND key = $2::text AND expires_at < pg_catalog.clock_timestamp() + $3::bigint * interval '1 microsecond'`),
		unlockIfHeld: r.Replace(`SELECT CASE WHEN pg_catalog.pg_try_advisory_xact_lock({{lock_key}}) THEN pg_catalog.pg_advisory_unlock({{lock_key}}) END`),
		// Before the ROLLBACK that releases a key: whether the transaction
		// is still the claim's ($1, its txid_current), which no handler can
		// fake, and only then the session's advisory locks released (the
		// key's covered by the transaction's lock, which the claim took,
		// until the ROLLBACK) and what the session holds of statements
		// prepared with SQL's PREPARE reported (see releaseHeld). A session
		// that left the claim's transaction may have committed anything
		// since: its key is settled, the lock still held.
		releaseCheck: `SELECT c.claims, CASE WHEN c.claims THEN pg_catalog.pg_advisory_unlock_all() IS NULL END,
EXISTS (SELECT FROM pg_catalog.pg_prepared_statements WHERE from_sql)
FROM (SELECT pg_catalog.txid_current_if_assigned() IS NOT DISTINCT FROM $1::bigint AS claims) c`,
		// The result, written over the claim, with the COMMIT after it; a
		// final error too, once fn's writes are rolled back to the claim's
		// savepoint (see attempt.write), which keeps the claim's row. The
		// row is found by its address (a TID scan reads no index, so
		// SERIALIZABLE tracks no conflict with other keys), and only if
		// this very transaction inserted it: if the handler ended the
		// call's transaction (and began another), no row matches, the
		// division fails the statement, and the COMMIT after it rolls back
		// instead of committing a transaction the engine did not begin.
		// The engine then settles the key (see finishRefused). The
		// session's lock is released with the row, so that it is never
		// left held. The row keeps its expiry unless the call took more
		// than half of its TTL ($9), which then counts from now, in the
		// same commit: a retry right after the call always finds it. (An
		// UPDATE that leaves every indexed column as it was can be a
		// heap-only tuple update.) Once the row is written, the session's
		// other advisory locks are released too, and what the session holds
		// of statements prepared with SQL's PREPARE reported (see
		// releaseHeld): the reset of the call's session, at no statement of
		// its own. It runs after the handler, in its transaction, where a
		// SET LOCAL search_path or a temporary type may shadow a type or an
		// operator of pg_catalog: each is named with its schema.
		finish: r.Replace(`WITH u AS (UPDATE {{table}} SET state = $4::pg_catalog.text,
response_type = CASE WHEN $5::pg_catalog.text OPERATOR(pg_catalog.=) '' THEN NULL ELSE $5::pg_catalog.text END,
response = $6::pg_catalog.bytea, status = $7::pg_catalog.bytea, metadata = $8::pg_catalog.bytea, completed_at = pg_catalog.clock_timestamp(),
expires_at = CASE WHEN expires_at OPERATOR(pg_catalog.<)
  (pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) ($9::bigint OPERATOR(pg_catalog.*) interval '0.5 microsecond'))
  THEN pg_catalog.clock_timestamp() OPERATOR(pg_catalog.+) ($9::bigint OPERATOR(pg_catalog.*) interval '1 microsecond') ELSE expires_at END
WHERE ctid OPERATOR(pg_catalog.=) $3::pg_catalog.tid AND scope OPERATOR(pg_catalog.=) $1::pg_catalog.text
AND key OPERATOR(pg_catalog.=) $2::pg_catalog.text AND xmin OPERATOR(pg_catalog.=) pg_catalog.pg_current_xact_id()::pg_catalog.xid
RETURNING {{unlock}})
SELECT 1 OPERATOR(pg_catalog./) pg_catalog.count(*)::int, {{release_held}} FROM u`),
		// One statement outside any transaction, for duplicates: the stored
		// result if there is one, and whether the key's lock was free (it
		// is taken and released within the statement).
		probe: r.Replace(`SELECT l.free, {{record_k}}
FROM (SELECT pg_catalog.pg_try_advisory_xact_lock({{lock_key}}) AS free) l
LEFT JOIN {{table}} k ON k.scope = $1::text AND k.key = $2::text`),
		// An attempt whose connection was lost: its session ($1, the
		// backend's pid, started before the claim's transaction, which
		// started at $2, in microseconds since the epoch: no later backend
		// with that pid can have) is ended if it still lives, so that
		// nothing it was still running can commit later. First, whether it
		// had left the claim's transaction ($3) for good: it is outside any
		// transaction, or in one with another id or start. A session in a
		// failed transaction block shows neither, and is not taken to have
		// left. A pooler may have handed the checking connection that very
		// backend, idle: it is not ended. endSessionWait waits up to $4
		// milliseconds for the backend to be gone (PostgreSQL 14 and
		// later).
		// Behind a pooler the backend is the pooler's, which hands it to
		// other clients once the claim's transaction ended: it is ended
		// only while still in that transaction (the pooler ends it anyway
		// once the attempt's client is gone), never in another client's.
		endSession:     endSession("a.pid", pooled),
		endSessionWait: endSession("a.pid, $4::bigint", pooled),
		// Then what became of the claim's transaction: committed, aborted,
		// or in progress (its session could not be ended, or it was
		// prepared).
		claimStatus: `SELECT pg_catalog.txid_status($1::bigint)`,
		lookup:      r.Replace(`SELECT {{record}} FROM {{table}} WHERE scope = $1::text AND key = $2::text`),
		// A claim that a handler's own COMMIT made durable is settled as
		// failed with $3, the status that says so, whoever finds it first.
		// Only a committed row can match: another call's claim in progress
		// is invisible.
		abandon: r.Replace(`UPDATE {{table}} SET state = 'failed', response_type = NULL, response = NULL, status = $3::bytea, metadata = NULL,
completed_at = pg_catalog.clock_timestamp() WHERE scope = $1::text AND key = $2::text AND state = 'running'`),
		// A final outcome stored in a transaction of its own, once the
		// claim's is gone (see settle), unless the key has a row or another
		// session holds its lock (a duplicate that took over the key, whose
		// row this would wait for). The transaction's lock, taken here, lets
		// the session release its own before the COMMIT.
		insertFinal: r.Replace(`INSERT INTO {{table}} (scope, key, method, fingerprint, state, response_type, response, status, metadata, created_at, completed_at, expires_at)
SELECT $1::text, $2::text, $3::text, $4::bytea, $5::text, NULLIF($6::text, ''), $7::bytea, $8::bytea, $10::bytea, t.now, t.now, t.now + $9::bigint * interval '1 microsecond'
FROM (SELECT pg_catalog.clock_timestamp() AS now) t WHERE pg_catalog.pg_try_advisory_xact_lock({{lock_key}})
ON CONFLICT (scope, key) DO NOTHING`),
		// A step's outcome (see Step), committed on its own, unless the
		// step has a live record already (another run of it recorded
		// first); an expired one is replaced.
		// The lock of a step (its stored key, "step KEY"), held while the
		// step runs, by the transaction that then records it (see
		// Store.step): the keys' locks space, where no call's key is a
		// step's.
		stepLock: r.Replace(`SELECT pg_catalog.pg_advisory_xact_lock({{lock_key}})`),
		recordStep: r.Replace(`INSERT INTO {{table}} AS k (scope, key, method, fingerprint, state, response_type, response, status, metadata, created_at, completed_at, expires_at)
SELECT $1::text, $2::text, $3::text, $4::bytea, $5::text, NULLIF($6::text, ''), $7::bytea, $8::bytea, $10::bytea, t.now, t.now, t.now + $9::bigint * interval '1 microsecond'
FROM (SELECT pg_catalog.clock_timestamp() AS now) t
ON CONFLICT (scope, key) DO UPDATE SET method = EXCLUDED.method, fingerprint = EXCLUDED.fingerprint, state = EXCLUDED.state,
response_type = EXCLUDED.response_type, response = EXCLUDED.response, status = EXCLUDED.status, metadata = EXCLUDED.metadata,
created_at = EXCLUDED.created_at, completed_at = EXCLUDED.completed_at, expires_at = EXCLUDED.expires_at
WHERE k.expires_at <= pg_catalog.now()`),
		deleteExpiredKey: r.Replace(`DELETE FROM {{table}} WHERE scope = $1::text AND key = $2::text AND expires_at <= pg_catalog.now()`),
		// The first of the stored keys $2 (a key in each transport's
		// namespace) that has a row; times in microseconds since the epoch.
		inspect: r.Replace(`SELECT key, method, state, (extract(epoch FROM created_at) * 1000000)::bigint,
(extract(epoch FROM completed_at) * 1000000)::bigint, (extract(epoch FROM expires_at) * 1000000)::bigint,
expires_at <= pg_catalog.now(), response_type, pg_catalog.encode(response, 'base64'), pg_catalog.encode(status, 'base64'),
pg_catalog.encode(fingerprint, 'base64'), pg_catalog.encode(metadata, 'base64')
FROM {{table}} WHERE scope = $1::text AND key = ANY($2::text[]) ORDER BY pg_catalog.array_position($2::text[], key) LIMIT 1`),
		// The records of the steps of the call whose stored key is $2
		// (see Step and readSteps).
		inspectSteps: r.Replace(`SELECT ` + strings.Join(recordColumns, ", ") + ` FROM {{table}} w
WHERE w.scope = $1::text AND pg_catalog.starts_with(w.key, 'step ') AND w.metadata = $2::bytea ORDER BY w.created_at, w.key`),
		// Forget's, once it deleted a key's record: the records of the
		// steps of the call, whose stored key is one of $2.
		forgetSteps: r.Replace(`DELETE FROM {{table}} WHERE scope = $1::text AND pg_catalog.starts_with(key, 'step ')
AND metadata = ANY (SELECT pg_catalog.convert_to(k, 'UTF8') FROM pg_catalog.unnest($2::text[]) AS k)`),
		// Forget's: the locks of the stored keys $2 (as Inspect's), all of
		// them free; then the first that has a row is deleted.
		lockForget: r.Replace(`SELECT pg_catalog.bool_and(pg_catalog.pg_try_advisory_xact_lock({{lock_key_k}})) FROM pg_catalog.unnest($2::text[]) AS k`),
		forget: r.Replace(`DELETE FROM {{table}} WHERE scope = $1::text AND key = (SELECT key FROM {{table}} WHERE scope = $1::text AND key = ANY($2::text[])
ORDER BY pg_catalog.array_position($2::text[], key) LIMIT 1)`),
		// Forget's of a failure: the record forget would delete, deleted only when
		// its call failed for good; its state either way.
		forgetFailed: r.Replace(`WITH k AS (SELECT key, state FROM {{table}} WHERE scope = $1::text AND key = ANY($2::text[])
ORDER BY pg_catalog.array_position($2::text[], key) LIMIT 1),
d AS (DELETE FROM {{table}} t USING k WHERE t.scope = $1::text AND t.key = k.key AND k.state = 'failed')
SELECT state FROM k`),
		// No FOR UPDATE: locking each row first would write a lock record
		// per key to the WAL on top of its delete. Two cleaners racing for
		// the same rows only means one of them deletes fewer.
		deleteExpired: r.Replace(`DELETE FROM {{table}}
WHERE ctid = ANY (ARRAY(SELECT ctid FROM {{table}} WHERE expires_at <= pg_catalog.now() ORDER BY expires_at LIMIT $1::int))
AND expires_at <= pg_catalog.now()`),
		// Whether the session's role may write the key table: asked when
		// writing the result as the transaction's role was refused.
		rolePrivileges: `SELECT current_user::text, pg_catalog.has_table_privilege(` + schema.QuoteLiteral(ident) + `, 'SELECT') AND pg_catalog.has_table_privilege(` + schema.QuoteLiteral(ident) + `, 'UPDATE')`,
	}
}

// claimInsert is the INSERT of a claim, up to its FROM: the key's row in
// the state running, created now and expiring TTL ($5, in microseconds)
// from now.
const claimInsert = `INSERT INTO {{table}} (scope, key, method, fingerprint, state, created_at, expires_at)
SELECT $1::text, $2::text, $3::text, $4::bytea, 'running', t.now, t.now + $5::bigint * interval '1 microsecond'`

// endSession is statements.endSession with the arguments of
// pg_terminate_backend, behind a pooler or not.
func endSession(args string, pooled bool) string {
	ours := ""
	if pooled {
		ours = " AND (extract(epoch FROM a.xact_start) * 1000000)::bigint = $2::bigint"
	}
	return `SELECT COALESCE(a.state = 'idle' OR a.backend_xid::text::bigint <> $3::bigint % 4294967296
  OR (extract(epoch FROM a.xact_start) * 1000000)::bigint <> $2::bigint, false),
CASE WHEN a.pid <> pg_catalog.pg_backend_pid()` + ours + ` THEN pg_catalog.pg_terminate_backend(` + args + `) END
FROM pg_catalog.pg_stat_activity a
WHERE a.pid = $1::int AND (extract(epoch FROM a.backend_start) * 1000000)::bigint <= $2::bigint`
}
