package natsconsumer_test

import (
	"context"
	"encoding/json"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency/examples/natsconsumer"
)

// What a COMMIT refuses, through the consumer: a credit whose account row
// must exist when it commits (a deferred foreign key) is redelivered until
// the account arrives, then applied; one that a deferred trigger refuses
// every time is tried WithMaxAttempts times, then terminated (GaveUp).
// Neither is stored. Before, the first was terminated on its first
// delivery for good, and the second redelivered forever as a misconfigured
// store.
func TestDeferredRefusalsAtCommitThroughTheConsumer(t *testing.T) {
	t.Parallel()
	pool, store := newDB(t)
	_, js := connect(t)
	stream, durable, subject := newStream(t, js, 0, 5*time.Second)
	ctx := context.Background()
	_, err := pool.Exec(ctx, `
CREATE TABLE accounts (id text PRIMARY KEY);
CREATE TABLE account_links (account_id text REFERENCES accounts DEFERRABLE INITIALLY DEFERRED);
CREATE FUNCTION refuse() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN RAISE EXCEPTION 'account % is frozen', NEW.account_id; END $$;
CREATE TABLE frozen (account_id text);
CREATE CONSTRAINT TRIGGER refuse AFTER INSERT ON frozen DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION refuse()`)
	require.NoError(t, err)

	var failedOnce atomic.Bool
	handler := func(ctx context.Context, tx pgx.Tx, id string, msg jetstream.Msg) error {
		if err := natsconsumer.ApplyCredit(ctx, tx, id, msg); err != nil {
			return err
		}
		var c natsconsumer.Credit
		if err := json.Unmarshal(msg.Data(), &c); err != nil {
			return err
		}
		table := "account_links"
		if strings.HasPrefix(c.Account, "frozen") {
			table = "frozen"
		}
		_, err := tx.Exec(ctx, `INSERT INTO `+table+` VALUES ($1)`, c.Account)
		return err
	}
	linked := natsconsumer.Credit{Account: "acct-new", AmountCents: 100}
	publish(t, js, subject, "linked", linked)
	last := publish(t, js, subject, "frozen", natsconsumer.Credit{Account: "frozen-1", AmountCents: 100}).Sequence
	var tl tally
	stop := start(t, ctx, newConsumer(t, js, store, stream, durable, handler, natsconsumer.WithMaxAttempts(3),
		natsconsumer.WithRetryBackoff(50*time.Millisecond, 100*time.Millisecond),
		natsconsumer.WithOutcomeHook(func(d natsconsumer.Delivery) {
			tl.record(d)
			if d.ID == "linked" && d.Outcome == natsconsumer.Retried && failedOnce.CompareAndSwap(false, true) {
				// The account arrives after the credit's first delivery.
				if _, err := pool.Exec(context.Background(), `INSERT INTO accounts VALUES ('acct-new')`); err != nil {
					t.Errorf("insert the account: %v", err)
				}
			}
		})))
	waitAcked(t, js, stream, durable, last, func() bool { return len(tl.of("frozen")) == 3 && len(tl.of("linked")) == 2 })
	require.ErrorIs(t, stop(), context.Canceled)
	t.Logf("consumer: %v", &tl)

	ls := tl.of("linked")
	require.Equal(t, []natsconsumer.Outcome{natsconsumer.Retried, natsconsumer.Applied}, outcomes(ls), "%v", ls[0].Err)
	require.ErrorContains(t, ls[0].Err, "account_links_account_id_fkey")
	fs := tl.of("frozen")
	require.Equal(t, []natsconsumer.Outcome{natsconsumer.Retried, natsconsumer.Retried, natsconsumer.GaveUp}, outcomes(fs), "%v", fs[0].Err)
	for _, d := range fs {
		require.ErrorContains(t, d.Err, "refused at COMMIT")
		require.ErrorContains(t, d.Err, "SQLSTATE P0001: account frozen-1 is frozen")
	}
	requireAppliedOnce(t, pool, map[string]natsconsumer.Credit{"linked": linked})
	var keys int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM idempotency_keys`).Scan(&keys))
	require.Equal(t, 1, keys, "only the applied credit's ID is stored")
}
