package idempotencykafka_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// A producer's record carries two idempotency-redriven-from headers, a
// valid position first and a value that is not one last (forwarded or
// forged headers). Group A identifies records by the message-id header,
// group B by position (its ID header is one the records lack).
//
// messageID reads the last redriven-from header only and ignores it when
// invalid: B identifies the original by its own position, payments/0/0.
// Redrive keeps the last *valid* one: the copy names payments/0/77.
//
// Before the fix: A gives R up, the cause is fixed, A's Redrive succeeds (A's ID
// matches), and B takes the copy for payments/0/77, an ID it never saw:
// B, which applied R already, applies it a second time.
//
// Now: every group takes the copy for the original (B replays it), or
// Redrive refuses a dead letter whose copy some group would identify
// differently.
func TestRedriveOfARecordWithDuplicateRedrivenFromHeadersIsReplayedByEveryGroup(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	ctx := context.Background()
	_, err := w.db.Pool.Exec(ctx, `CREATE TABLE applied (grp text NOT NULL, msg_id text NOT NULL)`)
	require.NoError(t, err)
	var fixed atomic.Bool
	handler := func(group string) idempotencykafka.Handler {
		return func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
			if group == "a" && !fixed.Load() {
				return idempotency.Final(errors.New("group a refuses it for now"))
			}
			_, err := tx.Exec(ctx, `INSERT INTO applied VALUES ($1, $2)`, group, header(r, idempotencykafka.DefaultIDHeader))
			return err
		}
	}
	r := rec("r", "acct-1", "100")
	r.Headers = append(r.Headers,
		kgo.RecordHeader{Key: idempotencykafka.HeaderRedrivenFrom, Value: []byte("payments/0/77")},
		kgo.RecordHeader{Key: idempotencykafka.HeaderRedrivenFrom, Value: []byte("not a position")})
	w.produce(t, "payments", r)
	backoff := idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond)
	a := w.startCustom(t, w.store, "dup-a", "payments", handler("a"), nil, backoff)
	b := w.startCustom(t, w.store, "dup-b", "payments", handler("b"), nil, backoff, idempotencykafka.WithIDHeader("other-id"))
	waitFor(t, "A dead-letters R, B applies it", func() bool {
		return w.end(t, "payments.dead-letter") == 1 && w.committed(t, "dup-a", "payments") == 1 && w.committed(t, "dup-b", "payments") == 1
	})
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM applied WHERE grp = 'b'`))

	fixed.Store(true)
	dl := w.readAll(t, "payments.dead-letter", 1)[0]
	require.NoError(t, a.consumer.Redrive(ctx, dl))
	waitFor(t, "both groups read the copy", func() bool {
		return w.committed(t, "dup-a", "payments") == 2 && w.committed(t, "dup-b", "payments") == 2
	})
	a.stop()
	b.stop()
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM applied WHERE grp = 'a'`), "A applies R once, by the redrive")
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM applied WHERE grp = 'b'`), "B applied R already: the copy is a replay")
}
