package idempotency_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

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

func TestDeleteExpiredAndCleaner(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	ctx := context.Background()
	store := migratedStore(t, db)
	run := func(key string, ttl time.Duration) {
		_, err := store.Execute(ctx, idempotency.Call{Key: key, Method: "m", TTL: ttl},
			func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil })
		require.NoError(t, err)
	}
	for i := 0; i < 5; i++ {
		run("short-"+string(rune('a'+i)), time.Millisecond)
	}
	run("long", time.Hour)
	time.Sleep(20 * time.Millisecond)

	n, err := store.DeleteExpired(ctx, 2)
	require.NoError(t, err)
	require.EqualValues(t, 5, n, "every expired key, in batches of 2")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM idempotency_keys`), "the live key is kept")
	_, err = store.DeleteExpired(ctx, 0)
	require.Error(t, err)
	for i := 0; i < 3; i++ {
		run("again-"+string(rune('a'+i)), time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond)

	cctx, cancel := context.WithCancel(ctx)
	stopped := make(chan error, 1)
	go func() { stopped <- store.RunCleaner(cctx, 10*time.Millisecond, 1, nil) }()
	require.Eventually(t, func() bool { return db.Count(t, `SELECT count(*) FROM idempotency_keys`) == 1 }, 30*time.Second, 10*time.Millisecond)
	cancel()
	select {
	case err := <-stopped:
		require.ErrorIs(t, err, context.Canceled)
	case <-time.After(30 * time.Second):
		t.Fatal("cleaner did not stop with its context")
	}
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'long'`), "live keys are kept")
}

