package natsconsumer_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/examples/natsconsumer"
)

// The IDs of messages: a message without Nats-Msg-Id is identified by its
// place in its stream's incarnation, and publisher IDs and places never
// meet.

// publishBare publishes a credit without Nats-Msg-Id and returns its
// sequence.
func publishBare(t *testing.T, js jetstream.JetStream, subject string, c natsconsumer.Credit) uint64 {
	t.Helper()
	body, err := json.Marshal(c)
	require.NoError(t, err)
	ack, err := js.Publish(context.Background(), subject, body)
	require.NoError(t, err)
	return ack.Sequence
}

// publishWithID publishes a credit with id as its Nats-Msg-Id, whatever id
// looks like, and returns its sequence.
func publishWithID(t *testing.T, js jetstream.JetStream, subject, id string, c natsconsumer.Credit) uint64 {
	t.Helper()
	body, err := json.Marshal(c)
	require.NoError(t, err)
	ack, err := js.Publish(context.Background(), subject, body, jetstream.WithMsgID(id))
	require.NoError(t, err)
	require.False(t, ack.Duplicate)
	return ack.Sequence
}

// balances is every account's balance and how many credit rows and
// distinct message IDs were applied.
func balances(t *testing.T, pool *pgxpool.Pool) (map[string]int64, int, int) {
	t.Helper()
	ctx := context.Background()
	rows, err := pool.Query(ctx, `SELECT account_id, balance_cents FROM account_balances`)
	require.NoError(t, err)
	got := map[string]int64{}
	var account string
	var cents int64
	_, err = pgx.ForEachRow(rows, []any{&account, &cents}, func() error {
		got[account] = cents
		return nil
	})
	require.NoError(t, err)
	var credits, ids int
	require.NoError(t, pool.QueryRow(ctx, `SELECT count(*), count(DISTINCT msg_id) FROM account_credits`).Scan(&credits, &ids))
	return got, credits, ids
}

// A stream deleted and created again starts its sequences over. Its
// messages without Nats-Msg-Id are new messages, not the old ones at the
// same places: sequence 1 with another body is applied (it was terminated
// as ErrKeyReused), and sequence 2 with the old sequence 2's body is
// applied (it was acked as a duplicate): 300 + 300 + 200, not 300. The
// Consumer made before the recreation runs again on the new stream, so
// nothing it learned at New can be what tells the two apart.
func TestRecreatedStreamAppliesItsMessages(t *testing.T) {
	t.Parallel()
	pool, store := newDB(t)
	_, js := connect(t)
	const ackWait = 5 * time.Second
	stream, durable, subject := newStream(t, js, 0, ackWait)
	ctx := context.Background()

	var tl tally
	c := newConsumer(t, js, store, stream, durable, natsconsumer.ApplyCredit, tl.hook())
	run := func() chan error {
		done := make(chan error, 1)
		rctx, cancel := context.WithCancel(ctx)
		t.Cleanup(cancel)
		go func() { done <- c.Run(rctx) }()
		return done
	}
	publishBare(t, js, subject, natsconsumer.Credit{Account: "acct-1", AmountCents: 100})
	last := publishBare(t, js, subject, natsconsumer.Credit{Account: "acct-1", AmountCents: 200})
	done := run()
	waitAcked(t, js, stream, durable, last, func() bool { return len(tl.all()) == 2 })

	require.NoError(t, js.DeleteStream(ctx, stream))
	select {
	case err := <-done:
		t.Logf("Run ended with the stream: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("Run went on after its stream was deleted")
	}
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}})
	require.NoError(t, err)
	_, err = js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{Durable: durable, AckPolicy: jetstream.AckExplicitPolicy, AckWait: ackWait})
	require.NoError(t, err)
	require.Equal(t, uint64(1), publishBare(t, js, subject, natsconsumer.Credit{Account: "acct-1", AmountCents: 300}))
	last = publishBare(t, js, subject, natsconsumer.Credit{Account: "acct-1", AmountCents: 200})
	require.Equal(t, uint64(2), last)
	run()
	waitAcked(t, js, stream, durable, last, func() bool { return len(tl.all()) == 4 })

	ds := tl.all()
	t.Logf("deliveries: %v", &tl)
	for _, d := range ds {
		require.Equal(t, natsconsumer.Applied, d.Outcome, "%s (sequence %d): %v", d.ID, d.Sequence, d.Err)
		require.NoError(t, idempotency.ValidateKey(d.ID))
	}
	got, credits, ids := balances(t, pool)
	require.Equal(t, map[string]int64{"acct-1": 800}, got)
	require.Equal(t, 4, credits)
	require.Equal(t, 4, ids, "four messages, four IDs")
}

