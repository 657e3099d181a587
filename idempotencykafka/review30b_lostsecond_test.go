package idempotencykafka_test

import (
	"context"
	"runtime"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

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
