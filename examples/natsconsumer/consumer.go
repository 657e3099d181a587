package natsconsumer

import (
	"context"
	"errors"
	"fmt"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/exactlyonce/idempotency"
)

// Handler applies one message's effect through tx, the transaction that also
// records the message's ID; it must not commit or roll back tx. id is the
// message's ID (see [Consumer]).
//
// An error rolls back tx and the message is redelivered after a short
// backoff ([WithRetryBackoff]). Return
// [idempotency.Final](err) for a message that can never succeed, such as one
// that does not parse: the error is stored as the message's final outcome and
// the message is terminated, on this delivery and on any later one.
type Handler func(ctx context.Context, tx pgx.Tx, id string, msg jetstream.Msg) error

// Outcome says what a [Consumer] did with one delivery.
type Outcome int

// Outcomes of a delivery, each with the acknowledgement the consumer sent.
const (
	// Applied: the message's effect and ID committed now. Acked.
	Applied Outcome = iota + 1
	// Duplicate: the ID was already processed; the handler did not run. Acked.
	Duplicate
	// Retried: the handler or the database failed and everything rolled
	// back. Nacked, so JetStream redelivers the message after a backoff
	// ([WithRetryBackoff]).
	Retried
	// InProgress: another delivery of the same ID was still being processed
	// ([idempotency.ErrInProgress]). Nacked with the store's retry delay.
	InProgress
	// Rejected: the message can never be applied: the handler returned an
	// [idempotency.Final] error (now or on an earlier delivery), the ID is
	// invalid, or it was first used with a different body
	// ([idempotency.ErrKeyReused]). Terminated, so it is not redelivered.
	Rejected
)

var outcomeNames = [...]string{"unknown", "applied", "duplicate", "retried", "in progress", "rejected"}

// String returns a lower-case name such as "duplicate", for logs.
func (o Outcome) String() string {
	if o < 0 || int(o) >= len(outcomeNames) {
		return outcomeNames[0]
	}
	return outcomeNames[o]
}

// Delivery describes one delivery of a message and what became of it, for
// [WithOutcomeHook].
type Delivery struct {
	// ID is the message's ID, or empty when it could not be determined.
	ID string
	// Sequence is the message's sequence number in the stream.
	Sequence uint64
	// NumDelivered counts the deliveries of this message, this one included:
	// 1 for the first.
	NumDelivered uint64
	// Outcome is what the consumer did.
	Outcome Outcome
	// Err is why the outcome is not Applied or Duplicate.
	Err error
	// AckErr is the error of sending the Ack, Nak or Term, if any. The
	// message is then redelivered after the consumer's AckWait.
	AckErr error
}

// Consumer applies the messages of a durable JetStream pull consumer
// through a [Handler], each at most once per message ID, and acknowledges
// each message only after its effect committed.
//
// A message's ID is its Nats-Msg-Id header (see [Publish]). A message
// without one is identified by its place in the stream,
// "seq:<stream>:<sequence>", which recognizes redeliveries of the stored
// message but not a second publish of the same content.
type Consumer struct {
	store   *idempotency.Store
	cons    jetstream.Consumer
	handler Handler
	stream  string
	opts    options
}

// New returns a Consumer that applies the messages of cons with h, recording
// their IDs in store. cons must be a pull consumer with
// [jetstream.AckExplicitPolicy]: every message is acknowledged on its own,
// after its own commit. Give it an AckWait longer than the slowest handler
// and leave MaxDeliver unlimited: JetStream drops a message that ran out of
// deliveries, and its effect is lost.
func New(store *idempotency.Store, cons jetstream.Consumer, h Handler, opts ...Option) (*Consumer, error) {
	if store == nil || cons == nil || h == nil {
		return nil, errors.New("natsconsumer: New: store, consumer and handler are required")
	}
	info := cons.CachedInfo()
	if info.Config.AckPolicy != jetstream.AckExplicitPolicy {
		return nil, fmt.Errorf("natsconsumer: consumer %s has ack policy %v, want explicit: each message must be acknowledged after its own commit",
			info.Name, info.Config.AckPolicy)
	}
	o := evaluateOptions(opts)
	if o.scope == "" {
		o.scope = info.Stream + "/" + info.Name
	}
	return &Consumer{store: store, cons: cons, handler: h, stream: info.Stream, opts: o}, nil
}

