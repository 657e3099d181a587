package idempotencykafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// WithTTL(1h) on a topic of Kafka's defaults (7 days of retention, 7 days
// of offsets): when the configs can be read, Run refuses it
// (TestTTLShorterThanRetentionIsRefused). Here the broker fails the
// consumer's first DescribeConfigs request only, with a retriable error
// (a request timeout), and answers every later one.
//
// Before the fix: the one failure makes the consumer go on with WithTTL(1h) and
// cache it as the topic's TTL for the rest of the run: every record is
// applied with IDs kept an hour, though the topic and offsets keep them
// 14 days, and nothing reads the configs again.
//
// Now: a failure to read the configs is not taken as the operator's
// word for good: the configs are read again (the record waits, or the
// TTL is checked once they answer), and a WithTTL shorter than needed is
// refused as it is when the first read succeeds.
func TestShortTTLIsRefusedAfterATransientDescribeConfigsFailure(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	failed := failDescribeConfigsOnce(w.cluster)
	w.produce(t, "credits", amounts(3)...)
	client, err := kgo.NewClient(consumerOpts(w.brokers, "ttl-transient", "credits")...)
	require.NoError(t, err)
	defer client.Close()
	c, err := idempotencykafka.New(w.store, client, credit, idempotencykafka.WithTTL(time.Hour),
		idempotencykafka.WithRetryBackoff(time.Millisecond, 10*time.Millisecond))
	require.NoError(t, err)
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	require.ErrorContains(t, c.Run(ctx), "WithTTL(1h0m0s) is shorter than", "refused once the configs answer")
	require.True(t, failed.Load(), "the first DescribeConfigs failed")
	short := w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at < now() + interval '2 hours'`)
	require.Zero(t, short, "no record is applied with IDs kept an hour on a topic that redelivers for 14 days")
}
