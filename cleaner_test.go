package idempotency_test

import (
	"context"
	"sync"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// noCalls is the Tracer half of a CleanerTracer that looks at no call.
type noCalls struct{}

func (noCalls) TraceCallStart(ctx context.Context, _ idempotency.TraceCallStartData) context.Context {
	return ctx
}
func (noCalls) TraceCallEnd(context.Context, idempotency.TraceCallEndData) {}

// batchRecorder is a CleanerTracer that keeps every batch it sees.
type batchRecorder struct {
	noCalls
	mu      sync.Mutex
	batches []idempotency.TraceCleanerBatchData
}

func (r *batchRecorder) TraceCleanerBatch(_ context.Context, data idempotency.TraceCleanerBatchData) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.batches = append(r.batches, data)
}

// expiredKeys inserts n keys that expired an hour ago.
func expiredKeys(t *testing.T, db *testdb.DB, n int) {
	t.Helper()
	_, err := db.Pool.Exec(context.Background(), `INSERT INTO idempotency_keys (scope, key, method, fingerprint, state, created_at, expires_at)
SELECT 's', 'expired-' || i, 'm', '\x00', 'succeeded', now() - interval '2 hours', now() - interval '1 hour' FROM generate_series(1, $1::int) i`, n)
	require.NoError(t, err)
}

// DeleteExpired is a round of the cleaner: 25 expired keys in batches of
// 10 are three batches, the two full ones each followed by a pause of nine
// times its duration, the short one by none.
func TestDeleteExpiredPacesItsBatches(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	ctx := context.Background()
	tracer := &batchRecorder{}
	store := migratedStore(t, db, idempotency.WithTracer(tracer))
	expiredKeys(t, db, 25)

	n, err := store.DeleteExpired(ctx, 10)
	require.NoError(t, err)
	require.EqualValues(t, 25, n)
	require.Zero(t, db.Count(t, `SELECT count(*) FROM idempotency_keys`))
	require.Len(t, tracer.batches, 3)
	for i, want := range []int64{10, 10, 5} {
		b := tracer.batches[i]
		require.Equal(t, want, b.Deleted, "batch %d", i)
		if i < 2 {
			require.Equal(t, 9*b.Duration, b.Pause, "a full batch is followed by nine times its duration")
		} else {
			require.Zero(t, b.Pause, "the round ends with the short batch")
		}
	}

	_, err = store.DeleteExpired(ctx, 0)
	require.ErrorContains(t, err, "batch size must be positive")
}

// A context done during a pause ends DeleteExpired with what it
// deleted so far: the pause is a wait, not more batches.
func TestDeleteExpiredStopsInAPause(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 2)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	tracer := &batchRecorder{}
	store := migratedStore(t, db, idempotency.WithTracer(idempotency.JoinTracers(tracer, cancelAfterFirstBatch(cancel))))
	expiredKeys(t, db, 25)

	n, err := store.DeleteExpired(ctx, 10)
	require.ErrorIs(t, err, context.Canceled)
	require.EqualValues(t, 10, n, "one batch, then the pause the context ended")
	require.Len(t, tracer.batches, 1)
	require.Equal(t, 15, db.Count(t, `SELECT count(*) FROM idempotency_keys`))
}

// cancelAfterFirstBatch is a CleanerTracer that cancels when a batch ends.
type cancelAfterFirstBatch context.CancelFunc

func (c cancelAfterFirstBatch) TraceCallStart(ctx context.Context, _ idempotency.TraceCallStartData) context.Context {
	return ctx
}
func (c cancelAfterFirstBatch) TraceCallEnd(context.Context, idempotency.TraceCallEndData) {}
func (c cancelAfterFirstBatch) TraceCleanerBatch(context.Context, idempotency.TraceCleanerBatchData) {
	c()
}
