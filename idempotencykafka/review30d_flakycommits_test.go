package idempotencykafka_test

import (
	"context"
	"math/rand/v2"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// One member on 16 partitions; a third of its offset commits, mid-poll
// ones included, are refused at random, with REBALANCE_IN_PROGRESS (the
// poll's commit given up, the partitions set back), or UNKNOWN_MEMBER_ID
// (taken for "moved": the rest of the partition's records left undone,
// set back), while the client keeps every partition and has buffered
// fetches of partitions the poll did not take (WithMaxPollRecords(25)).
// Every rewind must leave the client at a record no later than the first
// one not applied: every record applied once, every partition committed
// to its end.
func TestRandomlyRefusedCommitsNeverSkipARecord(t *testing.T) {
	t.Parallel()
	const group, topic, n = "flaky-commits", "credits", 3200
	w := newWorld(t, 16, topic)
	var refusing atomic.Bool
	refusing.Store(true)
	var refusedRIP, refusedMoved atomic.Int64
	var rngMu sync.Mutex
	rng := rand.New(rand.NewPCG(1, 2))
	w.cluster.ControlKey(kmsg.OffsetCommit.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		w.cluster.KeepControl()
		commit := req.(*kmsg.OffsetCommitRequest)
		if commit.Group != group || !refusing.Load() {
			return nil, nil, false
		}
		rngMu.Lock()
		roll := rng.IntN(6)
		rngMu.Unlock()
		var code int16
		switch roll {
		case 0:
			code = kerr.RebalanceInProgress.Code
			refusedRIP.Add(1)
		case 1:
			code = kerr.UnknownMemberID.Code
			refusedMoved.Add(1)
		default:
			return nil, nil, false
		}
		resp := commit.ResponseKind().(*kmsg.OffsetCommitResponse)
		for _, tp := range commit.Topics {
			rt := kmsg.NewOffsetCommitResponseTopic()
			rt.Topic = tp.Topic
			for _, p := range tp.Partitions {
				rp := kmsg.NewOffsetCommitResponseTopicPartition()
				rp.Partition = p.Partition
				rp.ErrorCode = code
				rt.Partitions = append(rt.Partitions, rp)
			}
			resp.Topics = append(resp.Topics, rt)
		}
		return resp, nil, true
	})
	m := w.startMemberWith(t, memberConfig{store: w.store, client: []kgo.Opt{kgo.FetchMaxPartitionBytes(2 << 10)}}, group, topic,
		idempotencykafka.WithMaxPollRecords(25),
		idempotencykafka.WithCommitEvery(4),
		idempotencykafka.WithRetryBackoff(time.Millisecond, 20*time.Millisecond))
	for i := 0; i < n; i += 400 {
		w.produce(t, topic, amountsFrom(i, 400)...)
		time.Sleep(300 * time.Millisecond)
	}
	waitFor(t, "every record applied or the chaos long enough", func() bool {
		rows, _ := w.credits(t)
		return rows >= n
	})
	refusing.Store(false)
	ends := w.ends(t, topic)
	waitFor(t, "every partition committed to its end", func() bool {
		var sum int64
		for _, at := range w.committedByPartition(t, group, topic) {
			sum += at
		}
		return sum == n
	})
	m.stop()
	require.Equal(t, ends, w.committedByPartition(t, group, topic))
	rows, distinct := w.credits(t)
	t.Logf("refused %d with REBALANCE_IN_PROGRESS, %d with UNKNOWN_MEMBER_ID; %d executed, %d replayed", refusedRIP.Load(), refusedMoved.Load(), m.executed.Load(), m.replayed.Load())
	require.Equal(t, n, rows)
	require.Equal(t, n, distinct)
	_ = context.Background
}
