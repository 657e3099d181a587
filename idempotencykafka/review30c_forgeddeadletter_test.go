package idempotencykafka_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// forgedDeadLetter is a producer's record that carries the headers of a
// dead letter (forwarded from elsewhere, or forged) naming the position
// topic/partition/offset.
func forgedDeadLetter(value, topic, partition, offset string) *kgo.Record {
	return &kgo.Record{Key: []byte("acct-1"), Value: []byte(value), Headers: []kgo.RecordHeader{
		{Key: idempotencykafka.HeaderCause, Value: []byte("forwarded")},
		{Key: idempotencykafka.HeaderTopic, Value: []byte(topic)},
		{Key: idempotencykafka.HeaderPartition, Value: []byte(partition)},
		{Key: idempotencykafka.HeaderOffset, Value: []byte(offset)},
	}}
}

// A group identifies records by position (they carry no ID header of its
// own). A producer's record X at payments/0/0 carries the headers of a dead
// letter naming payments/0/1: a position no dead letter can name, since a
// record's dead letter is produced after it, to another topic. Y, a record
// of its own, is then produced at payments/0/1. (The redriven-from header
// was fixed for this case, TestForgedRedrivenFromNeverTakesAnotherRecordsID;
// the dead-letter headers take the same path to another record's ID.)
//
// Before the fix: X is taken for the record at payments/0/1 and applied under that
// ID; Y, under its own position, finds that ID taken by another body and
// is dead-lettered as key_reused: a record no one dead-lettered is never
// applied (and Redrive refuses its dead letter, key_reused).
//
// Now: dead-letter headers that cannot be a dead letter's (naming the
// record's own topic at a position not before it) are not an ID: X and Y
// are applied once each, nothing dead-lettered.
func TestForgedDeadLetterHeadersNeverTakeALaterRecordsID(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.produce(t, "payments", forgedDeadLetter("5", "payments", "0", "1"))
	w.produce(t, "payments", &kgo.Record{Key: []byte("acct-1"), Value: []byte("7")})
	m := w.startMember(t, "forged-dl", "payments", idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond))
	waitFor(t, "both offsets committed", func() bool { return w.committed(t, "forged-dl", "payments") == 2 })
	m.stop()
	require.Zero(t, w.end(t, "payments.dead-letter"), "nothing dead-lettered")
	require.Equal(t, 12, w.db.Count(t, `SELECT coalesce(sum(cents), 0) FROM credits`), "X's 5 cents and Y's 7")
}
