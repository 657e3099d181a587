package natsconsumer_test

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency/examples/natsconsumer"
)

// panickingCredit applies credits, except the message "boom", on which it
// writes to a nil map, after writing its credit through tx.
func panickingCredit(ctx context.Context, tx pgx.Tx, id string, msg jetstream.Msg) error {
	if err := natsconsumer.ApplyCredit(ctx, tx, id, msg); err != nil {
		return err
	}
	if id == "boom" {
		var seen map[string]bool
		seen[id] = true
	}
	return nil
}

// A handler that panics on one message does not end Run (in a process, a
// crash on every redelivery of it): the panic rolls the message's
// transaction back, nothing stored, counts as a failed attempt, and after
// WithMaxAttempts the message is terminated, GaveUp, its Delivery naming
// the panic and where it happened. The messages around it are applied.
func TestHandlerPanicIsTerminatedAfterItsAttempts(t *testing.T) {
	t.Parallel()
	pool, store := newDB(t)
	_, js := connect(t)
	stream, durable, subject := newStream(t, js, 0, 5*time.Second)
	ctx := context.Background()
	before := natsconsumer.Credit{Account: "acct-1", AmountCents: 100}
	after := natsconsumer.Credit{Account: "acct-1", AmountCents: 200}
	publish(t, js, subject, "before", before)
	publish(t, js, subject, "boom", natsconsumer.Credit{Account: "acct-1", AmountCents: 5000})
	last := publish(t, js, subject, "after", after).Sequence

	var tl tally
	const attempts = 3
	stop := start(t, ctx, newConsumer(t, js, store, stream, durable, panickingCredit, tl.hook(),
		natsconsumer.WithMaxAttempts(attempts), natsconsumer.WithRetryBackoff(time.Millisecond, 5*time.Millisecond)))
	waitAcked(t, js, stream, durable, last, func() bool { return len(tl.of("boom")) == attempts && len(tl.of("after")) == 1 })
	require.ErrorIs(t, stop(), context.Canceled, "Run went on")
	t.Logf("consumer: %v", &tl)

	boom := tl.of("boom")
	require.Len(t, boom, attempts)
	for i, d := range boom {
		want := natsconsumer.Retried
		if i == attempts-1 {
			want = natsconsumer.GaveUp
			require.ErrorContains(t, d.Err, fmt.Sprintf("gave up after %d attempts", attempts))
		}
		require.Equal(t, want, d.Outcome, "delivery %d: %v", i+1, d.Err)
		require.Equal(t, uint64(i+1), d.NumDelivered)
		require.NoError(t, d.AckErr)
		var p *natsconsumer.PanicError
		require.True(t, errors.As(d.Err, &p), "delivery %d: %v", i+1, d.Err)
		require.Contains(t, fmt.Sprint(p.Value), "assignment to entry in nil map")
		require.Contains(t, string(p.Stack), "panickingCredit", "the stack shows where the handler panicked")
		require.ErrorContains(t, d.Err, "the handler panicked: assignment to entry in nil map")
	}
	require.Equal(t, "gave up", natsconsumer.GaveUp.String())
	requireAppliedOnce(t, pool, map[string]natsconsumer.Credit{"before": before, "after": after})

	// Terminated: JetStream does not deliver it again.
	cons, err := js.Consumer(ctx, stream, durable)
	require.NoError(t, err)
	info, err := cons.Info(ctx)
	require.NoError(t, err)
	require.Zero(t, info.NumAckPending)
	require.Zero(t, info.NumRedelivered)
}

// A handler that fails on its own counts its attempts too; one that
// recovers before its last is applied.
func TestHandlerFailureIsBoundedByMaxAttempts(t *testing.T) {
	t.Parallel()
	pool, store := newDB(t)
	_, js := connect(t)
	stream, durable, subject := newStream(t, js, 0, 5*time.Second)
	ctx := context.Background()
	credit := natsconsumer.Credit{Account: "acct-1", AmountCents: 100}
	publish(t, js, subject, "never", credit)
	last := publish(t, js, subject, "third-time", credit).Sequence
	tries := map[string]int{}
	handler := func(ctx context.Context, tx pgx.Tx, id string, msg jetstream.Msg) error {
		if tries[id]++; id == "never" || tries[id] < 3 {
			return fmt.Errorf("try %d of %s refused", tries[id], id)
		}
		return natsconsumer.ApplyCredit(ctx, tx, id, msg)
	}
	var tl tally
	stop := start(t, ctx, newConsumer(t, js, store, stream, durable, handler, tl.hook(),
		natsconsumer.WithMaxAttempts(4), natsconsumer.WithRetryBackoff(time.Millisecond, 5*time.Millisecond)))
	waitAcked(t, js, stream, durable, last, func() bool { return len(tl.of("never")) == 4 && len(tl.of("third-time")) == 3 })
	require.ErrorIs(t, stop(), context.Canceled)
	require.Equal(t, []natsconsumer.Outcome{natsconsumer.Retried, natsconsumer.Retried, natsconsumer.Retried, natsconsumer.GaveUp}, outcomes(tl.of("never")))
	require.ErrorContains(t, tl.of("never")[3].Err, "gave up after 4 attempts: try 4 of never refused")
	require.Equal(t, []natsconsumer.Outcome{natsconsumer.Retried, natsconsumer.Retried, natsconsumer.Applied}, outcomes(tl.of("third-time")))
	requireAppliedOnce(t, pool, map[string]natsconsumer.Credit{"third-time": credit})
}

// Invalid options are refused by New, naming the option.
func TestNewRefusesInvalidOptions(t *testing.T) {
	t.Parallel()
	_, store := newDB(t)
	_, js := connect(t)
	stream, durable, _ := newStream(t, js, 0, time.Second)
	cons, err := js.Consumer(context.Background(), stream, durable)
	require.NoError(t, err)
	for name, opt := range map[string]natsconsumer.Option{
		"WithMaxAttempts":  natsconsumer.WithMaxAttempts(0),
		"WithRetryBackoff": natsconsumer.WithRetryBackoff(0, time.Second),
	} {
		_, err := natsconsumer.New(store, cons, natsconsumer.ApplyCredit, opt)
		require.ErrorContains(t, err, name)
	}
	_, err = natsconsumer.New(store, cons, natsconsumer.ApplyCredit, natsconsumer.WithRetryBackoff(time.Second, time.Millisecond))
	require.ErrorContains(t, err, "WithRetryBackoff")
}
