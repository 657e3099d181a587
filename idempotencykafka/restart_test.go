package idempotencykafka_test

import (
	"context"
	"errors"
	"math/rand/v2"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

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

// Run is cancelled at random moments (in a poll, in the middle of a
// poll's records, in a mid-poll commit, in the poll's commit) and started
// again on the same client, 150 times, while 8 partitions' records
// arrive. Every record's effect commits once and every partition is
// committed to its end: no stop leaves the client past a record nobody
// applied.
func TestRunCancelledAtRandomAndRestartedOnTheSameClient(t *testing.T) {
	t.Parallel()
	const group, topic, n = "restarts", "credits", 2400
	w := newWorld(t, 8, topic)
	client, err := kgo.NewClient(consumerOpts(w.brokers, group, topic, kgo.OnPartitionsLost(idempotencykafka.OnPartitionsLost))...)
	require.NoError(t, err)
	defer client.Close()
	handle := func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
		if rand.IntN(10) == 0 {
			time.Sleep(time.Duration(rand.IntN(3)) * time.Millisecond)
		}
		return credit(ctx, tx, r)
	}
	c, err := idempotencykafka.New(w.store, client, handle, idempotencykafka.WithMaxPollRecords(30), idempotencykafka.WithCommitEvery(5),
		idempotencykafka.WithRetryBackoff(time.Millisecond, 20*time.Millisecond))
	require.NoError(t, err)

	produced := make(chan struct{})
	go func() {
		defer close(produced)
		for i := 0; i < n; i += 200 {
			w.produce(t, topic, amountsFrom(i, 200)...)
			time.Sleep(150 * time.Millisecond)
		}
	}()
	began := time.Now()
	restarts := 0
	for ; restarts < 150; restarts++ {
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(rand.IntN(150000))*time.Microsecond)
		err := c.Run(ctx)
		cancel()
		require.True(t, errors.Is(err, context.DeadlineExceeded), "Run: %v", err)
	}
	<-produced
	before, _ := w.credits(t)
	t.Logf("applied before the last Run: %d", before)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- c.Run(ctx) }()
	t.Logf("restarts took %v", time.Since(began))
	last := time.Now()
	waitForCount(t, "every partition committed to its end", n, w.committedOf(t, group, topic))
	t.Logf("the last Run committed everything in %v", time.Since(last))
	time.Sleep(time.Second)
	cancel()
	<-done
	rows, distinct := w.credits(t)
	t.Logf("%d restarts; %d effects, %d distinct", restarts, rows, distinct)
	require.Equal(t, w.ends(t, topic), w.committedByPartition(t, group, topic))
	require.Equal(t, n, rows)
	require.Equal(t, n, distinct)
}