// A publisher's Nats-Msg-Id that looks like a place in the stream (the ID
// the consumer gave a message without one, or the form it had) takes no
// message's place: the publisher's message and the message at that place
// are each applied once.
func TestPublisherIDsAndPlacesNeverMeet(t *testing.T) {
	t.Parallel()
	pool, store := newDB(t)
	_, js := connect(t)
	stream, durable, subject := newStream(t, js, 0, 5*time.Second)
	ctx := context.Background()

	var tl tally
	stop := start(t, ctx, newConsumer(t, js, store, stream, durable, natsconsumer.ApplyCredit, tl.hook()))
	first := publishBare(t, js, subject, natsconsumer.Credit{Account: "acct-1", AmountCents: 100})
	waitAcked(t, js, stream, durable, first, func() bool { return len(tl.all()) == 1 })
	place := tl.all()[0].ID

	// The first message's own ID, sent by a publisher with another credit;
	// and the place the next bare message is at, in the form it had.
	publishWithID(t, js, subject, place, natsconsumer.Credit{Account: "acct-2", AmountCents: 5000})
	next := publishWithID(t, js, subject, fmt.Sprintf("seq:%s:%d", stream, 4), natsconsumer.Credit{Account: "acct-3", AmountCents: 70}) + 1
	require.Equal(t, next, publishBare(t, js, subject, natsconsumer.Credit{Account: "acct-4", AmountCents: 9}))
	waitAcked(t, js, stream, durable, next, func() bool { return len(tl.all()) == 4 })
	require.ErrorIs(t, stop(), context.Canceled)

	t.Logf("deliveries: %v", &tl)
	seen := map[string]bool{}
	for _, d := range tl.all() {
		require.Equal(t, natsconsumer.Applied, d.Outcome, "%s (sequence %d): %v", d.ID, d.Sequence, d.Err)
		require.False(t, seen[d.ID], "%s given to two messages", d.ID)
		seen[d.ID] = true
	}
	got, credits, _ := balances(t, pool)
	require.Equal(t, map[string]int64{"acct-1": 100, "acct-2": 5000, "acct-3": 70, "acct-4": 9}, got)
	require.Equal(t, 4, credits)
}

