package idempotencykafka_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
)

// The brokers keep a group's offsets one day (offsets.retention.minutes
// 1440, as clusters that recycle many short-lived groups set it); the
// topic has Kafka's defaults: retention.ms and segment.ms of 7 days.
//
// Kafka deletes records by whole segments, once a segment's newest record
// is older than retention.ms, and a segment takes records for up to
// segment.ms: a record of a segment started when it was produced is
// readable for up to retention.ms plus segment.ms, here 14 days. A group
// that re-reads the topic (its offsets expired after a day without a
// member, reset, a group recreated) reads it for all that time.
//
// Before the fix: the TTL is retention.ms plus offsets.retention.minutes, 8 days, and
// segment.ms is never read: a record re-read between its 8th and its 14th
// day finds its ID forgotten and is applied again.
//
// Now: the IDs of a topic's records outlast what Kafka may still
// deliver of it, at least retention.ms plus segment.ms (14 days here).
func TestTTLOutlastsTheTopicsSegmentsToo(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	day := "1440"
	resps, err := w.admin.AlterBrokerConfigs(context.Background(), []kadm.AlterConfig{{Name: "offsets.retention.minutes", Value: &day}})
	require.NoError(t, err)
	for _, r := range resps {
		require.NoError(t, r.Err)
	}
	rcs, err := w.admin.DescribeTopicConfigs(context.Background(), "credits")
	require.NoError(t, err)
	segment := ""
	for _, rc := range rcs {
		for _, c := range rc.Configs {
			if c.Key == "segment.ms" && c.Value != nil {
				segment = *c.Value
			}
		}
	}
	require.Equal(t, "604800000", segment, "the broker reports segment.ms of 7 days")

	w.produce(t, "credits", amounts(3)...)
	m := w.startMember(t, "segment-ttl", "credits")
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "segment-ttl", "credits") == 3 })
	m.stop()
	w.logTTL(t)
	require.Equal(t, 3, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + interval '13 days 23 hours'`),
		"the IDs outlast the topic's retention.ms and segment.ms (7 days each)")
}
