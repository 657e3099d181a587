package natsconsumer_test

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"
	"github.com/stretchr/testify/require"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/examples/natsconsumer"
)

// A handler slower than the AckWait: JetStream redelivers its message while
// the first delivery still holds the ID, to the other replica (which waits
// for the ID, then nacks with a delay or finds it committed) or behind the
// slow one in the same replica (which finds it committed). Messages waiting
// in a busy replica's buffer time out too and are redelivered to the other.
func TestRedeliveryAfterAckWait(t *testing.T) {
	t.Parallel()
	pool, store := newDB(t, idempotency.WithInProgressWait(150*time.Millisecond), idempotency.WithSuggestedRetryDelay(100*time.Millisecond))
	_, js := connect(t)
	const ackWait, slowFor = 500 * time.Millisecond, 1200 * time.Millisecond
	stream, durable, subject := newStream(t, js, 0, ackWait)
	ctx := context.Background()

	slow := map[string]bool{"credit-3": true, "credit-10": true, "credit-17": true}
	handler := func(ctx context.Context, tx pgx.Tx, id string, msg jetstream.Msg) error {
		if err := natsconsumer.ApplyCredit(ctx, tx, id, msg); err != nil {
			return err
		}
		if slow[id] {
			// Written, not committed, ID held, while the AckWait runs out.
			select {
			case <-time.After(slowFor):
			case <-ctx.Done():
				return ctx.Err()
			}
		}
		return nil
	}

	want := map[string]natsconsumer.Credit{}
	var last uint64
	for i := range 24 {
		id, c := fmt.Sprintf("credit-%d", i), natsconsumer.Credit{Account: fmt.Sprintf("acct-%d", i%4), AmountCents: int64(100 + i)}
		want[id] = c
		last = publish(t, js, subject, id, c).Sequence
	}
	bare := map[uint64]natsconsumer.Credit{}
	for i := range 2 { // no Nats-Msg-Id: identified by their place in the stream
		c := natsconsumer.Credit{Account: "acct-0", AmountCents: int64(5000 + i)}
		body, err := json.Marshal(c)
		require.NoError(t, err)
		ack, err := js.Publish(ctx, subject, body)
		require.NoError(t, err)
		bare[ack.Sequence] = c
		last = ack.Sequence
	}

	var tl tally
	var stops []func() error
	for range 2 { // two replicas on the same durable, each with its own connection
		_, js := connect(t)
		stops = append(stops, start(t, ctx, newConsumer(t, js, store, stream, durable, handler, tl.hook())))
	}
	waitAcked(t, js, stream, durable, last, func() bool {
		// Each slow message was redelivered before its ack; wait until
		// those deliveries were processed too.
		for id := range slow {
			if len(tl.of(id)) < 2 {
				return false
			}
		}
		return true
	})
	settled := len(tl.all()) // later ones may be cut short by the shutdown
	for _, stop := range stops {
		require.ErrorIs(t, stop(), context.Canceled)
	}
	t.Logf("%d messages, AckWait %v, %d handlers taking %v: %v", len(want)+len(bare), ackWait, len(slow), slowFor, &tl)
	for _, d := range tl.all() {
		if c, ok := bare[d.Sequence]; ok {
			require.True(t, strings.HasPrefix(d.ID, fmt.Sprintf("seq:%s.%d.", stream, d.Sequence)), "%s", d.ID)
			want[d.ID] = c
		}
	}
	require.Len(t, want, 24+len(bare), "every delivery of a bare message has one ID")

	requireAppliedOnce(t, pool, want)
	for id := range want {
		applied := 0
		for _, d := range tl.of(id) {
			if d.Outcome == natsconsumer.Applied {
				applied++
			}
		}
		require.Equal(t, 1, applied, "deliveries of %s reported as applied", id)
	}
	for id := range slow {
		ds := tl.of(id)
		require.GreaterOrEqual(t, len(ds), 2, "%s was redelivered", id)
		t.Logf("%s: %d deliveries: %v", id, len(ds), outcomes(ds))
	}
	require.GreaterOrEqual(t, tl.count(natsconsumer.Duplicate)+tl.count(natsconsumer.InProgress), len(slow))
	for _, d := range tl.all()[:settled] {
		if d.Outcome == natsconsumer.Retried || d.Outcome == natsconsumer.Rejected || d.Outcome == natsconsumer.GaveUp {
			t.Errorf("%s delivery %d: %v: %v", d.ID, d.NumDelivered, d.Outcome, d.Err)
		}
	}
}