// A publisher's ID keeps the form the key table has it in: a message
// processed under it before, by this consumer or another version of it,
// is found on its redelivery.
func TestPublisherIDsKeepTheirStoredForm(t *testing.T) {
	t.Parallel()
	pool, store := newDB(t)
	_, js := connect(t)
	stream, durable, subject := newStream(t, js, 0, 5*time.Second)
	ctx := context.Background()
	credit := natsconsumer.Credit{Account: "acct-1", AmountCents: 2500}
	body, err := json.Marshal(credit)
	require.NoError(t, err)
	// As an earlier version stored it: the ID as the publisher sent it, in
	// the consumer's default scope.
	o, err := store.ProcessMessage(ctx, idempotency.Message{Scope: stream + "/" + durable, ID: "order-42", Body: body}, func(ctx context.Context, tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO account_credits (msg_id, account_id, amount_cents) VALUES ('order-42', 'acct-1', 2500);
INSERT INTO account_balances VALUES ('acct-1', 2500)`)
		return err
	})
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeExecuted, o)

	last := publish(t, js, subject, "order-42", credit).Sequence
	var tl tally
	stop := start(t, ctx, newConsumer(t, js, store, stream, durable, natsconsumer.ApplyCredit, tl.hook()))
	waitAcked(t, js, stream, durable, last, func() bool { return len(tl.all()) == 1 })
	require.ErrorIs(t, stop(), context.Canceled)
	require.Equal(t, natsconsumer.Duplicate, tl.all()[0].Outcome, "%v", tl.all()[0].Err)
	require.Equal(t, "order-42", tl.all()[0].ID)
	requireAppliedOnce(t, pool, map[string]natsconsumer.Credit{"order-42": credit})
}

// A stream whose name makes a message's place longer than a key may be
// still identifies its messages without Nats-Msg-Id by a valid key: they
// are applied, not terminated as invalid IDs.
func TestLongStreamNamePlacesAreValidKeys(t *testing.T) {
	t.Parallel()
	pool, store := newDB(t)
	_, js := connect(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stream := randomName("CREDITS_") + strings.Repeat("X", 230)
	subject := randomName("long") + ".credits"
	_, err := js.CreateStream(ctx, jetstream.StreamConfig{Name: stream, Subjects: []string{subject}})
	if err != nil && errors.Is(err, jetstream.ErrInvalidStreamName) {
		t.Fatalf("the server refuses a stream name of %d bytes: %v", len(stream), err)
	}
	require.NoError(t, err)
	t.Cleanup(func() { _ = js.DeleteStream(context.Background(), stream) })
	durable := randomName("applier_")
	_, err = js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{Durable: durable, AckPolicy: jetstream.AckExplicitPolicy, AckWait: 5 * time.Second})
	require.NoError(t, err)

	var tl tally
	stop := start(t, context.Background(), newConsumer(t, js, store, stream, durable, natsconsumer.ApplyCredit, tl.hook(), natsconsumer.WithScope("long")))
	last := publishBare(t, js, subject, natsconsumer.Credit{Account: "acct-1", AmountCents: 100})
	waitAcked(t, js, stream, durable, last, func() bool { return len(tl.all()) == 1 })
	require.ErrorIs(t, stop(), context.Canceled)
	d := tl.all()[0]
	require.Equal(t, natsconsumer.Applied, d.Outcome, "%s: %v", d.ID, d.Err)
	require.NoError(t, idempotency.ValidateKey(d.ID))
	got, _, _ := balances(t, pool)
	require.Equal(t, map[string]int64{"acct-1": 100}, got)
}

// With a store that suggests no retry delay (WithSuggestedRetryDelay(0))
// and a short in-progress wait, a message whose ID another process holds
// is nacked with the consumer's least delay, the retry backoff's base, not
// at once: no hot loop of redeliveries while the other holds it.
func TestInProgressNakHasAFloor(t *testing.T) {
	t.Parallel()
	pool, store := newDB(t, idempotency.WithSuggestedRetryDelay(0), idempotency.WithInProgressWait(time.Millisecond))
	_, js := connect(t)
	const holdFor, base = 1500 * time.Millisecond, 100 * time.Millisecond
	stream, durable, subject := newStream(t, js, 0, 5*time.Second)
	ctx := context.Background()
	credit := natsconsumer.Credit{Account: "acct-1", AmountCents: 100}
	body, err := json.Marshal(credit)
	require.NoError(t, err)

	// Another process applies the same message, and holds its ID while
	// the consumer gets it.
	holding, release := make(chan struct{}), make(chan struct{})
	other := make(chan error, 1)
	go func() {
		_, err := store.ProcessMessage(ctx, idempotency.Message{Scope: stream + "/" + durable, ID: "credit-1", Body: body}, func(ctx context.Context, tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, `INSERT INTO account_credits (msg_id, account_id, amount_cents) VALUES ('credit-1', 'acct-1', 100);
INSERT INTO account_balances VALUES ('acct-1', 100)`); err != nil {
				return err
			}
			close(holding)
			<-release
			return nil
		})
		other <- err
	}()
	select {
	case <-holding:
	case err := <-other:
		t.Fatalf("the other process's ProcessMessage ended before it held the ID: %v", err)
	case <-time.After(10 * time.Second):
		t.Fatal("the other process never held the ID")
	}
	last := publish(t, js, subject, "credit-1", credit).Sequence
	var tl tally
	start(t, ctx, newConsumer(t, js, store, stream, durable, natsconsumer.ApplyCredit, tl.hook(), natsconsumer.WithRetryBackoff(base, time.Second)))
	time.Sleep(holdFor)
	close(release)
	require.NoError(t, <-other)
	waitAcked(t, js, stream, durable, last, func() bool { return tl.count(natsconsumer.Duplicate) == 1 })
	inProgress := tl.count(natsconsumer.InProgress)
	t.Logf("while another process held the ID for %v: %v", holdFor, &tl)
	require.Positive(t, inProgress)
	// At most one nak per base delay while the ID was held, and one more
	// for the delivery in flight.
	require.LessOrEqual(t, inProgress, int(holdFor/base)+2, "in-progress naks without a delay")
	requireAppliedOnce(t, pool, map[string]natsconsumer.Credit{"credit-1": credit})
}
