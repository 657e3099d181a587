package idempotencykafka_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"
)

// thirtyDays sets topic's retention.ms to 30 days: a group that re-reads it
// (its offsets expired after the brokers' 7 days) reads records 37 days old.
func (w *world) thirtyDays(t *testing.T, topic string) {
	t.Helper()
	ms := "2592000000"
	_, err := w.admin.AlterTopicConfigs(context.Background(), []kadm.AlterConfig{{Name: "retention.ms", Value: &ms}}, topic)
	require.NoError(t, err)
}

// A group consumes ^payments by a regex; the topic keeps its records 30
// days (retention.ms), longer than the brokers' log.retention.ms (7 days).
//
// Before the fix: CheckRetention holds regex topics to the brokers'
// log.retention.ms and derives a TTL of 14 days: a record re-read after
// the group's offsets expired (up to 37 days after it was produced) finds
// its ID forgotten and is applied again.
//
// Now: the TTL outlasts the retention.ms of every topic
// consumed (the topics the regex matched, which the client knows), here at
// least 37 days.
func TestRegexTopicsTTLOutlastsTheirOwnRetention(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments")
	w.thirtyDays(t, "payments")
	w.produce(t, "payments", amounts(3)...)
	m := w.startCustom(t, w.store, "regex-ttl", "^payments$", credit, []kgo.Opt{kgo.ConsumeRegex()})
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "regex-ttl", "payments") == 3 })
	m.stop()
	w.logTTL(t)
	require.Equal(t, 3, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + interval '36 days'`),
		"the IDs outlast the topic's 30 days and the offsets' 7")
}

// A consumer of "credits" (7 days) that the application also gives
// "payments" (30 days) with kgo.Client.AddConsumeTopics before Run.
//
// Before the fix: CheckRetention reads the topics the client was created
// with (OptValue(kgo.ConsumeTopics)), not those it consumes: the TTL is 14
// days, and the payments records re-read after the offsets expired are
// applied again.
//
// Now: every topic the client consumes is held to its own
// retention.ms (kgo.Client.GetConsumeTopics), here at least 37 days.
func TestAddedTopicsTTLOutlastsTheirRetention(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits", "payments")
	w.thirtyDays(t, "payments")
	w.produce(t, "payments", amounts(3)...)
	client, err := kgo.NewClient(consumerOpts(w.brokers, "added-ttl", "credits")...)
	require.NoError(t, err)
	client.AddConsumeTopics("payments")
	m := runCustom(t, w.store, client, credit)
	waitFor(t, "every offset committed", func() bool { return w.committed(t, "added-ttl", "payments") == 3 })
	m.stop()
	w.logTTL(t)
	require.Equal(t, 3, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + interval '36 days'`),
		"the IDs outlast the topic's 30 days and the offsets' 7")
}

// logTTL logs how long the keys are kept.
func (w *world) logTTL(t *testing.T) {
	t.Helper()
	var ttl string
	require.NoError(t, w.db.Pool.QueryRow(context.Background(), `SELECT (max(expires_at - created_at))::text FROM idempotency_keys`).Scan(&ttl))
	t.Logf("the keys are kept %s", ttl)
}
