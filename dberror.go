package idempotency

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"strings"
	"syscall"

	"github.com/jackc/pgx/v5/pgconn"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
)

// dbError turns an error of the engine's own statements into what the
// caller is told, by SQLSTATE class, or for an error without one by what
// failed: only what a retry can fix is Unavailable. A cancelled or expired
// ctx is reported as such (the caller gave up; the database may be fine).
//
//	connection lost or refused, shutdown, too many connections, out of
//	memory or disk, I/O error, read-only (failover), statement_timeout
//	                                       Unavailable (ErrStoreUnavailable)
//	serialization failure, deadlock        Aborted (retry the same key)
//	table or column missing, privileges,
//	login refused, a TLS certificate that
//	cannot be verified, a missing library
//	file, a protocol violation, a database
//	dropped, an answer pgx cannot decode,
//	any other error                        Internal, saying what to do
//
// TESTING.md lists every class with the test that proves its code.
func (s *Store) dbError(ctx context.Context, op string, err error) error {
	if ctxErr := ctx.Err(); ctxErr != nil && errors.Is(err, ctxErr) {
		return contextError{ctxErr}
	}
	var failure *dbFailure
	if errors.As(err, &failure) {
		return failure // classified already
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return s.clientError(op, err)
	}
	switch code := pgErr.Code; {
	case strings.HasPrefix(code, "28") || code == sqlInvalidCatalogName:
		// Before the severity: PostgreSQL refuses a login with FATAL, and
		// no retry fixes a wrong role, password or database.
		return s.misconfigured(op, pgErr, "PostgreSQL refused the login: check the database URL, role and password (and that the database exists)")
	case code == sqlInsufficientPrivilege && pgErr.Severity == "FATAL":
		return s.misconfigured(op, pgErr, "PostgreSQL refused the login: the role may not connect to the database; grant it CONNECT")
	case code == sqlUndefinedFile || code == sqlDuplicateFile:
		return s.misconfigured(op, pgErr, "the server cannot load a file its configuration names (an extension or a library: shared_preload_libraries, "+
			"session_preload_libraries, local_preload_libraries): install it, or remove it from the setting")
	case code == sqlProtocolViolation:
		return s.misconfigured(op, pgErr, "the server (or a pooler in front of it) refused what pgx sent as a protocol violation: "+
			"check the pooler's mode and the pool's default_query_exec_mode")
	case code == sqlDatabaseDropped:
		return s.misconfigured(op, pgErr, "the database was dropped: point the store's pool at one that exists")
	case code == sqlConfigurationLimit:
		return s.misconfigured(op, pgErr, "the server's configuration refuses the statement (a configuration limit): the server's log names it")
	case pgErr.Severity == "FATAL" || pgErr.Severity == "PANIC":
		// The server ended the session (idle_in_transaction_session_timeout,
		// an administrator, a crash): the connection is gone, not the
		// configuration.
		return ErrStoreUnavailable.with(op, err)
	case transientCode(code):
		return ErrStoreUnavailable.with(op, err)
	case code == sqlSerializationFailure || code == sqlDeadlockDetected:
		return &dbFailure{code: codes.Aborted, msg: "the database aborted the transaction (a serialization failure or deadlock); nothing was committed, retry with the same key", op: op, cause: pgErr}
	case code == sqlUndefinedTable:
		s.forgetTable()
		return s.misconfigured(op, pgErr, "the key table %s does not exist: run Store.Migrate, or apply idempotency.Migrations with your migration tool", s.ident.Sanitize())
	case code == sqlUndefinedColumn || code == sqlDatatypeMismatch || code == sqlNotNullViolation:
		return s.misconfigured(op, pgErr, "the key table %s is not at this version's schema: run Store.Migrate, or apply the missing idempotency.Migrations", s.ident.Sanitize())
	case code == sqlInsufficientPrivilege:
		return s.misconfigured(op, pgErr, "the database role may not use the key table %s: grant it SELECT, INSERT, UPDATE and DELETE", s.ident.Sanitize())
	case code == sqlInvalidStatementName:
		return s.misconfigured(op, pgErr, "a prepared statement vanished from the server connection: behind a connection pooler in transaction mode, "+
			"pgx's default query mode (cache_statement) needs a pooler that carries prepared statements (PgBouncer 1.21 or later, max_prepared_statements); "+
			"otherwise set default_query_exec_mode=cache_describe or exec")
	}
	return s.misconfigured(op, pgErr, "unexpected database error; the server's log has it")
}

