package idempotencykafka_test

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// A client that would commit offsets on its own, or consumes no group, is
// refused with what to set.
func TestNewRefusesAClientThatCommitsAheadOfTheDatabase(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	for _, c := range []struct {
		opts []kgo.Opt
		want string
	}{
		{[]kgo.Opt{kgo.SeedBrokers(w.brokers...), kgo.ConsumerGroup("g"), kgo.ConsumeTopics("credits")}, "set kgo.DisableAutoCommit"},
		{[]kgo.Opt{kgo.SeedBrokers(w.brokers...), kgo.ConsumeTopics("credits")}, "set kgo.ConsumerGroup"},
	} {
		client, err := kgo.NewClient(c.opts...)
		require.NoError(t, err)
		_, err = idempotencykafka.New(w.store, client, credit)
		client.Close()
		require.ErrorContains(t, err, c.want)
	}
	client, err := kgo.NewClient(consumerOpts(w.brokers, "g", "credits")...)
	require.NoError(t, err)
	defer client.Close()
	_, err = idempotencykafka.New(w.store, client, credit, idempotencykafka.WithMaxAttempts(0))
	require.ErrorContains(t, err, "WithMaxAttempts")
}

// A record whose handler meets the database's trouble (here a lock
// timeout, for as long as another transaction holds the row) is the
// database's problem, not the record's: it is tried again past its
// attempts, never dead-lettered, and applied once the lock is free.
func TestDatabaseTroubleInTheHandlerIsWaitedNotDeadLettered(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits", "credits.dead-letter")
	ctx := context.Background()
	holder, err := w.db.Pool.Begin(ctx)
	require.NoError(t, err)
	defer func() { _ = holder.Rollback(ctx) }()
	_, err = holder.Exec(ctx, `SELECT 1 FROM refs WHERE id = 'known' FOR UPDATE`)
	require.NoError(t, err)

	w.produce(t, "credits", rec("m-1", "acct-1", "lock"))
	var released atomic.Int64
	var deadLettered atomic.Int64
	m := w.startMember(t, "lock-group", "credits", idempotencykafka.WithMaxAttempts(2), idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond),
		idempotencykafka.WithOutcomeHandler(func(_ *kgo.Record, o idempotency.Outcome, _ error) {
			if o == idempotency.OutcomeReleased {
				released.Add(1)
			}
		}),
		idempotencykafka.WithDeadLetterHandler(func(*kgo.Record, string) { deadLettered.Add(1) }))
	waitFor(t, "the record meets the lock more times than its attempts", func() bool { return released.Load() >= 5 })
	require.Zero(t, w.committed(t, "lock-group", "credits"))
	require.NoError(t, holder.Rollback(ctx))
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "lock-group", "credits") == 1 })
	m.stop()
	require.Zero(t, deadLettered.Load(), "never dead-lettered")
	rows, _ := w.credits(t)
	require.Equal(t, 1, rows)
}

// It failed when New took a client with franz-go's default isolation
// level, which reads the records of aborted transactions: a transactional
// producer's aborted send and its committed re-send were both applied. New
// now refuses such a client, and a consumer that reads committed records
// applies the re-send alone.
func TestAbortedTransactionsAreNeverApplied(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	uncommitted, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.ConsumerGroup("g"), kgo.ConsumeTopics("credits"), kgo.DisableAutoCommit())
	require.NoError(t, err)
	_, err = idempotencykafka.New(w.store, uncommitted, credit)
	uncommitted.Close()
	require.ErrorContains(t, err, "set kgo.FetchIsolationLevel(kgo.ReadCommitted())")

	ctx := context.Background()
	p, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.DefaultProduceTopic("credits"), kgo.TransactionalID("credits-producer"))
	require.NoError(t, err)
	defer p.Close()
	for _, end := range []kgo.TransactionEndTry{kgo.TryAbort, kgo.TryCommit} {
		require.NoError(t, p.BeginTransaction())
		require.NoError(t, p.ProduceSync(ctx, rec("pay-1", "acct-1", "100")).FirstErr())
		require.NoError(t, p.EndTransaction(ctx, end))
	}
	var offsets []int64
	applied := make(chan struct{})
	m := w.startMember(t, "tx-group", "credits", idempotencykafka.WithOutcomeHandler(func(r *kgo.Record, o idempotency.Outcome, _ error) {
		offsets = append(offsets, r.Offset)
		if o == idempotency.OutcomeExecuted {
			close(applied)
		}
	}))
	select {
	case <-applied:
	case <-time.After(30 * time.Second):
		t.Fatal("the committed record was not applied")
	}
	m.stop()
	require.Len(t, offsets, 1, "only the committed record was delivered: offsets %v", offsets)
	rows, distinct := w.credits(t)
	require.Equal(t, 1, rows)
	require.Equal(t, 1, distinct)
}

