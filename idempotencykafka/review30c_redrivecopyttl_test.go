package idempotencykafka_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// Two groups read payments (Kafka's defaults: 7 days of retention, 7 of
// offsets; no regex, no dead-letter topic read). Day 0: R is produced and
// group B applies it; B then stops (a service down for two weeks). Group
// A, 5 days behind, cannot apply R (a final error of its handler) and
// dead-letters it on day 5; its operator fixes the cause and redrives the
// dead letter on day 11 (within the dead-letter topic's 7 days): the copy
// is in payments until day 18. A applies the copy.
//
// Day 15 (simulated: B's ID of R moved back 15 days, A's 4; R deleted
// from payments by its retention; B's offsets expired after 7 days without
// a member): B starts again and reads payments from the start: the copy.
//
// Today: B takes the copy for R (the copy names R's position, and keeps its
// ID header: "every group that reads the copy takes it for the
// original: one that applied the original replays it"), but B's ID of R
// was stored on day 0 with the TTL of R's topic, 14 days, and is
// forgotten: B applies R's effect a second time.
//
// Wanted: a redrive for one group never applies an effect again in
// another: a copy is replayed by every group that applied its original,
// for as long as the copy can be read (or it is not applied by a group
// whose ID of the original may have been forgotten).
func TestRedrivenCopyReadAfterTheOriginalsTTLIsNeverAppliedAgain(t *testing.T) {
	t.Skip("known limit, documented on Consumer.Redrive: another group keeps its ID of the original for its TTL from when it applied it; " +
		"a copy redriven late and read after that is taken for a new record")
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	ctx := context.Background()
	_, err := w.db.Pool.Exec(ctx, `CREATE TABLE applied (grp text NOT NULL, msg_id text NOT NULL)`)
	require.NoError(t, err)
	var fixed atomic.Bool
	handler := func(group string) idempotencykafka.Handler {
		return func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
			if group == "a" && !fixed.Load() {
				return idempotency.Final(errors.New("group a cannot apply it yet"))
			}
			_, err := tx.Exec(ctx, `INSERT INTO applied VALUES ($1, $2)`, group, header(r, idempotencykafka.DefaultIDHeader))
			return err
		}
	}
	w.produce(t, "payments", rec("r", "acct-1", "100"))
	backoff := idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond)

	// Day 0.
	b := w.startCustom(t, w.store, "group-b", "payments", handler("b"), nil, backoff)
	waitFor(t, "B applied R", func() bool { return w.committed(t, "group-b", "payments") == 1 })
	b.stop()
	// Days 5 to 11.
	a := w.startCustom(t, w.store, "group-a", "payments", handler("a"), nil, backoff)
	waitFor(t, "A dead-letters R", func() bool { return w.end(t, "payments.dead-letter") == 1 })
	fixed.Store(true)
	require.NoError(t, a.consumer.Redrive(ctx, w.readAll(t, "payments.dead-letter", 1)[0]))
	waitFor(t, "A applied the copy", func() bool { return w.committed(t, "group-a", "payments") == 2 })
	a.stop()
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM applied WHERE grp = 'b'`))
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM applied WHERE grp = 'a'`))
	w.logTTL(t)

	// Day 15.
	for scope, days := range map[string]int{"kafka/group-b/payments": 15, "kafka/group-a/payments": 4} {
		_, err := w.db.Pool.Exec(ctx, `UPDATE idempotency_keys SET expires_at = expires_at - make_interval(days => $2), created_at = created_at - make_interval(days => $2) WHERE scope = $1`, scope, days)
		require.NoError(t, err)
	}
	_, err = w.admin.DeleteRecords(ctx, kadm.Offsets{"payments": {0: kadm.Offset{Topic: "payments", Partition: 0, At: 1}}})
	require.NoError(t, err, "R deleted from payments by its retention")
	_, err = w.admin.DeleteGroups(ctx, "group-b")
	require.NoError(t, err, "B's offsets expired")
	again := w.startCustom(t, w.store, "group-b", "payments", handler("b"), nil, backoff)
	waitFor(t, "B read the copy", func() bool { return w.committed(t, "group-b", "payments") == 2 })
	again.stop()
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM applied WHERE grp = 'b'`), "group B applies R once, the copy included")
}
