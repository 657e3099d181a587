package idempotencykafka_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// A partition's records are done and their offset commit is being tried
// again (the broker refused it) when franz-go reports the partition lost:
// OnPartitionsLost arrives for a partition whose goroutine already
// finished. (The test calls the callback itself, as franz-go does, while
// the member still is in the group, so that a commit would get through.)
//
// Now: OnPartitionsLost only cancels partitions still in flight; the
// retried commit goes on, and once the broker answers the lost
// partition's offset is committed: in a real loss, with the member's new
// generation, over the offsets of the partition's new owner.
//
// Should: no offset of a lost partition is committed (the package's
// promise), whether its records were being applied or were done and
// waiting for their commit.
func TestLostPartitionsPendingOffsetIsNotCommitted(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments")
	var refuse atomic.Bool
	var refused atomic.Int64
	refuse.Store(true)
	w.cluster.ControlKey(kmsg.OffsetCommit.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		w.cluster.KeepControl()
		commit := req.(*kmsg.OffsetCommitRequest)
		if commit.Group != "lost-pending" || !refuse.Load() {
			return nil, nil, false
		}
		resp := commit.ResponseKind().(*kmsg.OffsetCommitResponse)
		for _, topic := range commit.Topics {
			rt := kmsg.NewOffsetCommitResponseTopic()
			rt.Topic = topic.Topic
			for _, p := range topic.Partitions {
				rp := kmsg.NewOffsetCommitResponseTopicPartition()
				rp.Partition = p.Partition
				rp.ErrorCode = kerr.CoordinatorLoadInProgress.Code
				rt.Partitions = append(rt.Partitions, rp)
			}
			resp.Topics = append(resp.Topics, rt)
		}
		refused.Add(1)
		return resp, nil, true
	})
	w.produce(t, "payments", rec("r", "acct-1", "1"))
	m := w.startMember(t, "lost-pending", "payments", idempotencykafka.WithRetryBackoff(time.Millisecond, 20*time.Millisecond))
	waitFor(t, "the record applied and its commit refused twice", func() bool {
		rows, _ := w.credits(t)
		return rows == 1 && refused.Load() >= 2
	})
	idempotencykafka.OnPartitionsLost(context.Background(), m.client, map[string][]int32{"payments": {0}})
	refuse.Store(false)
	time.Sleep(2 * time.Second) // the commit, retried every 20 ms at most, would be through
	committed := w.committed(t, "lost-pending", "payments")
	m.stop()
	require.Zero(t, committed, "the lost partition's offset is not committed")
}
