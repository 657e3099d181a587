package idempotency_test

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

func TestProcessMessageAppliesEachIDOnce(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 16)
	ctx := context.Background()
	// The redeliveries below wait for the one that runs, however slowly it goes.
	store := migratedStore(t, db, idempotency.WithInProgressWait(liveness))
	_, err := db.Pool.Exec(ctx, `CREATE TABLE events (msg_id text NOT NULL, body text NOT NULL)`)
	require.NoError(t, err)
	apply := func(id, body string) (idempotency.Outcome, error) {
		return store.ProcessMessage(ctx, idempotency.Message{Scope: "orders/billing", ID: id, Body: []byte(body)},
			func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `INSERT INTO events VALUES ($1, $2)`, id, body)
				return err
			})
	}

	// Eight redeliveries of one message at once: one effect.
	var wg sync.WaitGroup
	outcomes := make(chan idempotency.Outcome, 8)
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			o, err := apply("m-1", "paid")
			require.NoError(t, err)
			outcomes <- o
		}()
	}
	wg.Wait()
	close(outcomes)
	seen := map[idempotency.Outcome]int{}
	for o := range outcomes {
		seen[o]++
	}
	require.Equal(t, map[idempotency.Outcome]int{idempotency.OutcomeExecuted: 1, idempotency.OutcomeReplayed: 7}, seen,
		"exactly one delivery is processed, the rest are duplicates")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM events WHERE msg_id = 'm-1'`))

	o, err := apply("m-1", "refunded")
	require.ErrorIs(t, err, idempotency.ErrKeyReused, "same ID, different body")
	require.Equal(t, idempotency.OutcomeKeyReused, o)

	// A failed attempt leaves the ID unprocessed; a Final error is stored.
	o, err = store.ProcessMessage(ctx, idempotency.Message{Scope: "s", ID: "m-2"}, func(ctx context.Context, tx pgx.Tx) error {
		_, _ = tx.Exec(ctx, `INSERT INTO events VALUES ('m-2', 'x')`)
		return errors.New("downstream down")
	})
	require.Error(t, err)
	require.Equal(t, idempotency.OutcomeReleased, o)
	require.False(t, idempotency.IsFinal(err), "an unmarked error is not stored")
	o, err = apply("m-2", "x")
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, o, "a failed attempt does not count as processed")

	poison := status.Error(codes.InvalidArgument, "unparsable")
	o, err = store.ProcessMessage(ctx, idempotency.Message{Scope: "s", ID: "m-3"}, func(context.Context, pgx.Tx) error {
		return idempotency.Final(poison)
	})
	require.Equal(t, codes.InvalidArgument, status.Code(err))
	require.Equal(t, idempotency.OutcomeExecuted, o)
	require.True(t, idempotency.IsFinal(err), "the first delivery learns its outcome was stored")
	o, err = store.ProcessMessage(ctx, idempotency.Message{Scope: "s", ID: "m-3"}, func(context.Context, pgx.Tx) error {
		t.Fatal("a poison message stored as final must not run again")
		return nil
	})
	require.Equal(t, idempotency.OutcomeReplayed, o)
	require.Equal(t, codes.InvalidArgument, status.Code(err), "the stored outcome is returned")
	require.True(t, idempotency.IsFinal(err))

	o, err = store.ProcessMessage(ctx, idempotency.Message{Scope: "s", ID: "m-4", Body: nil}, func(context.Context, pgx.Tx) error { return nil })
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, o)
	o, err = store.ProcessMessage(ctx, idempotency.Message{Scope: "s", ID: "m-4", Body: []byte{}}, func(context.Context, pgx.Tx) error { return nil })
	require.NoError(t, err, "a nil and an empty body are the same body")
	require.Equal(t, idempotency.OutcomeReplayed, o)

	cancelled, cancel := context.WithCancel(ctx)
	cancel()
	_, err = store.ProcessMessage(cancelled, idempotency.Message{Scope: "s", ID: "m-5"}, func(context.Context, pgx.Tx) error { return nil })
	require.ErrorIs(t, err, context.Canceled, "the caller's cancellation is reported as such")
	require.Equal(t, codes.Canceled, status.Code(err), "and as a gRPC status")

	o, err = store.ProcessMessage(ctx, idempotency.Message{Scope: "s", ID: ""}, func(context.Context, pgx.Tx) error { return nil })
	require.ErrorIs(t, err, idempotency.ErrInvalidKey)
	require.Equal(t, idempotency.OutcomeRejected, o)
	require.ErrorContains(t, err, "message ID: key is empty", "the error names the message ID, not a gRPC header")
	require.NotContains(t, err.Error(), idempotency.MetadataKey)
}

// A consumer whose scope PostgreSQL cannot store is misconfigured: its
// messages are good, and come back once it is fixed.
func TestBadConsumerScopeRedeliversGoodMessages(t *testing.T) {
	t.Parallel()
	store := migratedStore(t, testdb.New(t, 2))
	o, err := store.ProcessMessage(context.Background(), idempotency.Message{Scope: strings.Repeat("s", idempotency.MaxScopeLen+1), ID: "m-1", Body: []byte("good")},
		func(context.Context, pgx.Tx) error { return nil })
	require.Equal(t, idempotency.OutcomeMisconfigured, o)
	require.Equal(t, codes.Internal, status.Code(err))
	require.Equal(t, idempotency.Redeliver, idempotency.DispositionOf(o, err))
}
