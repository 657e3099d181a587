package idempotencykafka_test

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// A partition's records are done and their offset commit is being tried
// again (the broker refused it) when franz-go reports the partition lost:
// OnPartitionsLost arrives for a partition whose goroutine already
// finished. (The test calls the callback itself, as franz-go does, while
// the member still is in the group, so that a commit would get through.)
//
// Before the fix: OnPartitionsLost only cancels partitions still in flight; the
// retried commit goes on, and once the broker answers the lost
// partition's offset is committed: in a real loss, with the member's new
// generation, over the offsets of the partition's new owner.
//
// Now: no offset of a lost partition is committed (the package's
// promise), whether its records were being applied or were done and
// waiting for their commit.
func TestLostPartitionsPendingOffsetIsNotCommitted(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments")
	var refuse atomic.Bool
	var refused atomic.Int64
	refuse.Store(true)
	refuseCommits(w.cluster, "lost-pending", kerr.CoordinatorLoadInProgress.Code, func() bool {
		if !refuse.Load() {
			return false
		}
		refused.Add(1)
		return true
	})
	w.produce(t, "payments", rec("r", "acct-1", "1"))
	var dropped atomic.Bool
	m := w.startMember(t, "lost-pending", "payments", idempotencykafka.WithRetryBackoff(time.Millisecond, 20*time.Millisecond),
		idempotencykafka.WithErrorHandler(func(err error) {
			if strings.Contains(err.Error(), "offsets of lost partitions are not committed: payments/0@1") {
				dropped.Store(true)
			}
		}))
	waitFor(t, "the record applied and its commit refused twice", func() bool {
		rows, _ := w.credits(t)
		return rows == 1 && refused.Load() >= 2
	})
	idempotencykafka.OnPartitionsLost(context.Background(), m.client, map[string][]int32{"payments": {0}})
	refuse.Store(false)
	waitFor(t, "the lost partition's commit given up", dropped.Load)
	committed := w.committed(t, "lost-pending", "payments")
	m.stop()
	require.Zero(t, committed, "the lost partition's offset is not committed")
}
