package idempotency

import (
	"context"
	"errors"
	"fmt"
	"io"
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
