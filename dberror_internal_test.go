package idempotency

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"net"
	"syscall"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// Every database error gets the code that tells the client the truth:
// Unavailable only where a retry can help.
func TestUnitDatabaseErrorClassification(t *testing.T) {
	t.Parallel()
	var pool *pgxpool.Pool
	s, err := NewStore(pool)
	require.NoError(t, err)
	for _, tc := range []struct {
		err  error
		code codes.Code
		says string
	}{
		{io.ErrUnexpectedEOF, codes.Unavailable, "key store unavailable"},
		{&pgconn.ConnectError{}, codes.Unavailable, "key store unavailable"},
		{&pgconn.PgError{Code: "08006"}, codes.Unavailable, "key store unavailable"},
		{&pgconn.PgError{Code: "57P01"}, codes.Unavailable, "key store unavailable"},
		{&pgconn.PgError{Code: "53300"}, codes.Unavailable, "key store unavailable"},
		{&pgconn.PgError{Code: "53100"}, codes.Unavailable, "key store unavailable"},
		{&pgconn.PgError{Code: "25006"}, codes.Unavailable, "key store unavailable"},
		{&pgconn.PgError{Code: "57014"}, codes.Unavailable, "key store unavailable"},
		{&pgconn.PgError{Code: "40001"}, codes.Aborted, "retry with the same key"},
		{&pgconn.PgError{Code: "40P01"}, codes.Aborted, "retry with the same key"},
		{&pgconn.PgError{Code: "42P01"}, codes.Internal, `key table "idempotency_keys" does not exist: run Store.Migrate`},
		{&pgconn.PgError{Code: "42703"}, codes.Internal, "not at this version's schema: run Store.Migrate"},
		{&pgconn.PgError{Code: "42501"}, codes.Internal, "grant it SELECT, INSERT, UPDATE and DELETE"},
		{&pgconn.PgError{Code: "28P01"}, codes.Internal, "PostgreSQL refused the login"},
		{&pgconn.PgError{Code: "22021"}, codes.Internal, "unexpected database error"},
		{&pgconn.PgError{Code: "P0001"}, codes.Internal, "unexpected database error"},
		{&pgconn.PgError{Code: "28000", Severity: "FATAL"}, codes.Internal, "PostgreSQL refused the login"},
		{&pgconn.PgError{Code: "3D000", Severity: "FATAL"}, codes.Internal, "PostgreSQL refused the login"},
		{&pgconn.PgError{Code: "42501", Severity: "FATAL"}, codes.Internal, "grant it CONNECT"},
		{&pgconn.ConnectError{Config: &pgconn.Config{}}, codes.Unavailable, "key store unavailable"},
		{&pgconn.PgError{Code: "26000"}, codes.Internal, "max_prepared_statements"},
		{&pgconn.PgError{Code: "25P03", Severity: "FATAL"}, codes.Unavailable, "key store unavailable"},
		{&pgconn.PgError{Code: "XX000", Severity: "FATAL"}, codes.Unavailable, "key store unavailable"},
		{&pgconn.PgError{Code: "58030"}, codes.Unavailable, "key store unavailable"},
		{&pgconn.PgError{Code: "58P01", Severity: "FATAL"}, codes.Internal, "cannot load a file its configuration names"},
		{&pgconn.PgError{Code: "58P01"}, codes.Internal, "cannot load a file its configuration names"},
		{&pgconn.PgError{Code: "58P02"}, codes.Internal, "cannot load a file its configuration names"},
		{&pgconn.PgError{Code: "08P01", Severity: "FATAL"}, codes.Internal, "protocol violation"},
		{&pgconn.PgError{Code: "57P04", Severity: "FATAL"}, codes.Internal, "the database was dropped"},
		{&pgconn.PgError{Code: "53400"}, codes.Internal, "configuration limit"},
		{&net.OpError{Op: "dial", Err: syscall.ECONNREFUSED}, codes.Unavailable, "key store unavailable"},
		{fmt.Errorf("write: %w", syscall.EPIPE), codes.Unavailable, "key store unavailable"},
		{x509.UnknownAuthorityError{}, codes.Internal, "TLS handshake with the server cannot succeed"},
		{&tls.CertificateVerificationError{Err: x509.UnknownAuthorityError{}}, codes.Internal, "TLS handshake with the server cannot succeed"},
		{errors.New("can't scan into dest[1]: cannot scan tid (OID 27) in binary format into *pgtype.TID"), codes.Internal, "pgx could not use the server's answer"},
	} {
		name := fmt.Sprintf("%T %v", tc.err, tc.err)
		err := s.dbError(context.Background(), "claim", tc.err)
		require.Equal(t, tc.code, status.Code(err), name)
		require.Contains(t, status.Convert(err).Message(), tc.says, name)
		require.ErrorIs(t, err, tc.err, "%s: the cause stays reachable", name)
	}

	cancelled, cancel := context.WithCancel(context.Background())
	cancel()
	err = s.dbError(cancelled, "claim", fmt.Errorf("read: %w", context.Canceled))
	require.Equal(t, codes.Canceled, status.Code(err), "the caller's own cancellation")
	require.ErrorIs(t, err, context.Canceled)
	require.False(t, errors.Is(err, ErrStoreUnavailable))
}

// A handler's own database error is told as the engine's are: only what a
// retry can fix is Unavailable; a missing library file is passed on as it
// is, never as an outage.
func TestUnitHandlerErrorClassification(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		code string
		want codes.Code
	}{
		{"40001", codes.Aborted},
		{"08006", codes.Unavailable},
		{"58030", codes.Unavailable},
		{"58P01", codes.Unknown},
		{"08P01", codes.Unknown},
		{"57P04", codes.Unknown},
		{"23505", codes.Unknown},
	} {
		err := handlerError(&pgconn.PgError{Code: tc.code})
		require.Equal(t, tc.want, status.Code(err), tc.code)
	}
}