// clientError classifies an error that has no SQLSTATE: the network or a
// connection that died, which a retry can get past; a TLS handshake that
// can never succeed as configured; or an answer pgx could not use (a value
// it cannot decode), which no retry changes.
func (s *Store) clientError(op string, err error) error {
	switch {
	case tlsUnverifiable(err):
		return &dbFailure{code: codes.Internal, op: op, err: err, msg: "the TLS handshake with the server cannot succeed as configured (its certificate does not verify, " +
			"or the server refuses TLS): give sslrootcert the CA that signed the server's certificate, use a host name the certificate names, or change sslmode"}
	case connectionTrouble(err):
		return ErrStoreUnavailable.with(op, err)
	}
	return &dbFailure{code: codes.Internal, op: op, err: err, msg: "pgx could not use the server's answer (" + err.Error() + "); no retry changes that: " +
		"a custom type registered on the pool's connections, or a change to the key table's columns, may be the cause"}
}

// tlsUnverifiable reports whether err is a TLS failure that no retry
// fixes.
func tlsUnverifiable(err error) bool {
	var verify *tls.CertificateVerificationError
	var authority x509.UnknownAuthorityError
	var host x509.HostnameError
	var invalid x509.CertificateInvalidError
	var alert tls.AlertError
	if errors.As(err, &verify) || errors.As(err, &authority) || errors.As(err, &host) || errors.As(err, &invalid) || errors.As(err, &alert) {
		return true
	}
	// sslmode=require against a server without TLS; pgconn's error has no
	// type of its own, and is wrapped in a ConnectError.
	for e := err; e != nil; e = errors.Unwrap(e) {
		if _, ok := e.(*pgconn.ConnectError); !ok && e.Error() == "server refused TLS connection" {
			return true
		}
	}
	return false
}

// connectionTrouble reports whether err is the network's, or a
// connection's that died or could not be made: a retry, later or on
// another connection, can succeed.
func connectionTrouble(err error) bool {
	var netErr net.Error
	var connect *pgconn.ConnectError
	switch {
	case errors.As(err, &netErr), errors.As(err, &connect):
		return true
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF), errors.Is(err, net.ErrClosed):
		return true
	case errors.Is(err, syscall.ECONNREFUSED), errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE),
		errors.Is(err, syscall.ECONNABORTED), errors.Is(err, syscall.ETIMEDOUT), errors.Is(err, syscall.EHOSTUNREACH), errors.Is(err, syscall.ENETUNREACH):
		return true
	}
	// A connection that is closed or busy fails before anything is sent;
	// so does the Acquire of a pool being closed (puddle's ErrClosedPool,
	// matched by its text to keep puddle an indirect dependency).
	return pgconn.SafeToRetry(err) || pgconn.Timeout(err) || err.Error() == "closed pool"
}

// handlerError gives a handler's raw database error the status that tells
// its client the truth: a serialization failure or deadlock is Aborted
// (nothing committed: retry with the same key), a lost or overloaded
// server Unavailable. Errors that carry a status, and any other, are left
// as they are.
func handlerError(err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	var pgErr *pgconn.PgError
	if !errors.As(err, &pgErr) {
		return err
	}
	switch {
	case pgErr.Code == sqlSerializationFailure || pgErr.Code == sqlDeadlockDetected:
		return &dbFailure{code: codes.Aborted, msg: "the database aborted the handler's transaction (a serialization failure or deadlock); nothing was committed, retry with the same key", op: "handler", cause: pgErr}
	case transientCode(pgErr.Code):
		return ErrStoreUnavailable.with("handler", err)
	}
	return err
}

// IsDatabaseTrouble reports whether err is the database's own condition,
// one that passes, as the engine found it: an outage or overload, a lock or
// statement timeout ([ErrStoreUnavailable]), a serialization failure or
// deadlock (of the engine's statements, the handler's or the COMMIT). A
// consumer waits for these instead of counting them against a message. A
// status a handler returned itself (a downstream call's Aborted or
// ResourceExhausted) is never database trouble, whatever its code.
func IsDatabaseTrouble(err error) bool {
	if errors.Is(err, ErrStoreUnavailable) {
		return true
	}
	var failure *dbFailure
	return errors.As(err, &failure) && failure.code == codes.Aborted
}

