package idempotencykafka_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// A poll of two partitions: partition 0's record is done at once,
// partition 1's takes a while. A second after partition 0 finished its
// offset is committed on its own (the flush), and the broker answers
// REBALANCE_IN_PROGRESS: a second member is joining. Then partition 1's
// record is done too: every record of the poll is done.
//
// Before the fix: the flush's commit was started while a partition still worked, so
// it retries with allDone false and never allows the rebalance; the loop
// that would see partition 1 finish is the one blocked in that retry. The
// group's rebalance waits for the first member until its rebalance
// timeout (60 s here), and the joining member gets nothing.
//
// Now: once the poll's records are all done, the rebalance is allowed
// (as it is when the commit that meets REBALANCE_IN_PROGRESS is the
// poll's last one), and the second member gets its partitions.
func TestRebalanceIsAllowedOnceAllDoneWhileTheFlushCommitIsRetried(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 2, "payments")
	var refuse atomic.Bool
	var refused atomic.Int64
	refuse.Store(true)
	refuseCommits(w.cluster, "flush-rip", kerr.RebalanceInProgress.Code, func() bool {
		if !refuse.Load() {
			return false
		}
		refused.Add(1)
		return true
	})
	defer refuse.Store(false)
	// Round robin: "fast" on partition 0, "slow" on partition 1.
	w.produce(t, "payments", rec("fast", "acct-1", "1"), rec("slow", "acct-1", "2"))

	release := make(chan struct{})
	handle := func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
		if header(r, idempotencykafka.DefaultIDHeader) == "slow" {
			select {
			case <-release:
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return credit(ctx, tx, r)
	}
	client, err := kgo.NewClient(consumerOpts(w.brokers, "flush-rip", "payments", kgo.RebalanceTimeout(60*time.Second))...)
	require.NoError(t, err)
	defer client.Close()
	c, err := idempotencykafka.New(w.store, client, handle, idempotencykafka.WithRetryBackoff(time.Millisecond, 20*time.Millisecond))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// One poll with both partitions' records, as Run's loop would have.
	fetches := pollRecords(t, client, 2)
	done := make(chan error, 1)
	go func() {
		err := c.ProcessFetches(ctx, fetches)
		client.AllowRebalance()
		done <- err
	}()
	waitFor(t, "the flush's commit refused for a rebalance, twice", func() bool { return refused.Load() >= 2 })
	close(release)
	waitFor(t, "every record of the poll done", func() bool { rows, _ := w.credits(t); return rows == 2 })

	second := w.startMember(t, "flush-rip", "payments")
	deadline := time.Now().Add(20 * time.Second)
	for second.assigned.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	assigned := second.assigned.Load()
	refuse.Store(false)
	cancel()
	<-done
	second.stop()
	require.Positive(t, assigned, "the joining member got partitions while the first member's records were all done")
}