// RunCleaner returns with its context both while it sleeps between rounds
// and in the middle of a DELETE blocked by a lock, without reporting the
// cancellation as an error and without leaving its statement running.
func TestCleanerStopsWithItsContext(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 4)
	ctx := context.Background()
	store := migratedStore(t, db)
	expire := func(key string) {
		_, err := store.Execute(ctx, idempotency.Call{Key: key, Method: "m", TTL: time.Millisecond},
			func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil })
		require.NoError(t, err)
	}
	var reported atomic.Int64
	run := func(cctx context.Context) <-chan error {
		stopped := make(chan error, 1)
		go func() {
			stopped <- store.RunCleaner(cctx, time.Hour, 100, func(error) { reported.Add(1) })
		}()
		return stopped
	}
	requireStops := func(stopped <-chan error, cancel context.CancelFunc, when string) time.Duration {
		start := time.Now()
		cancel()
		select {
		case err := <-stopped:
			require.ErrorIs(t, err, context.Canceled, when)
		case <-time.After(30 * time.Second):
			t.Fatalf("cleaner did not stop with its context %s", when)
		}
		return time.Since(start)
	}

	// Between rounds: the first round ran, the next is an hour away.
	expire("a")
	time.Sleep(5 * time.Millisecond)
	cctx, cancel := context.WithCancel(ctx)
	stopped := run(cctx)
	require.Eventually(t, func() bool { return db.Count(t, `SELECT count(*) FROM idempotency_keys`) == 0 }, 30*time.Second, 5*time.Millisecond)
	idle := requireStops(stopped, cancel, "between rounds")

	// Mid-statement: another transaction locks the table, so the cleaner's
	// DELETE waits on the lock until the context is cancelled.
	expire("b")
	time.Sleep(5 * time.Millisecond)
	locker, err := db.Pool.Begin(ctx)
	require.NoError(t, err)
	t.Cleanup(func() { _ = locker.Rollback(ctx) })
	_, err = locker.Exec(ctx, `LOCK TABLE idempotency_keys IN ACCESS EXCLUSIVE MODE`)
	require.NoError(t, err)
	lockerPID := locker.Conn().PgConn().PID()
	blocked := func() int {
		return db.Count(t, `SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))`, lockerPID)
	}
	cctx, cancel = context.WithCancel(ctx)
	stopped = run(cctx)
	require.Eventually(t, func() bool { return blocked() == 1 }, 30*time.Second, 5*time.Millisecond, "the cleaner's DELETE waits on the lock")
	busy := requireStops(stopped, cancel, "mid-statement")
	require.Eventually(t, func() bool { return blocked() == 0 }, 30*time.Second, 5*time.Millisecond, "the cancelled DELETE no longer runs")
	require.NoError(t, locker.Rollback(ctx))

	require.Zero(t, reported.Load(), "stopping is not an error round")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM idempotency_keys`), "the cancelled round deleted nothing")
	t.Logf("cleaner stopped %v after cancel between rounds, %v after cancel mid-statement; 0 errors reported", idle.Round(time.Microsecond), busy.Round(time.Microsecond))
}

// The engine's own reads and writes of the key table outside calls (the
// cleaner, Inspect, Forget) never fail a SERIALIZABLE call.
func TestCleanerNeverFailsSerializableCalls(t *testing.T) {
	t.Parallel()
	db := testdb.NewConfigured(t, func(c *pgxpool.Config) {
		c.ConnConfig.RuntimeParams["default_transaction_isolation"] = "serializable"
	})
	store := migratedStore(t, db)
	ctx := context.Background()
	_, err := db.Pool.Exec(ctx, `CREATE TABLE acct (id int PRIMARY KEY, bal int); INSERT INTO acct VALUES (1, 0)`)
	require.NoError(t, err)
	_, err = store.Execute(ctx, idempotency.Call{Key: "warm", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) { return nil, nil })
	require.NoError(t, err)
	_, err = store.Execute(ctx, idempotency.Call{Key: "k", Method: "m"}, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		var b int
		if err := tx.QueryRow(ctx, `SELECT bal FROM acct WHERE id = 1`).Scan(&b); err != nil {
			return nil, err
		}
		if _, err := db.Pool.Exec(ctx, `UPDATE acct SET bal = bal + 1 WHERE id = 1`); err != nil {
			return nil, err
		}
		if _, err := store.DeleteExpired(ctx, 100); err != nil {
			return nil, err
		}
		if _, err := store.Inspect(ctx, "", "warm"); err != nil {
			return nil, err
		}
		return wrapperspb.String("ok"), nil
	})
	require.NoError(t, err)
}

// Tiny TTLs reused concurrently, with the cleaner and Forget racing the
// calls: the handler of a key never runs twice at once, nobody gets an
// error other than "in progress", and no lock is left.
func TestTinyTTLsWithCleanerAndForget(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 10)
	store := migratedStore(t, db, idempotency.WithInProgressWait(5*time.Second))
	createLedger(t, db)
	ctx, cancel := context.WithCancel(context.Background())
	var running sync.Map
	var overlaps, runs atomic.Int64
	fn := func(key string) idempotency.Func {
		return func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
			v, _ := running.LoadOrStore(key, new(atomic.Int64))
			if v.(*atomic.Int64).Add(1) > 1 {
				overlaps.Add(1)
			}
			defer v.(*atomic.Int64).Add(-1)
			runs.Add(1)
			if _, err := tx.Exec(ctx, `INSERT INTO ledger (note) SELECT $1::text FROM pg_sleep(0.002)`, key); err != nil {
				return nil, err
			}
			return wrapperspb.String(key), nil
		}
	}
	var bg sync.WaitGroup
	bg.Go(func() { _ = store.RunCleaner(ctx, time.Millisecond, 100, nil) })
	bg.Go(func() {
		for ctx.Err() == nil {
			for k := range 3 {
				_ = store.Forget(ctx, "", fmt.Sprintf("k%d", k), "")
			}
		}
	})
	var mu sync.Mutex
	bad := map[string]int{}
	var wg sync.WaitGroup
	for g := range 16 {
		wg.Go(func() {
			for i := range 30 {
				key := fmt.Sprintf("k%d", (g+i)%3)
				ttl := time.Duration(1+(i%3)*5) * time.Millisecond
				_, err := store.Execute(context.Background(), idempotency.Call{Key: key, Method: "m", TTL: ttl, Retry: i%2 == 0}, fn(key))
				if err != nil && !idempotency.IsInProgress(err) {
					mu.Lock()
					bad[status.Code(err).String()+": "+err.Error()]++
					mu.Unlock()
				}
			}
		})
	}
	wg.Wait()
	cancel()
	bg.Wait()
	t.Logf("%d runs", runs.Load())
	require.Empty(t, bad)
	require.Zero(t, overlaps.Load(), "a key's handler ran twice at once")
	// A Forget cut short by the cancellation may hold its locks until its
	// backend notices the closed connection.
	require.Eventually(t, func() bool { return heldKeyLocks(t, db, "", []string{"k0", "k1", "k2"}) == 0 }, 10*time.Second, 10*time.Millisecond)
}
