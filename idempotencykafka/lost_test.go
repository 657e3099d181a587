package idempotencykafka_test

import (
	"context"
	"errors"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// Without the callbacks, a partition the member lost (its heartbeat
// refused: fenced) was worked on for as long as its record waited, here
// forever: ProcessFetches never returned. With kgo.BlockRebalanceOnPoll,
// franz-go reports the loss only once the poll allows it; with
// kgo.OnPartitionsCallbackBlocked(idempotencykafka.OnPartitionsCallbackBlocked)
// the poll is told that a rebalance waits for it: the record stops
// waiting, no offset is committed, ProcessFetches returns saying so, and
// once the poll allows the rebalance the loss is reported.
func TestLostPartitionsWorkStops(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments")
	var fenced atomic.Bool
	fenceHeartbeats(w.cluster, "lost-group", &fenced)
	w.produce(t, "payments", rec("r", "acct-1", "ref:never"))
	var lost atomic.Bool
	client, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.ConsumerGroup("lost-group"), kgo.ConsumeTopics("payments"),
		kgo.DisableAutoCommit(), kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.KeepControlRecords(), kgo.BlockRebalanceOnPoll(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.HeartbeatInterval(100*time.Millisecond),
		kgo.OnPartitionsCallbackBlocked(idempotencykafka.OnPartitionsCallbackBlocked),
		kgo.OnPartitionsLost(func(ctx context.Context, cl *kgo.Client, ps map[string][]int32) {
			idempotencykafka.OnPartitionsLost(ctx, cl, ps)
			lost.Store(true)
		}))
	require.NoError(t, err)
	defer client.Close()
	var tries atomic.Int64
	c, err := idempotencykafka.New(w.store, client, credit, idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond),
		idempotencykafka.WithRetryable(func(error) bool { return true }),
		idempotencykafka.WithOutcomeHandler(func(*kgo.Record, idempotency.Outcome, error) { tries.Add(1) }))
	require.NoError(t, err)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	fetches := pollRecords(t, client, 1)
	done := make(chan error, 1)
	go func() { done <- c.ProcessFetches(ctx, fetches) }()
	waitFor(t, "the record tried", func() bool { return tries.Load() >= 3 })
	fenced.Store(true)
	select {
	case err := <-done:
		require.ErrorContains(t, err, "a rebalance waits for the poll")
	case <-time.After(time.Minute):
		t.Fatal("ProcessFetches still works on the lost partition")
	}
	require.False(t, lost.Load(), "the loss waited for the poll")
	client.AllowRebalance()
	waitFor(t, "the loss reported once the poll allowed it", lost.Load)
	require.Zero(t, w.committed(t, "lost-group", "payments"))
}

// A client with two Consumers: one runs the poll loop, the other was made
// on the same client for Redrive (an operator's tool, a second handler).
// The member is fenced while the first consumer retries a record.
//
// Before the fix: the package registry maps the client to the Consumer made last, so
// the callbacks reach nothing of the consumer doing the work: it goes on
// applying the lost partition's record, forever.
//
// Now: the work of every Consumer of the client stops once a rebalance
// waits for the poll (the loss, with kgo.BlockRebalanceOnPoll, waits for
// it): ProcessFetches returns saying so.
func TestLostPartitionsWorkStopsWithTwoConsumersOnOneClient(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments")
	var fenced atomic.Bool
	fenceHeartbeats(w.cluster, "lost-two", &fenced)
	w.produce(t, "payments", rec("r", "acct-1", "ref:never"))
	client, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.ConsumerGroup("lost-two"), kgo.ConsumeTopics("payments"),
		kgo.DisableAutoCommit(), kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.KeepControlRecords(), kgo.BlockRebalanceOnPoll(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.HeartbeatInterval(100*time.Millisecond),
		kgo.OnPartitionsCallbackBlocked(idempotencykafka.OnPartitionsCallbackBlocked),
		kgo.OnPartitionsLost(idempotencykafka.OnPartitionsLost))
	require.NoError(t, err)
	defer client.Close()
	defer client.AllowRebalance() // kgo.BlockRebalanceOnPoll: Close waits for it
	var tries atomic.Int64
	c, err := idempotencykafka.New(w.store, client, credit, idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond),
		idempotencykafka.WithRetryable(func(error) bool { return true }),
		idempotencykafka.WithOutcomeHandler(func(*kgo.Record, idempotency.Outcome, error) { tries.Add(1) }))
	require.NoError(t, err)
	// The second Consumer of the same client, kept alive for the test.
	redriver, err := idempotencykafka.New(w.store, client, credit)
	require.NoError(t, err)
	defer runtime.KeepAlive(redriver)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	fetches := pollRecords(t, client, 1)
	done := make(chan error, 1)
	go func() { done <- c.ProcessFetches(ctx, fetches) }()
	waitFor(t, "the record tried", func() bool { return tries.Load() >= 3 })
	fenced.Store(true)
	select {
	case err := <-done:
		require.ErrorContains(t, err, "a rebalance waits for the poll")
	case <-time.After(30 * time.Second):
		t.Fatal("ProcessFetches still works on the lost partition: OnPartitionsLost found the client's other Consumer")
	}
	require.Zero(t, w.committed(t, "lost-two", "payments"))
}

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

