package idempotencykafka_test

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// A consumer subscribed to its own dead-letter topic (a regex such as
// ^payments, which TestDeadLettersAreNotDeadLetteredAgain supports) gives
// up on R (its reference is missing), stores the giving up and
// dead-letters it; S behind it is applied. The reference then arrives.
//
// Before the fix: the dead letter, read back from payments.dead-letter,
// is applied like any record, under the scope of the dead-letter topic
// where R's ID is unknown: R's effect commits after S's, which the stored
// giving up was there to prevent; and an operator's Redrive of the dead
// letter (the documented way to apply it once) applies R a second time.
//
// Now: a dead letter read back is never applied (it is left
// where it is, as it is when it fails); R is applied once, by the Redrive.
func TestDeadLetterReadBackIsNeverApplied(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.produce(t, "payments", rec("r", "acct-1", "ref:later"), rec("s", "acct-1", "100"))
	var fixed atomic.Bool
	m := w.startCustom(t, w.store, "regex-apply", "^payments.*", credit, []kgo.Opt{kgo.ConsumeRegex()},
		idempotencykafka.WithMaxAttempts(2), idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond),
		idempotencykafka.WithDeadLetterHandler(func(r *kgo.Record, _ string) {
			// The cause is fixed once R is dead-lettered (before the dead
			// letter can be polled).
			if r.Topic == "payments" && fixed.CompareAndSwap(false, true) {
				_, err := w.db.Pool.Exec(context.Background(), `INSERT INTO refs VALUES ('later')`)
				require.NoError(t, err)
			}
		}))
	waitFor(t, "the records and the dead letter committed", func() bool {
		return w.committed(t, "regex-apply", "payments") == 2 && w.committed(t, "regex-apply", "payments.dead-letter") == 1
	})
	rRows := w.db.Count(t, `SELECT count(*) FROM credits WHERE msg_id = 'r'`)
	assert.Zero(t, rRows, "R, given up, is not applied after S by its dead letter read back")

	dl := w.readAll(t, "payments.dead-letter", 1)[0]
	require.NoError(t, m.consumer.Redrive(context.Background(), dl))
	waitFor(t, "the redriven copy committed", func() bool { return w.committed(t, "regex-apply", "payments") == 3 })
	m.stop()
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM credits WHERE msg_id = 'r'`), "R applied once")
}
