package idempotencykafka_test

import (
	"context"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency/idempotencykafka"
)

// Two groups read payments, each with its own ID header: the ledger group
// identifies records by their event-id header, the audit group by
// message-id (the default). A record carries both. The ledger's handler
// fails it (a reference that has not arrived) and gives it up; the audit
// group applies it. The reference arrives and the ledger's operator
// redrives the dead letter, as documented.
//
// Before the fix: the copy Redrive produced carries
// idempotency-redriven-message-id with the ledger's ID ("e"), which every
// consumer of the topic takes before its own ID header: the audit group
// identifies the copy as "e", an ID it never saw, and applies the record a
// second time.
//
// Now: a redrive for one group never applies an effect
// again in another: the audit group replays the copy (its own ID for it is
// still "m"), and its effect stays once.
func TestRedriveForOneGroupNeverAppliesAnotherGroupsEffectAgain(t *testing.T) {
	t.Parallel()
	w := newWorld(t, 1, "payments", "payments.dead-letter")
	ctx := context.Background()
	_, err := w.db.Pool.Exec(ctx, `CREATE TABLE audit (msg_id text NOT NULL)`)
	require.NoError(t, err)
	r := rec("m", "acct-1", "ref:later")
	r.Headers = append(r.Headers, kgo.RecordHeader{Key: "event-id", Value: []byte("e")})
	w.produce(t, "payments", r)

	backoff := idempotencykafka.WithRetryBackoff(time.Millisecond, 5*time.Millisecond)
	ledger := w.startCustom(t, w.store, "ledger", "payments", credit, nil,
		idempotencykafka.WithIDHeader("event-id"), idempotencykafka.WithMaxAttempts(2), backoff)
	audit := func(ctx context.Context, tx pgx.Tx, r *kgo.Record) error {
		_, err := tx.Exec(ctx, `INSERT INTO audit VALUES ($1)`, header(r, idempotencykafka.DefaultIDHeader))
		return err
	}
	w.startCustom(t, w.store, "audit", "payments", audit, nil, backoff)
	waitFor(t, "the ledger gave the record up and the audit applied it", func() bool {
		return w.committed(t, "ledger", "payments") == 1 && w.committed(t, "audit", "payments") == 1 && w.end(t, "payments.dead-letter") == 1
	})

	_, err = w.db.Pool.Exec(ctx, `INSERT INTO refs VALUES ('later')`)
	require.NoError(t, err)
	dl := w.readAll(t, "payments.dead-letter", 1)[0]
	require.NoError(t, ledger.consumer.Redrive(ctx, dl))
	waitFor(t, "both groups read the copy", func() bool {
		return w.committed(t, "ledger", "payments") == 2 && w.committed(t, "audit", "payments") == 2
	})
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM credits`), "the ledger applies the record once, by the redrive")
	require.Equal(t, 1, w.db.Count(t, `SELECT count(*) FROM audit`), "the audit's effect stays once")
}
