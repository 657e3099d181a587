package natsconsumer

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/exactlyonce/idempotency"
)

// Handler applies one message's effect through tx, the transaction that also
// records the message's ID; it must not commit or roll back tx. id is the
// message's ID as the consumer records it (see [Consumer]).
//
// An error rolls back tx and the message is redelivered after a short
// backoff ([WithRetryBackoff]), up to [WithMaxAttempts] times; so does a
// panic, which the consumer recovers. Return [idempotency.Final](err) for a
// message that can never succeed, such as one that does not parse: the
// error is stored as the message's final outcome and the message is
// terminated, on this delivery and on any later one.
type Handler func(ctx context.Context, tx pgx.Tx, id string, msg jetstream.Msg) error

// Outcome says what a [Consumer] did with one delivery.
type Outcome int

// Outcomes of a delivery, each with the acknowledgement the consumer sent.
const (
	// Applied: the message's effect and ID committed now. Acked.
	Applied Outcome = iota + 1
	// Duplicate: the ID was already processed; the handler did not run. Acked.
	Duplicate
	// Retried: the handler or the database failed (or the handler
	// panicked: Err is a *[PanicError]) and everything rolled back. Nacked,
	// so JetStream redelivers the message after a backoff
	// ([WithRetryBackoff]).
	Retried
	// InProgress: another delivery of the same ID was still being processed
	// ([idempotency.ErrInProgress]). Nacked with the store's suggested
	// retry delay, at least the retry backoff's base ([WithRetryBackoff]).
	InProgress
	// Rejected: the message can never be applied: the handler returned an
	// [idempotency.Final] error (now or on an earlier delivery), the ID is
	// invalid, or it was first used with a different body
	// ([idempotency.ErrKeyReused]). Terminated, so it is not redelivered.
	Rejected
	// GaveUp: the handler failed, or panicked, on the last of the
	// message's attempts ([WithMaxAttempts]); Err says so and wraps the
	// last failure. Nothing of it committed. Terminated, so it is not
	// redelivered: a message that might succeed later (a row it needs
	// arrived since) must be published again.
	GaveUp
)

var outcomeNames = [...]string{"unknown", "applied", "duplicate", "retried", "in progress", "rejected", "gave up"}

// String returns a lower-case name such as "duplicate", for logs.
func (o Outcome) String() string {
	if o < 0 || int(o) >= len(outcomeNames) {
		return outcomeNames[0]
	}
	return outcomeNames[o]
}

// PanicError is the error of a delivery whose handler panicked: Value is
// what it panicked with, Stack the goroutine's stack where it did. The
// message's transaction was rolled back and nothing stored, as for an
// error; the attempt counts towards [WithMaxAttempts].
type PanicError struct {
	Value any
	Stack []byte
}

func (e *PanicError) Error() string {
	return fmt.Sprintf("the handler panicked: %v\n%s", e.Value, e.Stack)
}

