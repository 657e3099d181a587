package idempotencykafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// A compacted topic (cleanup.policy=compact) keeps the last record of
// every key forever: its retention.ms (7 days, the default the broker
// reports) deletes nothing. A group whose offsets expire re-reads records
// of any age.
//
// Before the fix: CheckRetention reads retention.ms alone, derives a
// TTL of 14 days, and Run runs: a record re-read after 14 days finds its
// ID forgotten and is applied again.
//
// Now: a topic whose cleanup.policy does not delete (compact
// without delete) keeps its records forever, as retention.ms -1 does: Run
// refuses it without an explicit WithTTL.
func TestCompactedTopicNeedsAnExplicitTTL(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "ledger")
	ctx := context.Background()
	compact := "compact"
	_, err := w.admin.AlterTopicConfigs(ctx, []kadm.AlterConfig{{Name: "cleanup.policy", Value: &compact}}, "ledger")
	require.NoError(t, err)
	rcs, err := w.admin.DescribeTopicConfigs(ctx, "ledger")
	require.NoError(t, err)
	rc, err := rcs.On("ledger", nil)
	require.NoError(t, err)
	policy := ""
	for _, c := range rc.Configs {
		if c.Key == "cleanup.policy" && c.Value != nil {
			policy = *c.Value
		}
	}
	require.Equal(t, "compact", policy, "the broker reports the topic compacted")

	client, err := kgo.NewClient(consumerOpts(w.brokers, "compact-group", "ledger")...)
	require.NoError(t, err)
	defer client.Close()
	c, err := idempotencykafka.New(w.store, client, credit)
	require.NoError(t, err)
	rctx, cancel := context.WithTimeout(ctx, 2*time.Second)
	defer cancel()
	require.ErrorContains(t, c.Run(rctx), "forever", "Run refuses a compacted topic without an explicit TTL")
}