// A client polls a record of payments/0; the member loses the partition
// after the poll returned and before ProcessFetches began (with
// kgo.BlockRebalanceOnPoll, which New now requires, franz-go itself waits
// for the poll; a poll loop of one's own that allows the rebalance before
// ProcessFetches, or a callback called by hand, does not). The test calls
// the callback itself at that moment, while the member still is in the
// group, so that a commit would get through (in a real loss, with the
// member's next generation, over the new owner's offsets).
//
// Before the fix: ProcessFetches begins with newPoll, which clears the partitions
// marked lost, so the loss is forgotten: the lost partition's record is
// applied and its offset committed.
//
// Now: no offset of a partition lost after its records were polled is
// committed (OnPartitionsLost: "no offset of a lost partition is
// committed").
func TestPartitionLostBeforeProcessFetchesIsNotCommitted(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments")
	w.produce(t, "payments", rec("r", "acct-1", "1"))
	client, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.ConsumerGroup("lost-before"), kgo.ConsumeTopics("payments"),
		kgo.DisableAutoCommit(), kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.KeepControlRecords(), kgo.BlockRebalanceOnPoll(),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart()), kgo.FetchMaxWait(100*time.Millisecond),
		kgo.OnPartitionsLost(idempotencykafka.OnPartitionsLost))
	require.NoError(t, err)
	defer client.Close()
	defer client.AllowRebalance() // kgo.BlockRebalanceOnPoll: Close waits for it
	c, err := idempotencykafka.New(w.store, client, credit, idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond))
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	fetches := pollRecords(t, client, 1)
	idempotencykafka.OnPartitionsLost(ctx, client, map[string][]int32{"payments": {0}})
	_ = c.ProcessFetches(ctx, fetches)
	require.Zero(t, w.committed(t, "lost-before", "payments"), "the offset of the partition lost after the poll is not committed")
}

// Run waits in its poll (no records yet). The member is fenced: franz-go
// reports credits/0 lost (OnPartitionsLost), while Run is inside
// PollRecords, after its newPoll. The member rejoins and gets credits/0
// back in its next generation. Records arrive; the poll returns m-0..m-9
// of the new generation. m-3 waits (a downstream service down, a
// retryable error). Run is stopped then (a deploy), and started again on
// the same client, as Run's doc allows ("a Run stopped with records
// polled sets the client back to them").
//
// The promise: no record is skipped; m-3..m-9, left undone, are
// delivered again.
//
// The loss reported during the poll is kept as the poll's: the partition
// is taken for lost, so the poll neither commits m-0..m-2 nor sets the
// client back to m-3. The restarted Run is delivered m-10.. and commits
// past m-3..m-9, which nobody applied.
//
// With the classic protocol franz-go follows the loss with an error fetch
// that ends the poll (Run's next newPoll forgets the loss); with KIP-848
// (kgo.ServerSideBalancer), a FENCED_MEMBER_EPOCH heartbeat abandons the
// assignment (OnPartitionsLost) and rejoins, with no such fetch.
func TestLossReportedDuringThePollIsNotTheNewGenerations(t *testing.T) {
	t.Parallel()
	t.Run("classic", func(t *testing.T) {
		t.Parallel()
		lossDuringPoll(t, "lost-between", nil, func(w *world, group string, fenced *atomic.Bool) { fenceHeartbeats(w.cluster, group, fenced) })
	})
	t.Run("kip848", func(t *testing.T) {
		t.Parallel()
		lossDuringPoll(t, "lost-between-848", []kgo.Opt{kgo.ServerSideBalancer(), kgo.Balancers(kgo.RangeBalancer())}, fence848)
	})
}

