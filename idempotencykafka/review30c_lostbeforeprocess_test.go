package idempotencykafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

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
