package idempotencykafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// m-0's ID is held by another holder (the member that had the partition,
// still applying it). A's store waits for a held ID for up to 10 minutes
// (idempotency.WithInProgressWait, a store shared with a gRPC server whose
// handlers are long). A's rebalance timeout is 10 minutes. B joins.
//
// OnPartitionsCallbackBlocked's doc: a record that waits ("its ID held by
// another member") stops waiting once a rebalance waits for the poll, and
// the poll lets the rebalance go ahead. The wait for the held ID happens
// inside ProcessMessage, on the poll's context, which the signal does not
// end: B gets nothing for as long as the ID is held.
func TestReview30eHeldIDWaitInsideTheStoreHoldsTheRebalance(t *testing.T) {
	t.Parallel()
	const group = "held-long"
	w := newWorld(t, 2, "credits")
	store, err := idempotency.NewStore(w.db.Pool, idempotency.WithInProgressWait(10*time.Minute))
	require.NoError(t, err)
	r := rec("m-0", "acct-0", "1")
	w.produce(t, "credits", r, rec("m-1", "acct-1", "2"))

	probeClient, err := kgo.NewClient(consumerOpts(w.brokers, group, "credits")...)
	require.NoError(t, err)
	probe, err := idempotencykafka.New(store, probeClient, credit)
	require.NoError(t, err)
	msg, err := probe.Message(context.Background(), r)
	require.NoError(t, err)
	probeClient.Close()
	holding, release := make(chan struct{}), make(chan struct{})
	held := make(chan error, 1)
	go func() {
		_, err := store.ProcessMessage(context.Background(), msg, func(ctx context.Context, tx pgx.Tx) error {
			close(holding)
			<-release
			return credit(ctx, tx, r)
		})
		held <- err
	}()
	<-holding
	released := false
	defer func() {
		if !released {
			close(release)
		}
	}()

	a := w.startCustom(t, store, group, "credits", credit, []kgo.Opt{kgo.RebalanceTimeout(10 * time.Minute)})
	waitFor(t, "A applied m-1", func() bool { rows, _ := w.credits(t); return rows == 1 })
	b := w.startMember(t, group, "credits")
	deadline := time.Now().Add(45 * time.Second)
	for b.assigned.Load() == 0 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	assert.Positive(t, b.assigned.Load(), "B got a partition while m-0's ID was held (45 s)")

	close(release)
	released = true
	require.NoError(t, <-held)
	waitFor(t, "every offset committed", func() bool { return w.committed(t, group, "credits") == 2 })
	a.stop()
	b.stop()
	rows, distinct := w.credits(t)
	require.Equal(t, 2, rows)
	require.Equal(t, 2, distinct)
}
