package idempotency

import "strings"

// statements are the SQL texts of a store, rendered once for its table.
type statements struct {
	claim, readKey, savepoint, rollbackHandler string
	storeResponse, storeError                  string
	deleteExpiredKey, deleteExpired            string
}

func renderStatements(table string) statements {
	r := strings.NewReplacer("{{table}}", table)
	return statements{
		// The CTE sets lock_timeout before the insert can wait on a concurrent
		// claimer, and the first branch restores it once a row was inserted.
		// The second branch returns the existing row when one was visible.
		claim: r.Replace(`WITH cfg AS MATERIALIZED (
	SELECT current_setting('lock_timeout') AS prev, set_config('lock_timeout', $6, true) AS cur
), ins AS (
	INSERT INTO {{table}} (scope, key, method, fingerprint, state, expires_at)
	SELECT $1, $2, $3, $4, 'running', now() + $5 * interval '1 microsecond' FROM cfg
	ON CONFLICT (scope, key) DO NOTHING
	RETURNING 1
)
SELECT true, set_config('lock_timeout', cfg.prev, true), '', ''::bytea, 'running', NULL::text, NULL::bytea, NULL::bytea, false
FROM ins, cfg
UNION ALL
SELECT false, NULL, k.method, k.fingerprint, k.state, k.response_type, k.response, k.status, k.expires_at <= now()
FROM {{table}} k
WHERE k.scope = $1 AND k.key = $2 AND NOT EXISTS (SELECT FROM ins)`),
		readKey: r.Replace(`SELECT method, fingerprint, state, response_type, response, status, expires_at <= now()
FROM {{table}} WHERE scope = $1 AND key = $2`),
		savepoint:       "SAVEPOINT idempotency_call",
		rollbackHandler: "ROLLBACK TO SAVEPOINT idempotency_call",
		// The TTL counts from the start of the call. A call that outlasted
		// it would commit a key already expired, so that one is kept a full
		// TTL from when it finished. expires_at is otherwise left as it is,
		// which keeps this update heap-only (HOT): no new index entries.
		storeResponse: r.Replace(`UPDATE {{table}}
SET state = 'succeeded', response_type = NULLIF($4, ''), response = $5, completed_at = clock_timestamp(),
    expires_at = CASE WHEN expires_at > clock_timestamp() THEN expires_at
                      ELSE clock_timestamp() + $3 * interval '1 microsecond' END
WHERE scope = $1 AND key = $2`),
		storeError: r.Replace(`UPDATE {{table}}
SET state = 'failed', status = $4, completed_at = clock_timestamp(),
    expires_at = CASE WHEN expires_at > clock_timestamp() THEN expires_at
                      ELSE clock_timestamp() + $3 * interval '1 microsecond' END
WHERE scope = $1 AND key = $2`),
		deleteExpiredKey: r.Replace(`DELETE FROM {{table}} WHERE scope = $1 AND key = $2 AND expires_at <= now()`),
		// No FOR UPDATE: locking each row first would write a lock record
		// per key to the WAL on top of its delete. Two cleaners racing for
		// the same rows only means one of them deletes fewer.
		deleteExpired: r.Replace(`DELETE FROM {{table}}
WHERE ctid = ANY (ARRAY(SELECT ctid FROM {{table}} WHERE expires_at <= now() ORDER BY expires_at LIMIT $1))
AND expires_at <= now()`),
	}
}
