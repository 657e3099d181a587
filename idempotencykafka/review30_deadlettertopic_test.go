package idempotencykafka_test

import (
	"strings"
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
	deadline := time.Now().Add(30 * time.Second)
	for w.committed(t, "dlt-group", topic) != 2 && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	m.stop()
	require.EqualValues(t, 2, w.committed(t, "dlt-group", topic), "the poison record does not block its partition")
	rows, _ := w.credits(t)
	require.Equal(t, 1, rows, "the good record behind it is applied")
}

// A topic with a name of 245 characters (Kafka allows 249): its default
// dead-letter topic, the name followed by ".dead-letter", has 257, a name
// no broker accepts and no operator can create.
//
// What happens now: New accepts the consumer; the poison record's dead
// letter is produced, refused (kfake answers UNKNOWN_TOPIC_OR_PARTITION,
// which the consumer waits on, as for a topic not created yet), forever:
// the record behind it is never applied.
//
// What should happen: a dead-letter topic whose name can never be valid
// is refused by New (as a scope the store cannot keep is), or the dead
// letter is given up at once, reported, and the partition goes on.
func TestDeadLetterTopicNameTooLongNeverBlocksThePartition(t *testing.T) {
	t.Parallel()
	topic := strings.Repeat("t", 245)
	w := newWorld(t, 1, topic)
	poisonNeverBlocks(t, w, topic)
}

// WithDeadLetterTopic's function returns "" (for some topics, say).
//
// What happens now: New accepts it; the dead letter fails in the client
// ("cannot produce record with no topic and no default topic"), an error
// no retry fixes, which is retried forever: the partition never moves.
//
// What should happen: New refuses an empty dead-letter topic for the
// topics it knows, and a produce the client itself refuses for good is
// given up like one the broker refuses for good.
func TestEmptyDeadLetterTopicNeverBlocksThePartition(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments")
	poisonNeverBlocks(t, w, "payments", idempotencykafka.WithDeadLetterTopic(func(string) string { return "" }))
}
