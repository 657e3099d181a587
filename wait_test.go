package idempotency_test

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// Duplicates of a slow call wait for it for the in-progress wait (200ms
// here), get Aborted, and give their database connections back: right after
// they are answered, the pool holds only the slow call's connection.
func TestDuplicatesHoldNoConnectionBeyondTheWait(t *testing.T) {
	t.Parallel()
	const wait, duplicates = 200 * time.Millisecond, 8
	release := make(chan struct{})
	holding := make(chan struct{})
	var e *env
	e = newEnv(t, envConfig{
		storeOpts: []idempotency.StoreOption{idempotency.WithInProgressWait(wait)},
		handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			resp, err := e.insertLedger(ctx, req)
			close(holding)
			select { // released by the test, or abandoned when it fails
			case <-release:
			case <-ctx.Done():
			}
			return resp, err
		},
	})
	ctx := context.Background()
	slow := make(chan reply, 1)
	go func() { slow <- e.call(ctx, methodCharge, "k", "x") }()
	await(t, holding, "the first call's handler to run")
	require.EqualValues(t, 1, e.db.Pool.Stat().AcquiredConns(), "the slow call holds one connection")

	var wg sync.WaitGroup
	var longest atomic.Int64
	for range duplicates {
		wg.Go(func() {
			start := time.Now()
			r := e.call(ctx, methodCharge, "k", "x")
			longest.Store(max(longest.Load(), int64(time.Since(start))))
			if status.Code(r.err) != codes.Aborted || !idempotency.IsInProgress(r.err) {
				t.Errorf("duplicate: want Aborted (in progress), got %v", r.err)
			}
			if d := time.Since(start); d < wait {
				t.Errorf("duplicate answered after %v, before the in-progress wait of %v", d, wait)
			}
		})
	}
	wg.Wait()
	// Polled briefly only because the pool's own health check may borrow
	// idle connections for a moment; the slow call is still running.
	answered := time.Now()
	for e.db.Pool.Stat().AcquiredConns() != 1 && time.Since(answered) < 500*time.Millisecond {
		time.Sleep(time.Millisecond)
	}
	acquired := e.db.Pool.Stat().AcquiredConns()
	close(release)
	require.EqualValues(t, 1, acquired, "right after the duplicates are answered, only the slow call holds a connection")
	// The slow call was released only after every duplicate was answered:
	// none of them waited for it.
	require.NoError(t, (<-slow).err)
	require.Zero(t, e.db.Pool.Stat().AcquiredConns(), "no connection is held once every call is answered")
	require.EqualValues(t, 1, e.runs.Load())
	t.Logf("in-progress wait %v: %d duplicates Aborted, slowest answered after %v, connections held afterwards: %d",
		wait, duplicates, time.Duration(longest.Load()).Round(time.Millisecond), acquired)
}

// Duplicates waiting for a slow call hold no pooled connection while they
// wait: on a pool of 2, with the slow call holding one and 10 duplicates of
// it waiting, calls with new keys and the slow handler's own read of the
// pool are served at once, not after the slow call.
func TestWaitingDuplicatesHoldNoConnection(t *testing.T) {
	t.Parallel()
	const duplicates, fresh = 10, 4
	db := suiteDB(t)
	pool := schemaPool(t, db.Schema, 2, nil)
	holding, release := make(chan struct{}), make(chan struct{})
	readTook := make(chan time.Duration, 1)
	srv := startReplica(t, pool, replicaConfig{
		storeOpts: []idempotency.StoreOption{idempotency.WithInProgressWait(30 * time.Second)},
		handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			resp, err := keyedLedger(ctx, req)
			if req.GetValue() != "slow" {
				return resp, err
			}
			close(holding)
			select { // released by the test, or abandoned when it fails
			case <-release:
			case <-ctx.Done():
			}
			start := time.Now()
			var one int
			if err := pool.QueryRow(ctx, `SELECT 1`).Scan(&one); err != nil {
				return nil, err
			}
			readTook <- time.Since(start)
			return resp, err
		},
	})
	conn := dial(t, srv.addr)
	as := func(key string) context.Context {
		return metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, key)
	}
	slow := make(chan reply, 1)
	go func() { slow <- invoke(as("slow-key"), conn, methodCharge, "slow") }()
	await(t, holding, "the first call's handler to run")

	before := pool.Stat().AcquireCount()
	var wg sync.WaitGroup
	dups := make([]reply, duplicates)
	for i := range dups {
		wg.Go(func() { dups[i] = invoke(as("slow-key"), conn, methodCharge, "slow") })
	}
	// The duplicates are waiting: each has looked at the key more than
	// once, borrowing the pool's one free connection only for its probe.
	// Were one of them to keep it, the calls below would wait.
	require.Eventually(t, func() bool { return pool.Stat().AcquireCount()-before >= 3*duplicates }, liveness, time.Millisecond, "the duplicates to probe the held key")

	var freshWG sync.WaitGroup
	took := make([]time.Duration, fresh)
	for i := range took {
		freshWG.Go(func() {
			start := time.Now()
			r := invoke(as(fmt.Sprintf("fresh-%d", i)), conn, methodCharge, fmt.Sprintf("fresh %d", i))
			took[i] = time.Since(start)
			if r.err != nil || r.replayed {
				t.Errorf("fresh call %d: %v (replayed %t)", i, r.err, r.replayed)
			}
		})
	}
	done := make(chan struct{})
	go func() { freshWG.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(liveness): // only so that a broken engine fails rather than hangs
		t.Error("calls with new keys waited for the slow call: duplicates are holding the pool")
	}
	close(release)
	<-done
	read := <-readTook
	require.NoError(t, (<-slow).err)
	wg.Wait()
	for i, r := range dups {
		require.NoError(t, r.err, "duplicate %d", i)
		require.True(t, r.replayed, "duplicate %d gets the slow call's stored response", i)
	}
	require.EqualValues(t, 1+fresh, srv.execs.Load())
	// Had the duplicates held the pool's second connection, the slow
	// handler's read would have waited for them, and they for it, until
	// their in-progress wait ran out and they failed Aborted: each got the
	// slow call's response instead.
	t.Logf("pool of 2, %d duplicates waiting: %d calls with new keys took %v; the slow handler's pool read took %v",
		duplicates, fresh, took, read.Round(time.Microsecond))
}

// With statement_timeout shorter than the in-progress wait, a duplicate
// still gets the first call's result: no statement waits for a lock.
func TestStatementTimeoutShorterThanTheWait(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	pool := schemaPool(t, db.Schema, 4, func(c *pgxpool.Config) { c.ConnConfig.RuntimeParams["statement_timeout"] = "300ms" })
	holding := make(chan struct{})
	srv := startReplica(t, pool, replicaConfig{
		storeOpts: []idempotency.StoreOption{idempotency.WithInProgressWait(liveness)},
		handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
			resp, err := keyedLedger(ctx, req)
			if req.GetValue() == "slow" {
				close(holding)
				time.Sleep(time.Second) // past statement_timeout, within the wait
			}
			return resp, err
		},
	})
	conn := dial(t, srv.addr)
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "k")
	first := make(chan reply, 1)
	go func() { first <- invoke(ctx, conn, methodCharge, "slow") }()
	await(t, holding, "the first call's handler to run")
	dup := invoke(ctx, conn, methodCharge, "slow")
	require.NoError(t, dup.err, "a duplicate outwaits statement_timeout")
	require.True(t, dup.replayed)
	require.NoError(t, await(t, first, "the first call").err)
}