// It failed when errors were classified by status code alone: a handler's
// own Aborted or ResourceExhausted (a downstream gRPC call's) was taken for
// the database's trouble and retried forever, past WithMaxAttempts(3). The
// database's trouble is what the engine found; the handler's own codes
// count against the record.
func TestHandlersOwnAbortedIsBoundedByMaxAttempts(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.produce(t, "payments", rec("m-1", "acct-1", "downstream-aborted"), rec("m-2", "acct-1", "downstream-exhausted"), rec("m-3", "acct-1", "100"))
	m := w.startMember(t, "own-codes", "payments", idempotencykafka.WithMaxAttempts(3), idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond))
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "own-codes", "payments") == 3 })
	m.stop()
	dl := w.readAll(t, "payments.dead-letter", 2)
	for _, r := range dl {
		require.Contains(t, header(r, idempotencykafka.HeaderCause), "gave up after 3 attempts")
	}
	rows, _ := w.credits(t)
	require.Equal(t, 1, rows)
}

// It failed when the offset committed after a transaction's last record
// stopped at the transaction's commit marker: a transactional partition
// showed a lag of 1 forever. New requires a client that keeps the markers,
// and the consumer commits past them: the committed offset reaches the
// partition's end.
func TestTransactionalPartitionsLagReachesZero(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	hides, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.ConsumerGroup("g"), kgo.ConsumeTopics("credits"), kgo.DisableAutoCommit(),
		kgo.FetchIsolationLevel(kgo.ReadCommitted()), kgo.BlockRebalanceOnPoll())
	require.NoError(t, err)
	_, err = idempotencykafka.New(w.store, hides, credit)
	hides.Close()
	require.ErrorContains(t, err, "set kgo.KeepControlRecords()")

	ctx := context.Background()
	p, err := kgo.NewClient(kgo.SeedBrokers(w.brokers...), kgo.DefaultProduceTopic("credits"), kgo.TransactionalID("lag-producer"))
	require.NoError(t, err)
	defer p.Close()
	for i := range 2 {
		require.NoError(t, p.BeginTransaction())
		require.NoError(t, p.ProduceSync(ctx, amounts(4)[2*i:2*i+2]...).FirstErr())
		require.NoError(t, p.EndTransaction(ctx, kgo.TryCommit))
	}
	end := w.end(t, "credits")
	require.EqualValues(t, 6, end, "4 records and 2 commit markers")
	m := w.startMember(t, "lag-group", "credits")
	waitFor(t, "the committed offset at the end", func() bool { return w.committed(t, "lag-group", "credits") == end })
	m.stop()
	rows, _ := w.credits(t)
	require.Equal(t, 4, rows)
}

// The handler says which of its errors are not the record's fault: a
// record whose handler fails with one (here a reference that has not
// arrived yet) is tried past WithMaxAttempts until it succeeds, and
// applied once (without it, TestGivenUpRecordIsNotAppliedAfterLaterRecords
// gives the same record up after two).
func TestRetryableErrorsWaitPastMaxAttempts(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.produce(t, "payments", rec("r", "acct-1", "ref:later"), rec("s", "acct-1", "100"))
	var released atomic.Int64
	m := w.startMember(t, "retryable-group", "payments", idempotencykafka.WithMaxAttempts(2), idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond),
		idempotencykafka.WithRetryable(func(err error) bool { return strings.Contains(err.Error(), "credits_ref_fkey") }),
		idempotencykafka.WithOutcomeHandler(func(_ *kgo.Record, o idempotency.Outcome, _ error) {
			if o == idempotency.OutcomeReleased {
				released.Add(1)
			}
		}))
	waitFor(t, "five tries", func() bool { return released.Load() >= 5 })
	_, err := w.db.Pool.Exec(context.Background(), `INSERT INTO refs VALUES ('later')`)
	require.NoError(t, err)
	waitFor(t, "both offsets committed", func() bool { return w.committed(t, "retryable-group", "payments") == 2 })
	m.stop()
	rows, _ := w.credits(t)
	require.Equal(t, 2, rows)
	require.Zero(t, w.end(t, "payments.dead-letter"), "nothing dead-lettered")

	_, err = idempotencykafka.New(w.store, m.client, credit, idempotencykafka.WithRetryable(nil))
	require.ErrorContains(t, err, "WithRetryable")
}