// A consumer dies in the middle of a message; a new consumer on the same
// durable gets the message again after the AckWait (or the Nak's backoff)
// and applies it if, and only if, it had not committed.
func TestConsumerKilledMidMessage(t *testing.T) {
	t.Parallel()
	type crashFunc func(ctx context.Context, tx pgx.Tx, id string, msg jetstream.Msg, nc *nats.Conn, cancel context.CancelFunc) error
	for _, tc := range []struct {
		name string
		// crash is the first consumer's handler for the target message.
		crash crashFunc
		// firstOutcome is what the dying consumer reported for it, and
		// acked whether it could still acknowledge it.
		firstOutcome natsconsumer.Outcome
		acked        bool
		// nextOutcome is what the new consumer does with the redelivery.
		nextOutcome natsconsumer.Outcome
	}{{
		name: "killed after commit, before ack",
		crash: func(ctx context.Context, tx pgx.Tx, id string, msg jetstream.Msg, nc *nats.Conn, cancel context.CancelFunc) error {
			err := natsconsumer.ApplyCredit(ctx, tx, id, msg)
			// The process dies as the transaction commits: the ack never
			// leaves it.
			nc.Close()
			cancel()
			return err
		},
		firstOutcome: natsconsumer.Applied,
		nextOutcome:  natsconsumer.Duplicate,
	}, {
		name: "killed before commit",
		crash: func(ctx context.Context, tx pgx.Tx, id string, msg jetstream.Msg, nc *nats.Conn, cancel context.CancelFunc) error {
			if err := natsconsumer.ApplyCredit(ctx, tx, id, msg); err != nil {
				return err
			}
			// The process dies with the credit written but not committed:
			// PostgreSQL loses the session and rolls back, NATS loses the
			// client.
			_, err := tx.Exec(ctx, `SELECT pg_terminate_backend(pg_backend_pid())`)
			nc.Close()
			cancel()
			return err
		},
		firstOutcome: natsconsumer.Retried,
		nextOutcome:  natsconsumer.Applied,
	}, {
		name: "stopped before commit",
		crash: func(ctx context.Context, tx pgx.Tx, id string, msg jetstream.Msg, nc *nats.Conn, cancel context.CancelFunc) error {
			cancel() // shutdown: the handler's next statement fails
			return natsconsumer.ApplyCredit(ctx, tx, id, msg)
		},
		firstOutcome: natsconsumer.Retried,
		acked:        true, // nacked: redelivered after the backoff
		nextOutcome:  natsconsumer.Applied,
	}} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool, store := newDB(t)
			_, js := connect(t)
			stream, durable, subject := newStream(t, js, 0, 500*time.Millisecond)
			const target = "credit-3"
			want := map[string]natsconsumer.Credit{}
			var last uint64
			for i := range 8 {
				id, c := fmt.Sprintf("credit-%d", i), natsconsumer.Credit{Account: fmt.Sprintf("acct-%d", i%2), AmountCents: int64(100 * (i + 1))}
				want[id] = c
				last = publish(t, js, subject, id, c).Sequence
			}

			var first, next tally
			nc1, js1 := connect(t) // the dying consumer's own connection
			ctx1, cancel1 := context.WithCancel(context.Background())
			defer cancel1()
			handler := func(ctx context.Context, tx pgx.Tx, id string, msg jetstream.Msg) error {
				if id == target {
					return tc.crash(ctx, tx, id, msg, nc1, cancel1)
				}
				return natsconsumer.ApplyCredit(ctx, tx, id, msg)
			}
			err := newConsumer(t, js1, store, stream, durable, handler, first.hook()).Run(ctx1)
			require.ErrorIs(t, err, context.Canceled)
			got := first.of(target)
			require.Len(t, got, 1)
			require.Equal(t, tc.firstOutcome, got[0].Outcome)
			require.Equal(t, tc.acked, got[0].AckErr == nil, "ack error: %v", got[0].AckErr)
			require.Len(t, first.all(), 4, "the dying consumer processes nothing after the target")

			stop := start(t, context.Background(), newConsumer(t, js, store, stream, durable, natsconsumer.ApplyCredit, next.hook()))
			waitAcked(t, js, stream, durable, last, func() bool { return len(next.of(target)) > 0 })
			require.ErrorIs(t, stop(), context.Canceled)
			t.Logf("dying consumer: %v (target: %v, ack error %v); new consumer: %v",
				&first, got[0].Outcome, got[0].AckErr, &next)

			redelivered := next.of(target)
			require.Equal(t, tc.nextOutcome, redelivered[0].Outcome)
			require.Greater(t, redelivered[0].NumDelivered, uint64(1))
			requireAppliedOnce(t, pool, want)
			require.Equal(t, len(want), first.count(natsconsumer.Applied)+next.count(natsconsumer.Applied))
		})
	}
}