// outcomeOf is the outcome of a call that ended in err before Func ran or
// committed: what a tracer counts.
func outcomeOf(err error) Outcome {
	var ce contextError
	var failure *dbFailure
	switch {
	case errors.As(err, &ce):
		return OutcomeCanceled
	case errors.As(err, &failure):
		if failure.code == codes.Internal {
			return OutcomeMisconfigured
		}
		return OutcomeUnavailable
	case status.Code(err) == codes.InvalidArgument:
		return OutcomeRejected
	case status.Code(err) == codes.Internal:
		return OutcomeMisconfigured
	}
	return OutcomeUnavailable
}

// SQLSTATEs the engine tells apart, named once.
const (
	sqlUniqueViolation          = "23505"
	sqlDivisionByZero           = "22012" // the INSERT's guard (see insertRow)
	sqlInvalidSavepoint         = "3B001"
	sqlReadOnlyTransaction      = "25006"
	sqlSerializationFailure     = "40001"
	sqlDeadlockDetected         = "40P01"
	sqlUndefinedTable           = "42P01"
	sqlInsufficientPrivilege    = "42501"
	sqlInvalidCatalogName       = "3D000" // the database does not exist
	sqlInvalidStatementName     = "26000" // a prepared statement that does not exist
	sqlUndefinedColumn          = "42703"
	sqlDatatypeMismatch         = "42804"
	sqlNotNullViolation         = "23502"
	sqlForeignKeyViolation      = "23503"
	sqlQueryCanceled            = "57014"
	sqlIdleInTransactionTimeout = "25P03"
	sqlTransactionTimeout       = "25P04"
	sqlLockNotAvailable         = "55P03"
	sqlUndefinedFile            = "58P01" // a file the server needs is missing: an extension, a library
	sqlDuplicateFile            = "58P02"
	sqlProtocolViolation        = "08P01"
	sqlDatabaseDropped          = "57P04"
	sqlConfigurationLimit       = "53400"
)

// sqlState returns the SQLSTATE of a PostgreSQL error, or "".
func sqlState(err error) string {
	var pgErr *pgconn.PgError
	if errors.As(err, &pgErr) {
		return pgErr.Code
	}
	return ""
}

// transientCode reports whether a SQLSTATE names a condition that passes:
// a retry, after a while, can succeed.
func transientCode(code string) bool {
	switch {
	case strings.HasPrefix(code, "08") && code != sqlProtocolViolation: // connection exception
		return true
	case strings.HasPrefix(code, "53") && code != sqlConfigurationLimit: // insufficient resources: disk, memory, connections
		return true
	case strings.HasPrefix(code, "58") && code != sqlUndefinedFile && code != sqlDuplicateFile: // system error: I/O
		return true
	case strings.HasPrefix(code, "57P") && code != sqlDatabaseDropped: // admin or crash shutdown, cannot connect now
		return true
	}
	switch code {
	case sqlQueryCanceled, // statement_timeout on an overloaded server
		sqlIdleInTransactionTimeout,
		sqlTransactionTimeout,
		sqlLockNotAvailable,    // lock_timeout
		sqlReadOnlyTransaction: // a standby, during failover (the engine tells a read-only primary apart)
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
	err     error // the cause when it is not the server's (cause is nil)
	// retryDelay is the RetryInfo of a retryable code (Aborted) as sent.
	retryDelay suggestedDelay
}

func (e *dbFailure) Error() string {
	if e.cause == nil {
		return fmt.Sprintf("idempotency: %s: %s", e.op, e.msg)
	}
	return fmt.Sprintf("idempotency: %s: %s (SQLSTATE %s: %s)", e.op, e.msg, e.cause.Code, e.cause.Message)
}

func (e *dbFailure) Unwrap() error {
	if e.cause == nil {
		return e.err
	}
	return e.cause
}

// GRPCStatus gives the client the code and the message, not the database's
// message, which may name internal objects.
func (e *dbFailure) GRPCStatus() *status.Status {
	st := status.New(e.code, "idempotency: "+e.msg)
	if e.cause != nil {
		st = status.New(e.code, fmt.Sprintf("idempotency: %s (SQLSTATE %s)", e.msg, e.cause.Code))
	}
	if e.retryDelay.set {
		if s, err := st.WithDetails(&errdetails.RetryInfo{RetryDelay: durationpb.New(e.retryDelay.d)}); err == nil {
			st = s
		}
	}
	return st
}
