package idempotency

import (
	"context"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5/pgconn"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// dbError turns an error of the engine's own statements into what the
// caller is told, by SQLSTATE class: only what a retry can fix is
// Unavailable. A cancelled or expired ctx is reported as such (the caller
// gave up; the database may be fine).
//
//	connection lost or refused, shutdown, too many connections, out of
//	memory or disk, I/O error, read-only (failover), statement_timeout
//	                                       Unavailable (ErrStoreUnavailable)
//	serialization failure, deadlock        Aborted (retry the same key)
//	table or column missing, privileges,
//	login refused, any other error         Internal, saying what to do
func (s *Store) dbError(ctx context.Context, op string, err error) error {
	if ctxErr := ctx.Err(); ctxErr != nil && errors.Is(err, ctxErr) {
		return contextError{ctxErr}
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		// No answer from the server: the network, or a connection that died.
		return ErrStoreUnavailable.with(op, err)
	}
	switch code := pgErr.Code; {
	case pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC":
		// The server ended the session (idle_in_transaction_session_timeout,
		// an administrator, a crash): the connection is gone, not the
		// configuration.
		return ErrStoreUnavailable.with(op, err)
	case transientCode(code):
		return ErrStoreUnavailable.with(op, err)
	case code == "40001" || code == "40P01":
		return &dbFailure{code: codes.Aborted, msg: "the database aborted the transaction (a serialization failure or deadlock); retry with the same key", op: op, cause: pgErr}
	case code == "42P01":
		return s.misconfigured(op, pgErr, "the key table %s does not exist: run Store.Migrate, or apply Store.Migrations() with your migration tool", s.ident.Sanitize())
	case code == "42703" || code == "42804" || code == "23502":
		return s.misconfigured(op, pgErr, "the key table %s is not at this version's schema: run Store.Migrate, or apply the missing Store.Migrations()", s.ident.Sanitize())
	case code == "42501":
		return s.misconfigured(op, pgErr, "the database role may not use the key table %s: grant it SELECT, INSERT, UPDATE and DELETE", s.ident.Sanitize())
	case strings.HasPrefix(code, "28") || code == "3D000":
		return s.misconfigured(op, pgErr, "PostgreSQL refused the login: check the database URL, role and password")
	}
	return s.misconfigured(op, pgErr, "unexpected database error; the server's log has it")
}

// transientCode reports whether a SQLSTATE names a condition that passes:
// a retry, after a while, can succeed.
func transientCode(code string) bool {
	switch {
	case strings.HasPrefix(code, "08"): // connection exception
		return true
	case strings.HasPrefix(code, "53"): // insufficient resources: disk, memory, connections
		return true
	case strings.HasPrefix(code, "58"): // system error: I/O
		return true
	case strings.HasPrefix(code, "57P"): // admin or crash shutdown, cannot connect now
		return true
	}
	switch code {
	case "57014", // query_canceled: statement_timeout on an overloaded server
		"25P03", // idle_in_transaction_session_timeout
		"25P04", // transaction_timeout
		"55P03", // lock_not_available: lock_timeout
		"25006": // read_only_sql_transaction: a standby, during failover
		return true
	}
	return false
}

// misconfigured is Internal with a message an operator can act on; the
// database's own message and SQLSTATE are kept in the cause.
func (s *Store) misconfigured(op string, pgErr *pgconn.PgError, format string, args ...any) error {
	return &dbFailure{code: codes.Internal, msg: fmt.Sprintf(format, args...), op: op, cause: pgErr}
}

// dbFailure is a database error that is not an outage: the client gets
// code and msg, and the server's log the database's own message.
type dbFailure struct {
	code    codes.Code
	msg, op string
	cause   *pgconn.PgError
}

func (e *dbFailure) Error() string {
	return fmt.Sprintf("idempotency: %s: %s (SQLSTATE %s: %s)", e.op, e.msg, e.cause.Code, e.cause.Message)
}

func (e *dbFailure) Unwrap() error { return e.cause }

// GRPCStatus gives the client the code and the message, not the database's
// message, which may name internal objects.
func (e *dbFailure) GRPCStatus() *status.Status {
	return status.New(e.code, fmt.Sprintf("idempotency: %s (SQLSTATE %s)", e.msg, e.cause.Code))
}