// JetStream drops a republished Nats-Msg-Id only within the stream's
// duplicate window; after it, the copy is a new message in the stream, and
// the consumer recognizes it by the ID it stored.
func TestSameIDAfterDuplicateWindow(t *testing.T) {
	t.Parallel()
	pool, store := newDB(t)
	_, js := connect(t)
	// A window long enough that the copy surely falls within it, then a
	// short one for the copies that must fall after it.
	stream, durable, subject := newStream(t, js, time.Hour, 5*time.Second)
	credit := natsconsumer.Credit{Account: "acct-1", AmountCents: 2500}
	body, err := json.Marshal(credit)
	require.NoError(t, err)

	first := publish(t, js, subject, "order-42", credit)
	within := publish(t, js, subject, "order-42", credit)
	require.True(t, within.Duplicate, "within the window JetStream drops the copy itself")
	require.Equal(t, first.Sequence, within.Sequence)
	info, err := js.Stream(context.Background(), stream)
	require.NoError(t, err)
	cfg := info.CachedInfo().Config
	cfg.Duplicates = 200 * time.Millisecond
	_, err = js.UpdateStream(context.Background(), cfg)
	require.NoError(t, err)
	after := publishAfterWindow(t, js, subject, "order-42", body)
	other, err := json.Marshal(natsconsumer.Credit{Account: "acct-1", AmountCents: 9900})
	require.NoError(t, err)
	reused := publishAfterWindow(t, js, subject, "order-42", other)

	var tl tally
	stop := start(t, context.Background(), newConsumer(t, js, store, stream, durable, natsconsumer.ApplyCredit, tl.hook()))
	waitAcked(t, js, stream, durable, reused.Sequence, func() bool { return len(tl.all()) >= 3 })
	require.ErrorIs(t, stop(), context.Canceled)
	t.Logf("one ID published 4 times: JetStream stored 3 (sequences %d, %d, %d); consumer: %v",
		first.Sequence, after.Sequence, reused.Sequence, &tl)

	ds := tl.all()
	require.Len(t, ds, 3)
	require.Equal(t, []natsconsumer.Outcome{natsconsumer.Applied, natsconsumer.Duplicate, natsconsumer.Rejected}, outcomes(ds))
	require.Equal(t, []uint64{first.Sequence, after.Sequence, reused.Sequence}, []uint64{ds[0].Sequence, ds[1].Sequence, ds[2].Sequence})
	require.ErrorIs(t, ds[2].Err, idempotency.ErrKeyReused, "same ID, different body")
	requireAppliedOnce(t, pool, map[string]natsconsumer.Credit{"order-42": credit})
}

