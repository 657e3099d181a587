package idempotency

import "github.com/jackc/pgx/v5/pgconn"

// Session state: what a handler leaves on its connection's session, past
// the call's transaction, would reach the next call that gets the
// connection from the pool: a default_transaction_read_only or a role set
// for the session, a search_path, prepared statements deallocated under
// pgx. The engine's own statements do not depend on any of it (see
// renderStatements); what a later handler would see is kept from it by
// closing the connection, instead of returning it to the pool, after any
// call that may have changed it:
//
//   - the handler had the connection itself (tx.Conn(), the Conn of a
//     query's rows), so anything may have been sent on it;
//   - a setting that PostgreSQL reports to the client whenever it changes
//     (sessionParams) has another value after the call than before it;
//   - the handler sent a statement that can change the session (see
//     sessionChange in txcontrol.go);
//   - the engine found the connection's prepared statements gone.
//
// The first two are facts of the protocol; the third reads the handler's
// SQL, and a function that changes a setting for the session
// (set_config(name, value, false) in its body) is beyond it. Whatever it
// misses, the key's guarantee does not depend on it.

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
	}
	if name := a.params.changed(a.conn.PgConn()); name != "" {
		return "the handler changed " + name + " for the session"
	}
	return ""
}
