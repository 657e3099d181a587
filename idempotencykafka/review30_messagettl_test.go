package idempotencykafka_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// Consumer.Message is documented for code that applies a record outside
// the consumer (a tool, a second path), "so that the two never both apply
// it". Such code builds a Consumer with New, for the Message, and does not
// Run it.
//
// Before the fix: Message's TTL is 0 until Run's CheckRetention set it,
// so the ID is kept the engine's default 24 hours: the consumer that reads
// the record later (its group lagging, or re-reading after its offsets
// expired, within the topic's 7 days) finds the ID forgotten and applies
// the record a second time.
//
// Now: the Message of a record outlasts the topic's
// retention and the offsets' (14 days here) however the Consumer was used,
// or Message refuses until the retention is known.
func TestMessageAppliedOutsideTheConsumerOutlastsRetention(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "credits")
	client, err := kgo.NewClient(consumerOpts(w.brokers, "outside-group", "credits")...)
	require.NoError(t, err)
	defer client.Close()
	c, err := idempotencykafka.New(w.store, client, credit)
	require.NoError(t, err)
	r := rec("m-1", "acct-1", "100")
	r.Topic = "credits"
	m, err := c.Message(context.Background(), r)
	require.NoError(t, err)
	_, err = w.store.ProcessMessage(context.Background(), m, func(ctx context.Context, tx pgx.Tx) error { return credit(ctx, tx, r) })
	require.NoError(t, err)
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE expires_at > now() + interval '13 days'`),
		"the ID outlasts the topic's retention and the offsets' (TTL of the Message: %v)", m.TTL)
}