// A message that can never be applied is terminated on its first delivery,
// and its final outcome, stored, rejects it again when it comes back.
func TestPoisonMessagesAreTerminated(t *testing.T) {
	t.Parallel()
	pool, store := newDB(t)
	_, js := connect(t)
	stream, durable, subject := newStream(t, js, 200*time.Millisecond, 5*time.Second)
	ctx := context.Background()

	credit := natsconsumer.Credit{Account: "acct-1", AmountCents: 700}
	publish(t, js, subject, "credit-ok", credit)
	_, err := natsconsumer.Publish(ctx, js, subject, "poison-1", []byte("not json"))
	require.NoError(t, err)
	_, err = natsconsumer.Publish(ctx, js, subject, "bad id", []byte(`{}`))
	require.ErrorIs(t, err, idempotency.ErrInvalidKey, "Publish checks the ID")
	_, err = js.Publish(ctx, subject, []byte(`{"account":"acct-1","amount_cents":1}`), jetstream.WithMsgID("bad id"))
	require.NoError(t, err)
	again := publishAfterWindow(t, js, subject, "poison-1", []byte("not json"))

	var runs atomic.Int32
	handler := func(ctx context.Context, tx pgx.Tx, id string, msg jetstream.Msg) error {
		if id == "poison-1" {
			runs.Add(1)
		}
		return natsconsumer.ApplyCredit(ctx, tx, id, msg)
	}
	var tl tally
	stop := start(t, ctx, newConsumer(t, js, store, stream, durable, handler, tl.hook()))
	waitAcked(t, js, stream, durable, again.Sequence, func() bool { return len(tl.all()) >= 4 })
	require.ErrorIs(t, stop(), context.Canceled)
	t.Logf("consumer: %v", &tl)

	require.Equal(t, []natsconsumer.Outcome{natsconsumer.Applied, natsconsumer.Rejected, natsconsumer.Rejected, natsconsumer.Rejected}, outcomes(tl.all()))
	poison := tl.of("poison-1")
	require.Len(t, poison, 2, "terminated, so only the republished copy comes back")
	for _, d := range poison {
		require.Equal(t, uint64(1), d.NumDelivered)
		require.ErrorContains(t, d.Err, "credit poison-1")
		require.NoError(t, d.AckErr)
	}
	require.Equal(t, int32(1), runs.Load(), "the final outcome is replayed without running the handler")
	require.ErrorIs(t, tl.of("bad id")[0].Err, idempotency.ErrInvalidKey)
	requireAppliedOnce(t, pool, map[string]natsconsumer.Credit{"credit-ok": credit})
}

func TestNewRequiresExplicitAcks(t *testing.T) {
	t.Parallel()
	_, store := newDB(t)
	_, js := connect(t)
	stream, _, _ := newStream(t, js, 0, time.Second)
	cons, err := js.CreateOrUpdateConsumer(context.Background(), stream, jetstream.ConsumerConfig{
		Durable: randomName("all_"), AckPolicy: jetstream.AckAllPolicy,
	})
	require.NoError(t, err)
	_, err = natsconsumer.New(store, cons, natsconsumer.ApplyCredit)
	require.ErrorContains(t, err, "want explicit")
}

// publishAfterWindow publishes until JetStream stores the message instead of
// dropping it as a duplicate, that is, once the stream's duplicate window
// since the ID's last stored message has passed.
func publishAfterWindow(t *testing.T, js jetstream.JetStream, subject, id string, body []byte) *jetstream.PubAck {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for attempt := 1; ; attempt++ {
		ack, err := natsconsumer.Publish(context.Background(), js, subject, id, body)
		require.NoError(t, err)
		if !ack.Duplicate {
			t.Logf("%s stored again as sequence %d after %d publishes", id, ack.Sequence, attempt)
			return ack
		}
		require.True(t, time.Now().Before(deadline), "JetStream still drops %s as a duplicate", id)
		time.Sleep(50 * time.Millisecond)
	}
}

