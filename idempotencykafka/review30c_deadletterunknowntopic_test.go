package idempotencykafka_test

import (
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// A record of payments carries the headers of a dead letter naming a topic
// that does not exist: a producer's forwarded or forged headers, or, for a
// group that reads a dead-letter topic, the dead letter of a topic deleted
// since. Behind it in the partition is a good record.
//
// Before the fix: the record is identified as a record of the named topic, whose
// retention is read for its ID's TTL; DescribeConfigs answers
// UNKNOWN_TOPIC_OR_PARTITION, taken for a failure that may pass, and the
// record waits for it, tried again forever: neither it nor the good record
// behind it is ever applied or committed (one record's headers stop the
// partition).
//
// Now: a record whose named original topic does not exist never blocks
// its partition: it is applied (as itself), dead-lettered, or skipped
// with an error, and the good record behind it is applied: both offsets
// are committed.
func TestDeadLetterHeadersNamingATopicThatDoesNotExistNeverBlockThePartition(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.produce(t, "payments", forgedDeadLetter("5", "no-such-topic", "0", "0"), rec("good", "acct-1", "7"))
	var waits atomic.Value
	m := w.startMember(t, "unknown-origin", "payments", idempotencykafka.WithRetryBackoff(time.Millisecond, 50*time.Millisecond),
		idempotencykafka.WithErrorHandler(func(err error) {
			if strings.Contains(err.Error(), "waits") {
				waits.CompareAndSwap(nil, err.Error())
			}
		}))
	defer func() { t.Logf("the consumer said: %v", waits.Load()) }()
	waitFor(t, "the record naming a missing topic does not block its partition", func() bool { return w.committed(t, "unknown-origin", "payments") == 2 })
	m.stop()
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM credits WHERE msg_id = 'good'`), "the good record behind it is applied")
}
