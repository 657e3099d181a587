package idempotencykafka_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// passDays makes the world days older: the IDs' expiry (the store forgets
// an ID whose expires_at has passed) and their creation move back.
func (w *world) passDays(t *testing.T, days int) {
	t.Helper()
	_, err := w.db.Pool.Exec(context.Background(), `UPDATE idempotency_keys SET expires_at = expires_at - make_interval(days => $1), created_at = created_at - make_interval(days => $1)`, days)
	require.NoError(t, err)
}

// Group A reads payments and cannot apply R (a final error of its
// handler): it dead-letters R to payments.dead-letter, whose retention.ms
// is 30 days (an operator keeps dead letters longer than records, to have
// time to redrive them). Group B reads ^payments.* by a regex, the case
// the package supports: it applies R from payments, then reads A's dead
// letter of R, identified as R (the promise of the last round: a dead
// letter is its record, for every group), and replays it. B then stops.
//
// Fifteen days later (simulated: the IDs' expiry moved back 15 days, R
// deleted from payments by its 7 days of retention, B's offsets expired
// after the brokers' 7 days) B starts again and reads its topics from the
// start: payments.dead-letter still has the dead letter, for 15 more days.
//
// Before the fix: the dead letter's ID is given the TTL of its original's topic,
// payments (7 days of retention and 7 of offsets: 14 days), and B's ID of
// R was stored with that TTL when B applied R; nothing accounts for the
// dead-letter topic, where a record standing for R is kept 30 days (and 37
// before a group whose offsets expired stops reading it). B finds R's ID
// forgotten and applies R's effect a second time.
//
// Now: every group applies R at most once, whatever record stands for
// it: an ID outlasts every record it identifies, the dead letters read by
// regex included (or a record standing for an ID that may have been
// forgotten is not applied).
func TestDeadLetterKeptLongerThanItsOriginalIsNeverAppliedAgain(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	w.thirtyDays(t, "payments.dead-letter")
	ctx := context.Background()
	_, err := w.db.Pool.Exec(ctx, `CREATE TABLE applied (grp text NOT NULL, msg_id text NOT NULL)`)
	require.NoError(t, err)
	handler := func(group string, refuse bool) idempotencykafka.Handler {
		return func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
			if refuse {
				return idempotency.Final(errors.New("group " + group + " refuses it"))
			}
			_, err := tx.Exec(ctx, `INSERT INTO applied VALUES ($1, $2)`, group, header(r, idempotencykafka.DefaultIDHeader))
			return err
		}
	}
	w.produce(t, "payments", rec("r", "acct-1", "100"))
	backoff := idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond)
	a := w.startCustom(t, w.store, "group-a", "payments", handler("a", true), nil, backoff)
	waitFor(t, "A dead-letters R", func() bool { return w.end(t, "payments.dead-letter") == 1 })
	a.stop()
	regex := []kgo.Opt{kgo.ConsumeRegex()}
	b := w.startCustom(t, w.store, "group-b", "^payments.*", handler("b", false), regex, backoff)
	waitFor(t, "B read R and its dead letter", func() bool {
		return w.committed(t, "group-b", "payments") == 1 && w.committed(t, "group-b", "payments.dead-letter") == 1
	})
	b.stop()
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM applied WHERE grp = 'b'`), "B applied R once so far")
	w.logTTL(t)

	// Fifteen days later.
	w.passDays(t, 15)
	_, err = w.admin.DeleteRecords(ctx, kadm.Offsets{"payments": {0: kadm.Offset{Topic: "payments", Partition: 0, At: 1}}})
	require.NoError(t, err, "R deleted from payments by its retention")
	_, err = w.admin.DeleteGroups(ctx, "group-b")
	require.NoError(t, err, "B's offsets expired")

	again := w.startCustom(t, w.store, "group-b", "^payments.*", handler("b", false), regex, backoff)
	waitFor(t, "B read the dead-letter topic again", func() bool { return w.committed(t, "group-b", "payments.dead-letter") == 1 })
	again.stop()
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM applied WHERE grp = 'b'`), "group B applies R once, whatever record stands for it")
}
