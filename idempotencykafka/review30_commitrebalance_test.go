package idempotencykafka_test

import (
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// The broker answers the group's first offset commit with
// REBALANCE_IN_PROGRESS, as Kafka does to a commit that arrives while the
// group is completing a rebalance. With franz-go's default balancer
// (cooperative-sticky) a member keeps its partitions across a rebalance,
// and here no rebalance even follows: the partition never moved.
//
// Before the fix: the consumer takes REBALANCE_IN_PROGRESS for "the
// partition moved" and drops the commit; the client goes on fetching from
// its position, so the records are never delivered again and their offset
// is never committed: the group's lag stays at 3 for as long as no new
// record arrives (and the records are read again at every restart).
//
// Now: a commit refused for a rebalance in progress is
// tried again (after the rebalance, for as long as the member still owns
// the partition), and the committed offset reaches 3.
func TestCommitRefusedDuringARebalanceIsTriedAgain(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	var refused atomic.Int64
	w.cluster.ControlKey(kmsg.OffsetCommit.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		commit := req.(*kmsg.OffsetCommitRequest)
		if commit.Group != "rip-group" {
			w.cluster.KeepControl()
			return nil, nil, false
		}
		resp := commit.ResponseKind().(*kmsg.OffsetCommitResponse)
		for _, topic := range commit.Topics {
			rt := kmsg.NewOffsetCommitResponseTopic()
			rt.Topic = topic.Topic
			for _, p := range topic.Partitions {
				rp := kmsg.NewOffsetCommitResponseTopicPartition()
				rp.Partition = p.Partition
				rp.ErrorCode = kerr.RebalanceInProgress.Code
				rt.Partitions = append(rt.Partitions, rp)
			}
			resp.Topics = append(resp.Topics, rt)
		}
		refused.Add(1)
		return resp, nil, true
	})
	w.produce(t, "credits", amounts(3)...)
	m := w.startMember(t, "rip-group", "credits", idempotencykafka.WithRetryBackoff(time.Millisecond, 10*time.Millisecond))
	waitFor(t, "the three records applied", func() bool { rows, _ := w.credits(t); return rows == 3 })
	deadline := time.Now().Add(20 * time.Second)
	for w.committed(t, "rip-group", "credits") != 3 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	committed := w.committed(t, "rip-group", "credits")
	m.stop()
	require.EqualValues(t, 1, refused.Load(), "one commit refused")
	require.EqualValues(t, 3, committed, "the offsets are committed after the refusal")
}