// A poll can hold several fetches of one partition (the client buffered
// more than one before the poll): ProcessFetches applies a partition's
// records one at a time, in offset order, whatever the number of entries.
// Applied concurrently, a later record would be applied while an earlier
// one is still being tried, and a commit of the later entry's offsets
// would cover the earlier one's records before they are done.
func TestAPartitionsFetchesOfOnePollAreAppliedInOrder(t *testing.T) {
	t.Parallel()
	const n = 10
	w := newWorld(t, 1, "credits")
	w.produce(t, "credits", amounts(n)...)
	client, err := kgo.NewClient(consumerOpts(w.brokers, "order-group", "credits")...)
	require.NoError(t, err)
	t.Cleanup(func() { client.AllowRebalance(); client.Close() })
	var (
		mu      sync.Mutex
		applied []int64
	)
	c, err := idempotencykafka.New(w.store, client, func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
		if r.Offset == 0 {
			time.Sleep(200 * time.Millisecond) // a slow first record: a concurrent later one would overtake it
		}
		mu.Lock()
		applied = append(applied, r.Offset)
		mu.Unlock()
		return credit(ctx, tx, r)
	})
	require.NoError(t, err)

	ctx := context.Background()
	records := pollRecords(t, client, n).Records()
	entry := func(rs []*kgo.Record) kgo.Fetch {
		return kgo.Fetch{Topics: []kgo.FetchTopic{{Topic: "credits", Partitions: []kgo.FetchPartition{{Partition: 0, Records: rs}}}}}
	}
	fetches := kgo.Fetches{entry(records[:n/2]), entry(records[n/2:])}
	require.NoError(t, c.ProcessFetches(ctx, fetches))
	client.AllowRebalance()

	require.True(t, slices.IsSorted(applied), "applied in offset order: %v", applied)
	rows, distinct := w.credits(t)
	require.Equal(t, n, rows)
	require.Equal(t, n, distinct)
	require.EqualValues(t, n, w.committed(t, "order-group", "credits"), "the poll's last offset committed")
}

// Two Consumers of one client, as an application with a second handler
// might make them, both Run. Each Run's poll takes the next records of the
// partition, and each commits the offset after its own: past records the
// other has not applied yet. Stopped then, the group restarts after
// records nobody applied (15 of 20 applied after a
// restart, when it was allowed). The second Run is refused while the first polls; once the
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

// A client that does not block rebalances during a poll lets the group
// revoke a partition while its records are being applied; the member's
// commit of their offsets, accepted in its next generation, then lands
// over the new owner's and sets them back for as long as the group is
// quiet (committed 20 of 30, for good, when it was
// allowed). New refuses such
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

// Two Consumers of one client: X Runs, Y is a poll loop of the
// application's own (PollRecords, ProcessFetches, AllowRebalance), as an
// application with a second handler might write it. Run refuses a second
// Run on the client for this very reason ("each would commit offsets past
// records the other has not applied yet"); is a ProcessFetches beside a
// Run refused too?
//
// X's poll takes m-0..m-9 and is stuck on m-0 (a slow downstream call);
// Y's poll takes m-10..m-19, applies them and commits offset 20. X is then
// stopped before m-0 is applied. The group's committed offset must not be
// past a record nobody applied: either Y is refused, or nothing is
// committed past m-0.
func TestProcessFetchesBesideARunCommitsNoOffsetPastAnUnappliedRecord(t *testing.T) {
	t.Parallel()
	const group, n = "run-and-loop", 20
	w := newWorld(t, 1, "credits")
	w.produce(t, "credits", amounts(n)...)
	client, err := kgo.NewClient(consumerOpts(w.brokers, group, "credits")...)
	require.NoError(t, err)
	defer client.Close()

	stuck := make(chan struct{})
	var stuckOnce bool
	slow := func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
		if header(r, idempotencykafka.DefaultIDHeader) == "m-0" {
			if !stuckOnce {
				stuckOnce = true
				close(stuck)
			}
			<-ctx.Done()
			return ctx.Err()
		}
		return credit(ctx, tx, r)
	}
	x, err := idempotencykafka.New(w.store, client, slow, idempotencykafka.WithMaxPollRecords(10))
	require.NoError(t, err)
	y, err := idempotencykafka.New(w.store, client, credit)
	require.NoError(t, err)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- x.Run(ctx) }()
	<-stuck

	pctx, pcancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer pcancel()
	fetches := pollRecords(t, client, 1)
	yErr := y.ProcessFetches(pctx, fetches)
	client.AllowRebalance()
	t.Logf("Y's poll: %d records from offset %d; ProcessFetches: %v", len(fetches.Records()), fetches.Records()[0].Offset, yErr)

	cancel()
	require.True(t, errors.Is(<-done, context.Canceled))

	committed := w.committed(t, group, "credits")
	var below int
	require.NoError(t, w.db.Pool.QueryRow(context.Background(),
		`SELECT count(*) FROM credits WHERE msg_id = ANY($1)`, idsBelow(committed)).Scan(&below))
	rows, _ := w.credits(t)
	t.Logf("committed offset %d; %d effects in all, %d of the records below the committed offset", committed, rows, below)
	assert.EqualValues(t, committed, below, "every record below the committed offset was applied (promise 2)")
}

func idsBelow(offset int64) []string {
	var ids []string
	for i := range offset {
		ids = append(ids, fmt.Sprintf("m-%d", i))
	}
	return ids
}