func outcomes(ds []natsconsumer.Delivery) []natsconsumer.Outcome {
	out := make([]natsconsumer.Outcome, len(ds))
	for i, d := range ds {
		out[i] = d.Outcome
	}
	return out
}

// A credit's handler fails on its first two deliveries (a row it needs is
// not there yet) and succeeds on the third; WithMaxAttempts leaves it 10.
// JetStream counts deliveries, not the handler's failures: a durable with
// MaxDeliver 2 stops delivering the message after the second, applied or
// not, whatever the consumer would have done with a third (a database
// outage, another delivery holding the ID, count the same).
//
// Before the fix: New took the durable; the credit was delivered twice,
// nacked twice, and never again: not applied, not terminated, no outcome
// said it was lost.
//
// Now: New refuses a durable with a MaxDeliver, saying why; on one
// without, the credit is applied on its third delivery.
func TestNewRefusesAConsumerThatDropsMessagesAfterMaxDeliver(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name       string
		maxDeliver int
		refused    string
	}{
		{name: "unlimited"},
		{name: "max deliver 2", maxDeliver: 2, refused: "MaxDeliver 2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			pool, store := newDB(t)
			nc, js := connect(t)
			stream, _, subject := newStream(t, js, 0, 5*time.Second)
			ctx := context.Background()
			durable := randomName("limited_")
			cons, err := js.CreateOrUpdateConsumer(ctx, stream, jetstream.ConsumerConfig{
				Durable: durable, AckPolicy: jetstream.AckExplicitPolicy, AckWait: 5 * time.Second, MaxDeliver: tc.maxDeliver,
			})
			require.NoError(t, err)
			dropped, err := nc.SubscribeSync("$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES." + stream + "." + durable)
			require.NoError(t, err)
			var deliveries atomic.Int64
			handler := func(ctx context.Context, tx pgx.Tx, id string, msg jetstream.Msg) error {
				if deliveries.Add(1) <= 2 {
					return fmt.Errorf("account of %s not there yet", id)
				}
				return natsconsumer.ApplyCredit(ctx, tx, id, msg)
			}
			var tl tally
			c, err := natsconsumer.New(store, cons, handler, tl.hook(), natsconsumer.WithRetryBackoff(10*time.Millisecond, 10*time.Millisecond))
			if err == nil {
				credit := natsconsumer.Credit{Account: "acct-1", AmountCents: 250}
				publish(t, js, subject, "credit-1", credit)
				stop := start(t, ctx, c)
				var lost bool
				require.Eventually(t, func() bool {
					if _, err := dropped.NextMsg(time.Millisecond); err == nil {
						lost = true
					}
					return lost || tl.count(natsconsumer.Applied) == 1
				}, 20*time.Second, 20*time.Millisecond, "the credit neither applied nor dropped")
				require.ErrorIs(t, stop(), context.Canceled)
				t.Logf("%v", &tl)
				rows := 0
				require.NoError(t, pool.QueryRow(ctx, `SELECT count(*) FROM account_credits`).Scan(&rows))
				require.Empty(t, tc.refused, "New took a durable with MaxDeliver %d: JetStream dropped the credit after %d deliveries (dropped: %v, applied: %d rows, outcomes: %v)",
					tc.maxDeliver, deliveries.Load(), lost, rows, outcomes(tl.all()))
				requireAppliedOnce(t, pool, map[string]natsconsumer.Credit{"credit-1": credit})
				return
			}
			require.NotEmpty(t, tc.refused, "New refused: %v", err)
			require.ErrorContains(t, err, tc.refused)
			t.Logf("refused: %v", err)
		})
	}
}