// fence848 makes the broker answer the group's ConsumerGroupHeartbeats
// with FENCED_MEMBER_EPOCH while fenced is set.
func fence848(w *world, group string, fenced *atomic.Bool) {
	w.cluster.ControlKey(kmsg.ConsumerGroupHeartbeat.Int16(), func(req kmsg.Request) (kmsg.Response, error, bool) {
		w.cluster.KeepControl()
		hb := req.(*kmsg.ConsumerGroupHeartbeatRequest)
		if hb.Group != group || !fenced.Load() {
			return nil, nil, false
		}
		resp := hb.ResponseKind().(*kmsg.ConsumerGroupHeartbeatResponse)
		resp.ErrorCode = kerr.FencedMemberEpoch.Code
		return resp, nil, true
	})
}

func lossDuringPoll(t *testing.T, group string, extra []kgo.Opt, fence func(*world, string, *atomic.Bool)) {
	w := newWorld(t, 1, "credits")
	var fenced atomic.Bool
	fence(w, group, &fenced)
	var lost, assigned atomic.Int64
	client, err := kgo.NewClient(consumerOpts(w.brokers, group, "credits", append(extra,
		kgo.OnPartitionsLost(func(ctx context.Context, cl *kgo.Client, ps map[string][]int32) {
			idempotencykafka.OnPartitionsLost(ctx, cl, ps)
			lost.Add(1)
		}),
		kgo.OnPartitionsAssigned(func(_ context.Context, _ *kgo.Client, ps map[string][]int32) {
			if len(ps["credits"]) > 0 {
				assigned.Add(1)
			}
		}))...)...)
	require.NoError(t, err)
	defer client.Close()

	var down atomic.Bool
	down.Store(true)
	downstream := errors.New("the ledger service is down")
	var m3Tries atomic.Int64
	handle := func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
		if header(r, idempotencykafka.DefaultIDHeader) == "m-3" && down.Load() {
			m3Tries.Add(1)
			return downstream
		}
		return credit(ctx, tx, r)
	}
	c, err := idempotencykafka.New(w.store, client, handle,
		idempotencykafka.WithRetryable(func(err error) bool { return errors.Is(err, downstream) }),
		idempotencykafka.WithRetryBackoff(time.Millisecond, 20*time.Millisecond),
		idempotencykafka.WithErrorHandler(func(err error) { t.Logf("error: %.200v", err) }))
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	waitFor(t, "the member has credits/0", func() bool { return assigned.Load() >= 1 })
	time.Sleep(300 * time.Millisecond) // Run is in its poll, waiting for records
	fenced.Store(true)
	waitFor(t, "the loss reported", func() bool { return lost.Load() >= 1 })
	fenced.Store(false)
	waitFor(t, "credits/0 assigned again", func() bool { return assigned.Load() >= 2 })

	w.produce(t, "credits", amounts(10)...)
	waitFor(t, "m-3 waits", func() bool { return m3Tries.Load() >= 3 })
	cancel()
	require.ErrorIs(t, <-done, context.Canceled)

	down.Store(false)
	restarted, stop := context.WithCancel(context.Background())
	defer stop()
	done = make(chan error, 1)
	go func() { done <- c.Run(restarted) }()
	w.produce(t, "credits", amountsFrom(10, 5)...)
	waitFor(t, "every offset committed", func() bool { return w.committed(t, group, "credits") == 15 })
	time.Sleep(time.Second)
	stop()
	<-done
	rows, distinct := w.credits(t)
	assert.Equal(t, 15, rows, "one effect per record: none skipped")
	assert.Equal(t, 15, distinct)
	_ = idempotency.OutcomeExecuted
}
