package idempotencykafka_test

import (
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// poisonNeverBlocks produces a poison record and a good one to topic, and
// requires that New refuses the consumer (naming the dead-letter topic),
// or that the poison record does not stop its partition: both offsets are
// committed within 30 seconds (it takes well under one when the dead
// letter can be produced).
func poisonNeverBlocks(t *testing.T, w *world, topic string, opts ...idempotencykafka.Option) {
	t.Helper()
	w.produce(t, topic, rec("poison", "acct-1", "oops"), rec("good", "acct-1", "100"))
	client, err := kgo.NewClient(consumerOpts(w.brokers, "dlt-group", topic)...)
	require.NoError(t, err)
	defer client.Close()
	if _, err := idempotencykafka.New(w.store, client, credit, opts...); err != nil {
		require.ErrorContains(t, err, "WithDeadLetterTopic", "refused for its dead-letter topic")
		return
	}
	m := runCustom(t, w.store, client, credit, append(opts, idempotencykafka.WithRetryBackoff(time.Millisecond, 10*time.Millisecond))...)
	waitFor(t, "the poison record does not block its partition", func() bool { return w.committed(t, "dlt-group", topic) == 2 })
	m.stop()
	rows, _ := w.credits(t)
	require.Equal(t, 1, rows, "the good record behind it is applied")
}

// It failed when a topic with a name of 245 characters (Kafka allows 249)
// had the default dead-letter topic of its name followed by
// ".dead-letter", 257 characters, a name no broker accepts and no operator
// can create: the dead letter was refused forever and the record behind
// it never applied. The default cuts such a name short and adds a hash of
// it; once that topic exists, the poison record is dead-lettered there and
// the partition goes on.
func TestDeadLetterTopicNameTooLongNeverBlocksThePartition(t *testing.T) {
	t.Parallel()
	topic := strings.Repeat("t", 245)
	dlt := idempotencykafka.DefaultDeadLetterTopic(topic)
	require.Len(t, dlt, 249)
	require.NotEqual(t, dlt, idempotencykafka.DefaultDeadLetterTopic(strings.Repeat("t", 244)+"u"), "two long topics never share one")
	w := newWorld(t, 1, topic, dlt)
	poisonNeverBlocks(t, w, topic)
	require.Len(t, w.readAll(t, dlt, 1), 1)
}

// WithDeadLetterTopic's function returns "" (for some topics, say).
//
// Before the fix: New accepts it; the dead letter fails in the client
// ("cannot produce record with no topic and no default topic"), an error
// no retry fixes, which is retried forever: the partition never moves.
//
// Now: New refuses an empty dead-letter topic for the
// topics it knows, and a produce the client itself refuses for good is
// given up like one the broker refuses for good.
func TestEmptyDeadLetterTopicNeverBlocksThePartition(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments")
	poisonNeverBlocks(t, w, "payments", idempotencykafka.WithDeadLetterTopic(func(string) string { return "" }))
}

// A dead-letter topic that can never exist, for a topic New did not know
// (matched by a regex): the poison record is given up without a dead
// letter, reported, and the partition goes on.
func TestInvalidDeadLetterTopicOfATopicMetLaterIsGivenUp(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "late-payments")
	w.produce(t, "late-payments", rec("poison", "acct-1", "oops"), rec("good", "acct-1", "100"))
	var reported atomic.Int64
	m := w.startCustom(t, w.store, "late-group", "^late", credit, []kgo.Opt{kgo.ConsumeRegex()},
		idempotencykafka.WithDeadLetterTopic(func(topic string) string { return topic + "/dead" }),
		idempotencykafka.WithErrorHandler(func(err error) {
			if strings.Contains(err.Error(), "is not a valid topic name") {
				reported.Add(1)
			}
		}))
	waitFor(t, "both offsets committed", func() bool { return w.committed(t, "late-group", "late-payments") == 2 })
	m.stop()
	require.EqualValues(t, 1, reported.Load())
	rows, _ := w.credits(t)
	require.Equal(t, 1, rows)
}
