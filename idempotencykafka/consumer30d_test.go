package idempotencykafka_test

import (
	"context"
	"errors"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/exactlyonce/idempotency"
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

// Two Consumers of one client, as an application with a second handler
// might make them, both Run. Each Run's poll takes the next records of the
// partition, and each commits the offset after its own: past records the
// other has not applied yet. Stopped then, the group restarts after
// records nobody applied (an outside review: 15 of 20 applied after a
// restart). The second Run is refused while the first polls; once the
// first has returned, the second runs.
func TestASecondRunOnAClientIsRefused(t *testing.T) {
	t.Parallel()
	const n = 20
	w := newWorld(t, 1, "credits")
	w.produce(t, "credits", amounts(n)...)
	client, err := kgo.NewClient(consumerOpts(w.brokers, "two-runs", "credits")...)
	require.NoError(t, err)
	first, err := idempotencykafka.New(w.store, client, credit)
	require.NoError(t, err)
	second, err := idempotencykafka.New(w.store, client, credit)
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- first.Run(ctx) }()
	waitFor(t, "the first Run applied every record", func() bool { rows, _ := w.credits(t); return rows == n })
	err = second.Run(context.Background())
	require.ErrorContains(t, err, "another Run polls this client", "the second Run is refused at once")
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)

	w.produce(t, "credits", amountsFrom(n, n)...)
	restarted := runCustomConsumer(t, client, second)
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "two-runs", "credits") == 2*n })
	restarted()
	rows, distinct := w.credits(t)
	require.Equal(t, 2*n, rows)
	require.Equal(t, 2*n, distinct)
}

// runCustomConsumer runs c on client until the returned function stops
// it and closes the client.
func runCustomConsumer(t *testing.T, client *kgo.Client, c *idempotencykafka.Consumer) (stop func()) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			cancel()
			if err := <-done; err != nil && !errors.Is(err, context.Canceled) {
				t.Errorf("Run: %v", err)
			}
			client.Close()
		})
	}
	t.Cleanup(stop)
	return stop
}

// A client that does not block rebalances during a poll lets the group
// revoke a partition while its records are being applied; the member's
// commit of their offsets, accepted in its next generation, then lands
// over the new owner's and sets them back for as long as the group is
// quiet (an outside review: committed 20 of 30, for good). New refuses such
// a client, saying what to set.
func TestNewRefusesAClientThatLetsPartitionsGoMidPoll(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	client, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.ConsumerGroup("no-block"), kgo.ConsumeTopics("credits"),
		kgo.DisableAutoCommit(), kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.KeepControlRecords())
	require.NoError(t, err)
	defer client.Close()
	_, err = idempotencykafka.New(w.store, client, credit)
	require.ErrorContains(t, err, "set kgo.BlockRebalanceOnPoll()")
}

// Member A's record of partition 0 waits to be tried again (a handler
// error WithRetryable names: a downstream service is down) while B joins
// the group. With kgo.BlockRebalanceOnPoll the rebalance waits for A's
// poll, here for as long as the record waits: A's rebalance timeout is 10
// minutes, and B gets nothing in the meantime.
//
// With kgo.OnPartitionsCallbackBlocked(idempotencykafka.OnPartitionsCallbackBlocked)
// A's poll is told that a rebalance waits: the record stops waiting and is
// left undone, the poll's done records are committed, the rebalance goes
// ahead and B gets partitions. Once the downstream service is back, the
// record is applied, once.
func TestARebalanceWaitingForAPollEndsItsWaits(t *testing.T) {
	t.Parallel()
	const group = "hurried"
	w := newWorld(t, 2, "credits")
	var down atomic.Bool
	down.Store(true)
	downstream := errors.New("the ledger service is down")
	handle := func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
		if header(r, idempotencykafka.DefaultIDHeader) == "m-0" && down.Load() {
			return downstream
		}
		return credit(ctx, tx, r)
	}
	retryable := idempotencykafka.WithRetryable(func(err error) bool { return errors.Is(err, downstream) })
	w.produce(t, "credits", amounts(10)...)
	var tries atomic.Int64
	a := w.startCustom(t, w.store, group, "credits", handle, []kgo.Opt{kgo.RebalanceTimeout(10 * time.Minute)}, retryable,
		idempotencykafka.WithOutcomeHandler(func(r *kgo.Record, _ idempotency.Outcome, _ error) {
			if r.Offset == 0 && r.Partition == 0 {
				tries.Add(1)
			}
		}))
	waitFor(t, "the waiting record tried", func() bool { return tries.Load() >= 3 })

	b := w.startMember(t, group, "credits")
	waitFor(t, "B got a partition while the record still waits", func() bool { return b.assigned.Load() > 0 })
	down.Store(false)
	waitFor(t, "every offset committed", func() bool { return w.committed(t, group, "credits") == 10 })
	a.stop()
	b.stop()
	rows, distinct := w.credits(t)
	require.Equal(t, 10, rows, "one effect per record")
	require.Equal(t, 10, distinct)
}
