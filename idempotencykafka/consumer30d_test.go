package idempotencykafka_test

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// cancelOnPoll is a client hook that cancels a context as soon as a poll
// hands out its first record: the poll returns records with the context
// already done, as it does when a shutdown comes at that moment.
type cancelOnPoll struct {
	once   sync.Once
	cancel func()
}

func (h *cancelOnPoll) OnFetchRecordUnbuffered(_ *kgo.Record, polled bool) {
	if polled {
		h.once.Do(h.cancel)
	}
}

// Run is stopped at the moment its poll returned 10 records, before it
// applied any. Run is then started again on the same client, as a
// supervisor restarts it. The client had fetched past those 10 records.
//
// Before the fix: Run returned without setting the client back, the next
// poll started at record 10, and committing offset 30 skipped records 0
// to 9, which nobody applied: 20 effects, 30 committed.
//
// Now: the poll's partitions are set back to their first record before
// Run returns; the restarted Run applies all 30, once each.
func TestRecordsOfAPollCutByStoppingAreDeliveredAgain(t *testing.T) {
	t.Parallel()
	const n = 30
	w := newWorld(t, 1, "credits")
	w.produce(t, "credits", amounts(n)...)
	first, cancelFirst := context.WithCancel(context.Background())
	defer cancelFirst()
	hook := &cancelOnPoll{cancel: cancelFirst}
	client, err := kgo.NewClient(consumerOpts(w.brokers, "stopped-group", "credits", kgo.WithHooks(hook))...)
	require.NoError(t, err)
	c, err := idempotencykafka.New(w.store, client, credit, idempotencykafka.WithMaxPollRecords(10))
	require.NoError(t, err)

	require.ErrorIs(t, c.Run(first), context.Canceled)
	rows, _ := w.credits(t)
	require.Zero(t, rows, "the stopped Run applied nothing")

	restarted := runCustom(t, w.store, client, credit)
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "stopped-group", "credits") == n })
	restarted.stop()
	rows, distinct := w.credits(t)
	require.Equal(t, n, rows, "one effect per record: the records of the stopped poll were applied")
	require.Equal(t, n, distinct)
}

// Member A applies every record of its two partitions, but the broker
// refuses A's offset commits with REBALANCE_IN_PROGRESS. Member B joins;
// cooperative-sticky moves one of A's partitions to B, which replays its
// records, applies new ones and commits its partition's end. Then A's
// commits are accepted again.
//
// Before the fix: A retried the refused commit after it allowed the
// rebalance, and its retry, accepted in A's new generation, committed
// offsets of the partition B owns by then: B's committed offset fell
// back below the end and stayed there (B had nothing more to commit),
// and its records were read again at every restart.
//
// Now: a commit of a poll is never sent once the poll allowed a rebalance:
// A gives the refused commit up and is delivered the records again on the
// partitions it kept. Every partition's committed offset reaches its end,
// and each record's effect commits once.
func TestARefusedCommitNeverLandsOnAPartitionThatMoved(t *testing.T) {
	t.Parallel()
	const group, n, more = "moved-commit", 40, 20
	w := newWorld(t, 2, "credits")
	var (
		refuseA atomic.Bool
		aID     atomic.Value // the first committing member: A
		refused atomic.Int64
	)
	refuseA.Store(true)
	refuseCommitsOf(w.cluster, group, kerr.RebalanceInProgress.Code, func(req *kmsg.OffsetCommitRequest) bool {
		aID.CompareAndSwap(nil, req.MemberID)
		if req.MemberID != aID.Load() || !refuseA.Load() {
			return false
		}
		refused.Add(1)
		return true
	})
	w.produce(t, "credits", amounts(n)...)
	a := w.startMember(t, group, "credits")
	waitFor(t, "A applied every record", func() bool { rows, _ := w.credits(t); return rows == n })
	waitFor(t, "A's commits refused", func() bool { return refused.Load() >= 2 })

	b := w.startMember(t, group, "credits")
	waitFor(t, "B got a partition", func() bool { return b.assigned.Load() > 0 })
	w.produce(t, "credits", amountsFrom(n, more)...)
	ends := w.ends(t, "credits")
	bs := int32(-1) // B's partition
	waitFor(t, "B committed its partition's end", func() bool {
		for p, at := range w.committedByPartition(t, group, "credits") {
			if at == ends[p] {
				bs = p
			}
		}
		return bs >= 0
	})

	refuseA.Store(false)
	as := 1 - bs // A's partition
	waitFor(t, "A committed its partition's end", func() bool { return w.committedByPartition(t, group, "credits")[as] == ends[as] })
	// A's retry, if it were still to come, comes within its backoff (5 s
	// at most): stopping A waits for it.
	a.stop()
	b.stop()
	require.Equal(t, ends, w.committedByPartition(t, group, "credits"), "no partition's committed offset fell back")
	rows, distinct := w.credits(t)
	require.Equal(t, n+more, rows, "one effect per record")
	require.Equal(t, n+more, distinct)
}
