package idempotency_test

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// The engine prepares the statements of its round trips once per
// connection, and a pgx tracer on the pool sees each round trip as the
// batch it is, the COMMIT's included, in the order they were sent.
func TestRoundTripsPrepareOncePerConnectionAndReachTheTracer(t *testing.T) {
	t.Parallel()
	var mu sync.Mutex
	var batches [][]string
	db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
		cfg.MaxConns = 1
		cfg.ConnConfig.Tracer = &testdb.Tracer{OnRoundTrip: func(_ context.Context, _ *pgx.Conn, statements []string) {
			mu.Lock()
			batches = append(batches, statements)
			mu.Unlock()
		}}
	})
	store := migratedStore(t, db)
	createLedger(t, db)
	write := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) { return writeLedger(ctx, tx) }
	prepared := func() int {
		return db.Count(t, `SELECT count(*) FROM pg_prepared_statements WHERE name LIKE 'idempotency\_%'`)
	}
	call := func(i int) {
		res, err := store.Execute(context.Background(), idempotency.Call{Key: fmt.Sprintf("k%d", i), Method: "m"}, write)
		require.NoError(t, err)
		require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
	}
	call(0)
	first := prepared()
	require.NotZero(t, first, "the engine's statements are prepared on the connection")
	mu.Lock()
	batches = nil
	mu.Unlock()
	for i := 1; i <= 5; i++ {
		call(i)
	}
	require.Equal(t, first, prepared(), "later calls on the connection prepare nothing more")
	mu.Lock()
	defer mu.Unlock()
	var claims, commits int
	for _, b := range batches {
		if slices.ContainsFunc(b, func(s string) bool { return strings.HasPrefix(s, "SAVEPOINT idempotency_claim_") }) {
			claims++
		}
		if testdb.HasCommit(b) {
			require.Equal(t, 1, claims-commits, "each call's COMMIT follows its claim: %q", b)
			commits++
		}
	}
	require.Equal(t, 5, claims, "every claim's round trip reached the tracer")
	require.Equal(t, 5, commits, "every commit's round trip reached the tracer")
}
