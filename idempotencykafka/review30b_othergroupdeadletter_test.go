package idempotencykafka_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// Two groups consume payments by the regex ^payments.*, which matches the
// dead-letter topic too (the case the package supports: a consumer
// subscribed to its own dead-letter topic). By default both groups'
// dead-letter topic is payments.dead-letter. Group A cannot apply R (a
// final error of its own handler) and dead-letters it; group B applies R.
//
// Before the fix: B reads A's dead letter of R back from payments.dead-letter. Its
// scope header is A's, so B does not take it for a dead letter of its own
// and applies it as a record of the topic payments.dead-letter, under a
// scope where R's ID is unknown: B applies R's effect twice.
//
// Now: each group applies each record once; B never applies a dead
// letter (of any group) as a new record.
func TestAnotherGroupsDeadLetterIsNotAppliedAgain(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
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
	regex := []kgo.Opt{kgo.ConsumeRegex()}
	backoff := idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond)
	a := w.startCustom(t, w.store, "group-a", "^payments.*", handler("a", true), regex, backoff)
	waitFor(t, "A dead-letters R", func() bool { return w.end(t, "payments.dead-letter") == 1 })
	b := w.startCustom(t, w.store, "group-b", "^payments.*", handler("b", false), regex, backoff)
	waitFor(t, "B read both topics", func() bool {
		return w.committed(t, "group-b", "payments") == 1 && w.committed(t, "group-b", "payments.dead-letter") == 1
	})
	a.stop()
	b.stop()
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM applied WHERE grp = 'b' AND msg_id = 'r'`), "group B applies R once")
}