// Run processes messages one at a time until ctx is done, then returns ctx's
// error; it returns earlier with the error that ended the subscription, such
// as a closed connection or a deleted consumer. Run several Consumers, in
// one process or many, on the same durable consumer to process messages in
// parallel.
//
// The handler runs with ctx. A message being processed when ctx is done
// commits and is acknowledged if its handler still succeeds, and is otherwise
// rolled back and nacked. Messages pulled ahead but not yet processed are
// redelivered after the AckWait.
func (c *Consumer) Run(ctx context.Context) error {
	it, err := c.cons.Messages(c.opts.pull...)
	if err != nil {
		return fmt.Errorf("natsconsumer: %w", err)
	}
	defer it.Stop()
	for ctx.Err() == nil {
		msg, err := it.Next(jetstream.NextContext(ctx))
		switch {
		case ctx.Err() != nil:
			if msg != nil {
				_ = msg.Nak() // not processed: let another consumer have it now
			}
		case errors.Is(err, jetstream.ErrNoHeartbeat):
			// The iterator asks the server again on the next call.
		case err != nil:
			return fmt.Errorf("natsconsumer: %w", err)
		default:
			c.process(ctx, msg)
		}
	}
	return ctx.Err()
}

func (c *Consumer) process(ctx context.Context, msg jetstream.Msg) {
	var d Delivery
	meta, err := msg.Metadata()
	if err == nil {
		d.Sequence, d.NumDelivered = meta.Sequence.Stream, meta.NumDelivered
		d.ID = msg.Headers().Get(jetstream.MsgIDHeader)
		if d.ID == "" {
			d.ID = fmt.Sprintf("seq:%s:%d", c.stream, meta.Sequence.Stream)
		}
		d.Outcome, d.Err = c.apply(ctx, d.ID, msg, meta.NumDelivered > 1)
	} else {
		d.Outcome, d.Err = Rejected, err
	}

	switch d.Outcome {
	case Applied, Duplicate:
		d.AckErr = msg.Ack()
	case InProgress:
		delay, _ := idempotency.RetryDelay(d.Err)
		d.AckErr = msg.NakWithDelay(delay)
	case Rejected:
		// Not TermWithReason: servers before 2.10.4 ignore it and the
		// message would be redelivered forever.
		d.AckErr = msg.Term()
	default:
		d.AckErr = msg.NakWithDelay(c.backoff(d.NumDelivered))
	}
	if c.opts.onOutcome != nil {
		c.opts.onOutcome(d)
	}
}

// backoff is the redelivery delay of a message that failed on its n-th
// delivery.
func (c *Consumer) backoff(n uint64) time.Duration {
	d := c.opts.backoffBase
	for i := uint64(1); i < n && d < c.opts.backoffMax; i++ {
		d *= 2
	}
	return min(d, c.opts.backoffMax)
}

// apply runs the handler for msg at most once per ID and says what happened.
func (c *Consumer) apply(ctx context.Context, id string, msg jetstream.Msg, redelivered bool) (Outcome, error) {
	outcome, err := c.store.ProcessMessage(ctx, idempotency.Message{Scope: c.opts.scope, ID: id, Body: msg.Data(), TTL: c.opts.ttl, Redelivered: redelivered},
		func(ctx context.Context, tx pgx.Tx) error { return c.handler(ctx, tx, id, msg) })
	switch idempotency.DispositionOf(outcome, err) {
	case idempotency.Ack:
		if outcome == idempotency.OutcomeReplayed {
			return Duplicate, nil
		}
		return Applied, nil
	case idempotency.DeadLetter:
		// A final outcome (now or by an earlier delivery), or an ID that
		// can never be processed: redelivering cannot change it.
		return Rejected, err
	}
	if errors.Is(err, idempotency.ErrInProgress) {
		return InProgress, err
	}
	return Retried, err
}
