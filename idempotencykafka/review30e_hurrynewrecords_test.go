package idempotencykafka_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// Member A polls 40 records of two partitions (20 each); its handler takes
// 100 ms per record (a slow downstream call that succeeds), so the poll's
// work is about 2 s per partition. A's rebalance timeout is 10 minutes.
// Member B joins while A is at its first few records. franz-go tells A
// (OnPartitionsCallbackBlocked) that a rebalance waits for its poll.
//
// The promise (OnPartitionsCallbackBlocked's doc): "an attempt under way
// ends (its effect committed or rolled back), no other begins", and the
// poll lets the rebalance go ahead. So between the signal and A's revoke
// callback (which runs only once the poll allowed the rebalance, eager
// balancer) at most one record per partition may begin.
//
// The test counts the handler calls that began after the signal and
// before the revoke.
func TestReview30eHurriedPollBeginsNoNewRecord(t *testing.T) {
	t.Parallel()
	const group, n = "hurry-new-records", 40
	w := newWorld(t, 2, "credits")
	w.produce(t, "credits", amounts(n)...)

	var begun, begunAtSignal, begunAtRevoke atomic.Int64
	begunAtSignal.Store(-1)
	begunAtRevoke.Store(-1)
	var signalled atomic.Bool
	handle := func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
		begun.Add(1)
		select {
		case <-time.After(100 * time.Millisecond):
		case <-ctx.Done():
			return ctx.Err()
		}
		return credit(ctx, tx, r)
	}
	a := w.startCustom(t, w.store, group, "credits", handle, []kgo.Opt{
		kgo.RebalanceTimeout(10 * time.Minute),
		kgo.Balancers(kgo.RangeBalancer()),
		kgo.OnPartitionsCallbackBlocked(func(ctx context.Context, cl *kgo.Client) {
			if signalled.CompareAndSwap(false, true) {
				begunAtSignal.Store(begun.Load())
			}
			idempotencykafka.OnPartitionsCallbackBlocked(ctx, cl)
		}),
		kgo.OnPartitionsRevoked(func(context.Context, *kgo.Client, map[string][]int32) {
			if signalled.Load() {
				begunAtRevoke.CompareAndSwap(-1, begun.Load())
			}
		}),
	})
	waitFor(t, "A began its first records", func() bool { return begun.Load() >= 4 })
	b := w.startMemberWith(t, memberConfig{store: w.store, client: []kgo.Opt{kgo.Balancers(kgo.RangeBalancer())}}, group, "credits")
	waitFor(t, "A's poll allowed the rebalance", func() bool { return begunAtRevoke.Load() >= 0 })
	t.Logf("handler calls begun: %d at the signal, %d when the poll allowed the rebalance", begunAtSignal.Load(), begunAtRevoke.Load())
	assert.LessOrEqual(t, begunAtRevoke.Load()-begunAtSignal.Load(), int64(2),
		"records begun by A's poll after it was told a rebalance waits (at most one per partition, racing the signal)")

	waitFor(t, "every offset committed", func() bool { return w.committed(t, group, "credits") == n })
	a.stop()
	b.stop()
	rows, distinct := w.credits(t)
	require.Equal(t, n, rows)
	require.Equal(t, n, distinct)
}
