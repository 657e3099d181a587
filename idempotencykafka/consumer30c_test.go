package idempotencykafka_test

import (
	"context"
	"slices"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kerr"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// A commit in the middle of a poll is refused because the member's
// generation is over (the group dropped it while its handler was slow):
// the records of the poll after it are left to the partition's next
// owner. Here that owner is the same client, which kept the partition and
// had fetched past those records. Without rewinding it to the first record
// left undone, its next poll starts after the poll's end, and committing
// those offsets skips records nobody applied (under load, the rebalance
// test lost offsets 200-249 of every partition so). Each of 60 records'
// effects commits once, and every offset is committed.
func TestRecordsLeftUndoneByAMovedCommitAreDeliveredAgain(t *testing.T) {
	t.Parallel()
	const n = 60
	w := newWorld(t, 1, "credits")
	var asked atomic.Int64
	refuseCommits(w.cluster, "moved-group", kerr.UnknownMemberID.Code, once(&asked))
	w.produce(t, "credits", amounts(n)...)
	m := w.startMember(t, "moved-group", "credits", idempotencykafka.WithMaxPollRecords(20), idempotencykafka.WithCommitEvery(10))
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "moved-group", "credits") == n })
	m.stop()
	require.Positive(t, asked.Load(), "a commit was refused")
	rows, distinct := w.credits(t)
	require.Equal(t, n, rows, "one effect per record: the records after the refused commit were applied")
	require.Equal(t, n, distinct)
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
