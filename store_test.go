package idempotency_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// The engine's cost in round trips to PostgreSQL, counted, not timed: a
// fresh call with one business write makes as many as a plain
// BEGIN/INSERT/COMMIT, and a replay of a call marked as a retry makes one.
func TestRoundTripsPerCall(t *testing.T) {
	t.Parallel()
	var roundTrips atomic.Int64
	db := testdb.NewConfigured(t, func(cfg *pgxpool.Config) {
		cfg.ConnConfig.Tracer = &testdb.Tracer{OnRoundTrip: func(context.Context, *pgx.Conn, []string) { roundTrips.Add(1) }}
	})
	ctx := context.Background()
	store := migratedStore(t, db)
	createLedger(t, db)
	write := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x')`)
		return wrapperspb.String("done"), err
	}
	measure := func(f func()) int64 {
		before := roundTrips.Load()
		f()
		return roundTrips.Load() - before
	}
	execute := func(call idempotency.Call, want idempotency.Outcome) {
		res, err := store.Execute(ctx, call, write)
		require.NoError(t, err)
		require.Equal(t, want, res.Outcome)
	}
	// Warm the statement caches, so that first-use prepares are not counted.
	execute(idempotency.Call{Key: "warm", Method: "m"}, idempotency.OutcomeExecuted)
	execute(idempotency.Call{Key: "warm", Method: "m", Retry: true}, idempotency.OutcomeReplayed)
	execute(idempotency.Call{Key: "warm", Method: "m"}, idempotency.OutcomeReplayed)

	plain := measure(func() {
		require.NoError(t, pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `INSERT INTO ledger (note) VALUES ('x')`)
			return err
		}))
	})
	fresh := measure(func() { execute(idempotency.Call{Key: "k", Method: "m"}, idempotency.OutcomeExecuted) })
	replay := measure(func() { execute(idempotency.Call{Key: "k", Method: "m", Retry: true}, idempotency.OutcomeReplayed) })
	unmarked := measure(func() { execute(idempotency.Call{Key: "k", Method: "m"}, idempotency.OutcomeReplayed) })
	retryThatRuns := measure(func() { execute(idempotency.Call{Key: "k2", Method: "m", Retry: true}, idempotency.OutcomeExecuted) })
	t.Logf("round trips: plain BEGIN/INSERT/COMMIT %d, fresh call %d, replay of a retry %d, replay of an unmarked call %d, retry that runs %d",
		plain, fresh, replay, unmarked, retryThatRuns)
	require.EqualValues(t, 3, plain)
	require.Equal(t, plain, fresh, "fresh call")
	require.EqualValues(t, 1, replay, "replay of a call marked as a retry")
	require.EqualValues(t, 2, unmarked, "an unmarked duplicate is found by the claim, then rolled back")
	require.Equal(t, plain+1, retryThatRuns, "a retry whose first attempt never committed")
}

// A scope PostgreSQL cannot store (from a token's subject, say) is rejected
// up front, not reported as an outage that clients would retry forever.
func TestUnstorableScopeIsRejected(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	ctx := context.Background()
	store := migratedStore(t, db)
	for _, scope := range []string{"a\x00b", "\xff\xfe"} {
		res, err := store.Execute(ctx, idempotency.Call{Scope: scope, Key: "k", Method: "m"},
			func(context.Context, pgx.Tx) (proto.Message, error) { t.Fatal("ran"); return nil, nil })
		require.Equal(t, codes.InvalidArgument, status.Code(err), "%q: %v", scope, err)
		require.Equal(t, idempotency.OutcomeRejected, res.Outcome)
	}
	require.Equal(t, 0, db.Count(t, `SELECT count(*) FROM idempotency_keys`))
}

func TestUnstorableCallsAreRejectedUpFront(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	store := migratedStore(t, db)
	run := func(context.Context, pgx.Tx) (proto.Message, error) { t.Error("ran"); return nil, nil }
	for name, call := range map[string]idempotency.Call{
		"scope over the limit":      {Scope: strings.Repeat("s", idempotency.MaxScopeLen+1), Key: "k", Method: "m"},
		"scope at PostgreSQL limit": {Scope: strings.Repeat("s", 3000), Key: "k", Method: "m"},
		"non-UTF-8 method":          {Key: "k", Method: "/svc/\xffM"},
		"NUL in method":             {Key: "k", Method: "/svc/\x00M"},
	} {
		res, err := store.Execute(context.Background(), call, run)
		require.Equal(t, codes.InvalidArgument, status.Code(err), "%s: %v", name, err)
		require.Equal(t, idempotency.OutcomeRejected, res.Outcome, name)
	}
	res, err := store.Execute(context.Background(), idempotency.Call{Scope: strings.Repeat("s", idempotency.MaxScopeLen), Key: strings.Repeat("k", idempotency.MaxKeyLen), Method: "m"},
		func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil })
	require.NoError(t, err, "the longest scope with the longest key fits")
	require.Equal(t, idempotency.OutcomeExecuted, res.Outcome)
}
