package idempotencykafka_test

import (
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// A group identifies records by position (they carry no ID header of its
// own). A producer's record X at payments/0/0 carries an
// idempotency-redriven-from header naming payments/0/1: a position that
// no redriven copy can name, since a copy always comes after its original
// in the original's topic. Y, a record of its own, is then produced at
// payments/0/1.
//
// Before the fix: X is taken for the record at payments/0/1 and applied under that
// ID; Y, under its own position, finds that ID taken by another body and
// is dead-lettered as key_reused: a record no one redrove is never
// applied.
//
// Now: a redriven-from header that cannot be a Redrive's (another
// topic, or a position not before the record's own) is not an ID: X and Y
// are applied once each.
func TestForgedRedrivenFromNeverTakesAnotherRecordsID(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	x := &kgo.Record{Key: []byte("acct-1"), Value: []byte("5"), Headers: []kgo.RecordHeader{{Key: idempotencykafka.HeaderRedrivenFrom, Value: []byte("payments/0/1")}}}
	y := &kgo.Record{Key: []byte("acct-1"), Value: []byte("7")}
	w.produce(t, "payments", x)
	w.produce(t, "payments", y)
	m := w.startMember(t, "forged", "payments", idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond))
	waitFor(t, "both offsets committed", func() bool { return w.committed(t, "forged", "payments") == 2 })
	m.stop()
	require.Zero(t, w.end(t, "payments.dead-letter"), "nothing dead-lettered")
	require.Equal(t, 12, w.db.Count(t, `SELECT coalesce(sum(cents), 0) FROM credits`), "X's 5 cents and Y's 7")
}