// Delivery describes one delivery of a message and what became of it, for
// [WithOutcomeHook].
type Delivery struct {
	// ID is the message's ID as the consumer records it (see [Consumer]),
	// or empty when it could not be determined.
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
// # Message IDs
//
// A message's ID is its Nats-Msg-Id header (see [Publish]), as the
// publisher sent it. A message without one is identified by its place:
// "seq:<stream>.<sequence>.<stored>", stored being the time JetStream
// stored the message, in Unix nanoseconds, which every delivery of the
// message carries. That recognizes redeliveries of the stored message, but
// not a second publish of the same content. The stored time tells the
// incarnations of a stream apart: a stream deleted and created again
// starts its sequences over, but every message of the new one was stored
// after the old one was deleted, so no place of the new stream is a place
// of the old one (a redelivery names the message's own incarnation, so a
// Consumer running across a recreation needs no news of it). The stored
// times are the server's clock: one set back across the recreation, by
// more than the old stream lived, could repeat a place. A place
// longer than a key may be, or with a byte a key may not hold (a stream
// name that is not ASCII), is "seq:.place.<SHA-256 of it, in hex>".
//
// Publisher IDs and places never meet: no stream name is empty or holds a
// dot, so no place is a publisher's ID kept as sent, and a publisher's ID
// that starts with "seq:" (the places' prefix) is recorded as
// "seq:.id.<SHA-256 of it, in hex>", which no place is either. A
// publisher cannot take a message's place, nor a message a publisher's ID.
//
// # Upgrading from the seq:<stream>:<sequence> form
//
// Earlier versions recorded a message without Nats-Msg-Id as
// "seq:<stream>:<sequence>", and a publisher's ID starting with "seq:" as
// sent. Publisher IDs that do not start with "seq:" are recorded exactly
// as before: a redelivery of a message processed before the upgrade finds
// its ID. The two others are a one-time effect: the old form says nothing
// of the stream's incarnation (finding it would keep the defect the new
// form fixes for a TTL), so a redelivery of such a message that the old
// version committed but did not acknowledge (it died between the two, or
// its ack was lost) is applied again. To upgrade without that, stop the
// old consumers (cancel Run: the message in hand is finished and
// acknowledged), wait until the durable has no message pending an ack
// (ConsumerInfo.NumAckPending is 0), then start the new version.
type Consumer struct {
	store   *idempotency.Store
	cons    jetstream.Consumer
	handler Handler
	opts    options

	mu       sync.Mutex
	failures map[delivered]*failures // the handler's failures per message, for WithMaxAttempts
}

// delivered names one stored message: its ID and its stream sequence.
type delivered struct {
	id  string
	seq uint64
}

type failures struct {
	n    int
	last time.Time
}

// New returns a Consumer that applies the messages of cons with h, recording
// their IDs in store. cons must be a pull consumer with
// [jetstream.AckExplicitPolicy]: every message is acknowledged on its own,
// after its own commit. Give it an AckWait longer than the slowest handler.
// New refuses a MaxDeliver: JetStream drops a message that ran out of
// deliveries, applied or not, and its effect is lost ([WithMaxAttempts] is
// the consumer's bound, which counts only the handler's failures). An
// invalid option is an error that names it.
//
// cons must be durable (ConsumerConfig.Durable), unless [WithScope] gives
// the scope: the default scope is named after the durable, and a consumer
// without one (an ephemeral, named or not) may have another name each time
// the program creates it, under which every message delivered again would
// be applied again. An ordered consumer acknowledges nothing, and is
// refused with or without a scope.
func New(store *idempotency.Store, cons jetstream.Consumer, h Handler, opts ...Option) (*Consumer, error) {
	if store == nil || cons == nil || h == nil {
		return nil, errors.New("natsconsumer: New: store, consumer and handler are required")
	}
	info := cons.CachedInfo()
	if info == nil {
		return nil, errors.New("natsconsumer: New: the consumer has no info (CachedInfo is nil): pass a consumer that jetstream.Stream.Consumer or CreateOrUpdateConsumer returned")
	}
	if info.Config.AckPolicy != jetstream.AckExplicitPolicy {
		return nil, fmt.Errorf("natsconsumer: consumer %s has ack policy %v, want explicit: each message must be acknowledged after its own commit",
			info.Name, info.Config.AckPolicy)
	}
	if info.Config.MaxDeliver > 0 {
		// JetStream counts deliveries, not the handler's failures: a
		// database outage or another delivery holding the ID uses them up
		// too, and the message is then dropped, applied or not, with no
		// outcome of the consumer's to say so.
		return nil, fmt.Errorf("natsconsumer: consumer %s has MaxDeliver %d: JetStream stops delivering a message after that many deliveries, applied or not, and its effect is lost: "+
			"leave MaxDeliver unlimited (natsconsumer.WithMaxAttempts bounds the handler's failures)", info.Name, info.Config.MaxDeliver)
	}
	o := evaluateOptions(opts)
	if err := o.validate(); err != nil {
		return nil, err
	}
	if o.scope == "" {
		// Only a durable's name is sure to come back when the program
		// starts again. A consumer without one may be named afresh on
		// every creation (nats.go names an unnamed one itself, and the
		// server reports that name as it does one the program chose):
		// under a new scope, every message it is delivered again would
		// be applied again.
		if info.Config.Durable == "" {
			return nil, fmt.Errorf("natsconsumer: consumer %s of stream %s is not durable: its name, the default scope, may be new each time it is created, "+
				"and every message delivered again after a restart would be applied again: "+
				"create it with ConsumerConfig.Durable, or give a scope that stays the same across restarts with natsconsumer.WithScope",
				info.Name, info.Stream)
		}
		o.scope = info.Stream + "/" + info.Config.Durable
	}
	// A scope the store refuses would fail every message, nacked forever.
	if err := idempotency.ValidateScope(o.scope); err != nil {
		return nil, fmt.Errorf("natsconsumer: scope %.60q: %w: give one the store takes with natsconsumer.WithScope", o.scope, err)
	}
	return &Consumer{store: store, cons: cons, handler: h, opts: o, failures: map[delivered]*failures{}}, nil
}

// Run processes messages one at a time until ctx is done, then returns ctx's
// error; it returns earlier with the error that ended the subscription, such
// as a closed connection or a deleted consumer. Run several Consumers, in
// one process or many, on the same durable consumer to process messages in
// parallel. A Consumer whose stream and durable were deleted and created
// again may Run again: every message names its own incarnation (see
// [Consumer]). A handler that panics does not end Run (see [PanicError]).
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
	m, meta, err := c.message(msg)
	if err == nil {
		d.ID, d.Sequence, d.NumDelivered = m.ID, meta.Sequence.Stream, meta.NumDelivered
		d.Outcome, d.Err = c.apply(ctx, m, msg, meta.Sequence.Stream)
	} else {
		d.Outcome, d.Err = Rejected, err
	}

	switch d.Outcome {
	case Applied, Duplicate:
		d.AckErr = msg.Ack()
	case InProgress:
		// At least the backoff's base: a store that suggests no delay
		// (idempotency.WithSuggestedRetryDelay(0)) would otherwise bring
		// the message straight back while the other delivery holds it.
		delay, _ := idempotency.RetryDelay(d.Err)
		d.AckErr = msg.NakWithDelay(max(delay, c.opts.backoffBase))
	case Rejected, GaveUp:
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

// Message is what the consumer processes msg as: its ID (see [Consumer]),
// the consumer's scope and TTL, and its body, which catches an ID reused
// for another message. Code that applies a message outside the consumer
// gives this Message to [idempotency.Store.ProcessMessage], so that the two
// never both apply it. The error is msg's when it is not a JetStream
// message (it has no metadata).
func (c *Consumer) Message(msg jetstream.Msg) (idempotency.Message, error) {
	m, _, err := c.message(msg)
	return m, err
}

func (c *Consumer) message(msg jetstream.Msg) (idempotency.Message, *jetstream.MsgMetadata, error) {
	meta, err := msg.Metadata()
	if err != nil {
		return idempotency.Message{}, nil, err
	}
	id := messageID(msg.Headers().Get(jetstream.MsgIDHeader), meta)
	return idempotency.Message{Scope: c.opts.scope, ID: id, Body: msg.Data(), TTL: c.opts.ttl, Redelivered: meta.NumDelivered > 1}, meta, nil
}

// placePrefix begins every ID the consumer makes: the places of messages
// without Nats-Msg-Id, and the recorded form of publisher IDs that begin
// with it.
const placePrefix = "seq:"

// messageID is the ID a message is recorded by (see [Consumer]): the
// publisher's, or the message's place in its stream's incarnation.
func messageID(published string, meta *jetstream.MsgMetadata) string {
	if published != "" {
		if strings.HasPrefix(published, placePrefix) && idempotency.ValidateKey(published) == nil {
			return hashedID("id", published)
		}
		return published // an invalid one is rejected as such
	}
	place := placePrefix + meta.Stream + "." + strconv.FormatUint(meta.Sequence.Stream, 10) + "." + strconv.FormatInt(meta.Timestamp.UnixNano(), 10)
	if idempotency.ValidateKey(place) != nil {
		return hashedID("place", place)
	}
	return place
}

// hashedID is "seq:.<kind>.<SHA-256 of s, in hex>": no place (a stream
// name is never empty and never holds a dot), and no other kind's.
func hashedID(kind, s string) string {
	sum := sha256.Sum256([]byte(s))
	return placePrefix + "." + kind + "." + hex.EncodeToString(sum[:])
}

// apply runs the handler for m at most once per ID and says what happened.
func (c *Consumer) apply(ctx context.Context, m idempotency.Message, msg jetstream.Msg, seq uint64) (Outcome, error) {
	outcome, err := c.processMessage(ctx, m, msg)
	which := delivered{m.ID, seq}
	switch idempotency.DispositionOf(outcome, err) {
	case idempotency.Ack:
		c.forget(which)
		if outcome == idempotency.OutcomeReplayed {
			return Duplicate, nil
		}
		return Applied, nil
	case idempotency.DeadLetter:
		// A final outcome (now or by an earlier delivery), or an ID that
		// can never be processed: redelivering cannot change it.
		c.forget(which)
		return Rejected, err
	}
	if errors.Is(err, idempotency.ErrInProgress) {
		return InProgress, err
	}
	if outcome == idempotency.OutcomeReleased && ctx.Err() == nil && !transient(err) {
		// The handler's own failure: the message is tried a bounded number
		// of times. The database being down or overloaded, a lock or
		// serialization conflict, the consumer stopping, or the ID held by
		// another delivery, are not the message's fault: those wait.
		if n := c.failed(which); n >= c.opts.maxAttempts {
			c.forget(which)
			return GaveUp, fmt.Errorf("gave up after %d attempts: %w", n, err)
		}
	}
	return Retried, err
}

// processMessage is ProcessMessage, with a panic of the handler turned
// into an error: the engine has rolled the message's transaction back and
// released its ID, and a message that panics every time is terminated
// after its attempts rather than ending Run (and, in a process that exits
// on it, crashing on every redelivery).
func (c *Consumer) processMessage(ctx context.Context, m idempotency.Message, msg jetstream.Msg) (outcome idempotency.Outcome, err error) {
	defer func() {
		if p := recover(); p != nil {
			outcome, err = idempotency.OutcomeReleased, &PanicError{Value: p, Stack: debug.Stack()}
		}
	}()
	return c.store.ProcessMessage(ctx, m, func(ctx context.Context, tx pgx.Tx) error { return c.handler(ctx, tx, m.ID, msg) })
}

// transient reports whether a released message's error is the database's
// (down, overloaded, a lock or statement timeout, a serialization failure
// or deadlock): trying again can help, and the message is not at fault.
func transient(err error) bool {
	return idempotency.IsDatabaseTrouble(err)
}

// failed counts one more failure of the handler on a message, and returns
// how many it had.
func (c *Consumer) failed(which delivered) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	now := time.Now()
	if len(c.failures) >= maxTracked {
		// Messages done by another consumer of the durable never come back
		// here: forget those not seen for long. Forgetting a count only
		// gives a message more attempts, never fewer.
		for k, f := range c.failures {
			if now.Sub(f.last) > c.opts.staleAfter() {
				delete(c.failures, k)
			}
		}
		if len(c.failures) >= maxTracked {
			// Still full: forget the half seen least recently. A message
			// that keeps failing here is seen again soon and keeps its
			// count (clearing them all would reset it, over and over,
			// and it would never reach its attempts).
			seen := make([]delivered, 0, len(c.failures))
			for k := range c.failures {
				seen = append(seen, k)
			}
			slices.SortFunc(seen, func(a, b delivered) int { return c.failures[a].last.Compare(c.failures[b].last) })
			for _, k := range seen[:len(seen)/2] {
				delete(c.failures, k)
			}
		}
	}
	f := c.failures[which]
	if f == nil {
		f = &failures{}
		c.failures[which] = f
	}
	f.n++
	f.last = now
	return f.n
}

func (c *Consumer) forget(which delivered) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.failures, which)
}

// maxTracked bounds the messages whose failures a consumer counts at once.
const maxTracked = 10000
