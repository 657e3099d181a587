package idempotency

import (
	"context"
	"fmt"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// Session state: what a handler leaves on its session, past the call's
// transaction, would reach the next call on the same server connection:
// from the pool, or, behind a transaction pooler, from any client of the
// pooler. The engine's own statements do not depend on any of it (see
// renderStatements). What a later handler would see is reset on every
// outcome, in the round trip that ends the call's use of the connection,
// without reading the handler's SQL: whatever path set it (a function, a DO
// block, dynamic SQL), the server is told to drop it.
//
// Settings (SET, set_config(name, value, false), SET ROLE and SET SESSION
// AUTHORIZATION), temporary objects, cursors WITH HOLD, sequences' current
// values and LISTEN are reset once the call's transaction has ended, in the
// same round trip (resetSession): right after the COMMIT when the call
// commits, so that a failed COMMIT rolls them back and the handler's
// deferred triggers still run at COMMIT with the handler's settings; after
// the ROLLBACK (and the settle's COMMIT) otherwise. A rollback undoes most
// of them, but not what a handler committed itself before it began another
// transaction (COMMIT AND CHAIN), nor a sequence's current value. What a
// rollback leaves, session advisory locks and statements prepared with
// SQL's PREPARE, is released on every outcome too (releaseHeld), before the
// COMMIT when the call commits, and before the ROLLBACK once the round trip
// has checked that the transaction it rolls back is still the call's
// (statements.releaseCheck).
//
// Behind a transaction pooler a round trip after the transaction ends may
// reach another server connection, and closing the client's connection
// resets nothing: every reset rides in the round trip that ends the call's
// transaction, which the pooler runs on one server connection (pgx sends a
// batch as one pipeline, with one Sync, and the pooler hands the server
// connection on only at the ReadyForQuery that answers it).
//
// Some things still cost the connection, closed rather than returned to the
// pool: a handler that had the connection itself (tx.Conn()), and so may
// have changed pgx's own state of it, or that ended the call's transaction
// itself; a statement the handler prepared by name with tx.Prepare, which
// pgx keeps; a reset that failed; and, directly connected, statements
// prepared with SQL's PREPARE, which only a DO block could deallocate (too
// dear for every call; behind a pooler one does), and a setting PostgreSQL
// reports to the client that still differs from its value before the call
// (sessionParams), which no reset should leave.

// releaseHeld releases the session's advisory locks (the engine's own on
// the key are released before it, see statements.finish and unlockIfHeld)
// and reports whether the session holds statements prepared with SQL's
// PREPARE: pgx prepares its own through the protocol, so they are never
// counted. It takes no lock and writes nothing, inside the call's
// transaction or outside any.
// The commit's statement (statements.finish), and the check before a
// release's ROLLBACK (statements.releaseCheck), do the same in their own
// columns.
const releaseHeld = `SELECT ` + releaseHeldColumns

// releaseHeldColumns are releaseHeld's columns.
const releaseHeldColumns = `pg_catalog.pg_advisory_unlock_all() IS NULL, EXISTS (SELECT FROM pg_catalog.pg_prepared_statements WHERE from_sql)`

// deallocateSQL deallocates the statements prepared with SQL's PREPARE,
// behind a pooler, where closing the connection would not: pgx's own
// (through the protocol, and the pooler's, which carries them under names
// of its own) stay. Everything is named with pg_catalog, so that a
// search_path the handler set for its transaction changes nothing.
const deallocateSQL = `DO $$DECLARE n pg_catalog.text; BEGIN
FOR n IN SELECT name FROM pg_catalog.pg_prepared_statements WHERE from_sql LOOP
EXECUTE pg_catalog.concat('DEALLOCATE ', pg_catalog.quote_ident(n)); END LOOP; END $$`

// resetSession are the statements that reset, once the call's transaction
// has ended, what the session kept of the call: the role and settings first
// (so that none the handler set, a statement_timeout say, applies to the
// rest), then cursors, before the temporary objects they may read, then
// sequences' current values and LISTEN. None takes a lock or writes, so a
// transaction the handler made read-only by default runs them too.
var resetSession = [...]string{"SET SESSION AUTHORIZATION DEFAULT", "RESET ALL", "CLOSE ALL", "DISCARD TEMP", "DISCARD SEQUENCES", "UNLISTEN *"}

// restoreSettings sets the settings of sessionBaseline again, after RESET
// ALL (which returns every setting to its value at connection time).
const restoreSettings = `SELECT pg_catalog.set_config(s.name, s.value, false) FROM ROWS FROM
(pg_catalog.unnest($1::pg_catalog.text[]), pg_catalog.unnest($2::pg_catalog.text[])) AS s(name, value)`

// sessionBaseline is what the pool made of a connection's session after it
// connected, which RESET ALL would undo: directly connected, the settings
// its AfterConnect (say) set, its role and session authorization, in the
// order they are set again, read from the server once per connection.
// Behind a pooler the session is the pooler's server connection, which
// RESET ALL returns to how the pooler connected it, and the pooler, which
// sets the client's own values of the settings it tracks on a server
// connection when it hands it to the client, does not set them again after
// a RESET ALL: the baseline is the client's values of those
// (pooledSettings), as the client connected with them.
type sessionBaseline struct{ names, values []string }

// pooledSettings are the settings PgBouncer tracks for each client.
var pooledSettings = []string{"client_encoding", "DateStyle", "TimeZone", "standard_conforming_strings", "application_name"}

// baselineKey keys a connection's sessionBaseline in its CustomData.
const baselineKey = "idempotency.sessionBaseline"

// readBaseline reads the session's baseline, which is taken from the
// connection the first time the engine uses it.
const readBaseline = `SELECT pg_catalog.array_agg(s.name ORDER BY s.o), pg_catalog.array_agg(s.value ORDER BY s.o) FROM (
SELECT 0 AS o, 'session_authorization' AS name, pg_catalog.current_setting('session_authorization') AS value
  WHERE pg_catalog.current_setting('session_authorization') <> session_user
UNION ALL SELECT 1, name, pg_catalog.current_setting(name) FROM pg_catalog.pg_settings
  WHERE source = 'session' AND name NOT IN ('role', 'session_authorization')
UNION ALL SELECT 2, 'role', pg_catalog.current_setting('role') WHERE pg_catalog.current_setting('role') <> 'none') s`

// loadBaseline returns the connection's sessionBaseline, made at its first
// use (directly connected, in one round trip).
func (a *attempt) loadBaseline(ctx context.Context) (*sessionBaseline, error) {
	data := a.conn.PgConn().CustomData()
	if b, ok := data[baselineKey].(*sessionBaseline); ok {
		return b, nil
	}
	b := &sessionBaseline{}
	if a.s.pooled.Load() {
		for _, name := range pooledSettings {
			if v := a.conn.PgConn().ParameterStatus(name); v != "" || name == "application_name" {
				b.names, b.values = append(b.names, name), append(b.values, v)
			}
		}
	} else if err := a.conn.QueryRow(ctx, readBaseline, pgx.QueryExecModeSimpleProtocol).Scan(&b.names, &b.values); err != nil {
		return nil, err
	}
	data[baselineKey] = b
	return b, nil
}

// queueReleaseHeld queues releaseHeld at the end of b, for a call whose
// handler ran, and behind a pooler deallocateSQL after it. held: b already
// holds a statement with releaseHeld's columns (the commit's).
func (a *attempt) queueReleaseHeld(b *stmtBatch, held bool) {
	if !a.ran {
		return
	}
	if !held {
		b.queue(releaseHeld)
	}
	if a.s.pooled.Load() {
		b.queue(deallocateSQL)
	}
}

// readReleaseHeld reads the results of what queueReleaseHeld queued.
func (a *attempt) readReleaseHeld(br batchReader) error {
	if !a.ran {
		return nil
	}
	var unlocked, prepared bool
	if err := br.QueryRow().Scan(&unlocked, &prepared); err != nil {
		return err
	}
	return a.readDeallocated(br, prepared)
}

// readDeallocated reads the result of deallocateSQL behind a pooler;
// directly connected, statements prepared with SQL's PREPARE cost the
// connection.
func (a *attempt) readDeallocated(br batchReader, prepared bool) error {
	if a.s.pooled.Load() {
		_, err := br.Exec()
		return err
	}
	if prepared && a.reset == "" {
		a.reset = "the handler prepared statements with SQL's PREPARE, which outlive the call"
	}
	return nil
}

// queueEndSession queues at the end of b, after the statement that ends
// the call's transaction (its ROLLBACK, or the COMMIT of the settle after
// it), what resets the session of a call whose handler ran: releaseHeld,
// then resetSession.
func (a *attempt) queueEndSession(b *stmtBatch) {
	if a.ran {
		a.queueReleaseHeld(b, false)
		a.queueReset(b)
	}
}

// readEndSession reads the results of what queueEndSession queued.
func (a *attempt) readEndSession(br batchReader) error {
	if !a.ran {
		return nil
	}
	if err := a.readReleaseHeld(br); err != nil {
		return err
	}
	return a.readReset(br)
}

// queueReset queues resetSession, and the baseline's settings after them,
// at the end of b.
func (a *attempt) queueReset(b *stmtBatch) {
	for _, sql := range resetSession {
		b.queue(sql)
	}
	if a.baseline != nil && len(a.baseline.names) > 0 {
		b.queue(restoreSettings, a.baseline.names, a.baseline.values)
	}
}

// readReset reads the results of what queueReset queued. A reset that
// failed leaves the connection to be closed (see resetFailed).
func (a *attempt) readReset(br batchReader) error {
	n := len(resetSession)
	if a.baseline != nil && len(a.baseline.names) > 0 {
		n++
	}
	for range n {
		if _, err := br.Exec(); err != nil {
			a.resetFailed(err)
			return err
		}
	}
	return nil
}

// resetFailed notes that the session could not be reset after the call, so
// that the connection is closed.
func (a *attempt) resetFailed(err error) {
	if a.reset == "" {
		a.reset = fmt.Sprintf("its session could not be reset after the call (%v)", err)
	}
}

// reportedSettings are the settings PostgreSQL sends the client a
// ParameterStatus message for whenever their value changes (GUC_REPORT;
// search_path and role only on releases that report them).
var reportedSettings = [...]string{
	"application_name", "client_encoding", "DateStyle", "default_transaction_read_only", "in_hot_standby", "IntervalStyle",
	"is_superuser", "role", "search_path", "session_authorization", "standard_conforming_strings", "TimeZone",
}

// sessionParams are the values of reportedSettings on a connection.
type sessionParams [len(reportedSettings)]string

func (p *sessionParams) read(c *pgconn.PgConn) {
	for i, name := range reportedSettings {
		p[i] = c.ParameterStatus(name)
	}
}

// changed names the first setting whose value on c is not p's, "" when
// none changed. A SET LOCAL is reported twice, when it is made and when the
// transaction ends, and so is not a change.
func (p *sessionParams) changed(c *pgconn.PgConn) string {
	for i, name := range reportedSettings {
		if c.ParameterStatus(name) != p[i] {
			return name
		}
	}
	return ""
}

// resetReason says why the attempt's connection must be closed rather than
// go back to the pool, "" when it may serve another call.
func (a *attempt) resetReason() string {
	switch {
	case a.conn.IsClosed():
		return "it is closed"
	case a.rawConn:
		return "the handler had it (tx.Conn())"
	case a.reset != "":
		return a.reset
	case a.s.pooled.Load():
		// Closing the connection would reset nothing of the server
		// connection; and the pooler sets what it tracks of the client's
		// settings (application_name, TimeZone, ...) on whichever server
		// connection serves the client's next transaction, which RESET ALL
		// took back to how the pooler connected it.
		return ""
	}
	if name := a.params.changed(a.conn.PgConn()); name != "" {
		return "the handler changed " + name + " for the session"
	}
	return ""
}
