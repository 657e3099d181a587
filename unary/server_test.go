package unary_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/unary"
)

// What cannot work is refused when the adapter is built, each error naming
// what to fix, as the gRPC interceptors refuse it (they panic).
func TestNewServerAndClientRefuseWhatCannotWork(t *testing.T) {
	t.Parallel()
	pool, err := pgxpool.New(context.Background(), "postgres://postgres@127.0.0.1:1/unused") // never dialled
	require.NoError(t, err)
	t.Cleanup(pool.Close)
	store, err := idempotency.NewStore(pool)
	require.NoError(t, err)

	_, err = unary.NewServer(nil)
	require.ErrorContains(t, err, "store is nil")
	_, err = unary.NewServer(store, idempotency.WithTTL(0))
	require.ErrorContains(t, err, "WithTTL")
	_, err = unary.NewClient(idempotency.WithMaxAttempts(0))
	require.ErrorContains(t, err, "WithMaxAttempts")

	s, err := unary.NewServer(store)
	require.NoError(t, err)
	require.NotNil(t, s)
	c, err := unary.NewClient()
	require.NoError(t, err)
	require.NotNil(t, c)
}
