package natsconsumer

import (
	"fmt"
	"time"

	"github.com/nats-io/nats.go/jetstream"

	"github.com/exactlyonce/idempotency"
)

// Option configures a [Consumer].
type Option func(*options)

type options struct {
	scope                   string
	ttl                     time.Duration
	backoffBase, backoffMax time.Duration
	maxAttempts             int
	onOutcome               func(Delivery)
	pull                    []jetstream.PullMessagesOpt
}

var defaultOptions = options{
	ttl:         idempotency.DefaultTTL,
	backoffBase: 100 * time.Millisecond,
	backoffMax:  10 * time.Second,
	maxAttempts: 10,
}

func evaluateOptions(opts []Option) options {
	o := defaultOptions
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

func (o *options) validate() error {
	switch {
	case o.backoffBase <= 0 || o.backoffMax < o.backoffBase:
		return fmt.Errorf("natsconsumer: WithRetryBackoff: need 0 < base <= max, got %v and %v", o.backoffBase, o.backoffMax)
	case o.maxAttempts < 1:
		return fmt.Errorf("natsconsumer: WithMaxAttempts: need at least 1, got %d", o.maxAttempts)
	case o.ttl < 0:
		return fmt.Errorf("natsconsumer: WithTTL: must not be negative, got %v", o.ttl)
	}
	return nil
}

// staleAfter is how long a message's count of failures is kept without a
// delivery of it: far longer than its redelivery delay.
func (o *options) staleAfter() time.Duration {
	return max(10*o.backoffMax, time.Hour)
}

// WithScope sets the scope of the consumer's message IDs in the key table.
// Consumers that apply the same effect must share a scope; consumers that
// apply different effects of the same stream (a billing and a mailing
// consumer, say) must not, or one would skip the other's messages. The
// scope names the effect, not the messages: consumers of one scope may
// filter different subjects. [New] refuses a scope the store would
// ([idempotency.ValidateScope]). Defaults to "<stream>/<durable name>".
//
// A consumer that is not durable has no default and needs this option
// ([New]), with a scope that is the same each time the program starts.
// Such a consumer, made again after a restart, is delivered the stream
// again from its DeliverPolicy (by default, the first message): keep the
// IDs ([WithTTL]) longer than the stream keeps its messages (MaxAge), or
// those older than the TTL are applied again.
func WithScope(scope string) Option {
	return func(o *options) { o.scope = scope }
}

// WithTTL sets how long a processed message ID is remembered. A delivery of
// the same ID after that applies the message again, so keep it longer than
// the stream's longest redelivery horizon and than any window in which a
// publisher may resend. Defaults to 24 hours ([idempotency.DefaultTTL]).
func WithTTL(ttl time.Duration) Option {
	return func(o *options) { o.ttl = ttl }
}

// WithRetryBackoff sets how long a message whose processing failed and
// rolled back waits before JetStream redelivers it: base after its first
// delivery, twice as long after each further one, at most max. The wait keeps
// a database outage from turning into a tight loop of redeliveries. Defaults
// to 100 milliseconds and 10 seconds; 0 < base <= max.
//
// base is also the least delay of every nack, that of a message whose ID
// another delivery holds included ([InProgress]), which waits for the
// delay the store suggests ([idempotency.WithSuggestedRetryDelay]) when
// it is longer. A store made with idempotency.WithSuggestedRetryDelay(0)
// suggests none: nacked at once, the message would come straight back,
// again and again while the other delivery holds its ID.
func WithRetryBackoff(base, max time.Duration) Option {
	return func(o *options) { o.backoffBase, o.backoffMax = base, max }
}

// WithMaxAttempts bounds how many deliveries of a message whose handler
// fails (an error that is not final, or a panic) are tried: the n-th such
// failure terminates the message ([GaveUp]; a final error terminates it
// at once, [Rejected]). Waiting for another delivery holding the ID does
// not count, and neither do the database's own failures (down,
// overloaded, a lock or statement timeout, a serialization failure) nor a
// delivery cut short by Run's ctx. As with [idempotency.DispositionOf], a
// message that may succeed later (a row its handler needs is still
// missing) is given up too once it has failed n times: give n, with the
// backoff, the time such a message needs, and watch [GaveUp] outcomes.
// n is at least 1. Defaults to 10, as the Kafka consumer's.
//
// The count is this Consumer's, in memory: a message tried by several
// Consumers on the durable, or by a Consumer started again, may be tried
// up to n times by each.
func WithMaxAttempts(n int) Option {
	return func(o *options) { o.maxAttempts = n }
}

// WithOutcomeHook calls f once per delivery, after the message was
// acknowledged, negatively acknowledged or terminated, e.g. to log or count
// outcomes. f runs on the consumer's goroutine and delays the next message;
// keep it fast. Defaults to none.
func WithOutcomeHook(f func(Delivery)) Option {
	return func(o *options) { o.onOutcome = f }
}

// WithPullOptions passes options to [jetstream.Consumer.Messages], such as
// [jetstream.PullMaxMessages]. Messages pulled ahead wait in a buffer while
// their AckWait runs; a large buffer in front of a slow handler causes
// redeliveries, which are harmless but wasted work. Defaults to none (the
// client's defaults).
func WithPullOptions(opts ...jetstream.PullMessagesOpt) Option {
	return func(o *options) { o.pull = opts }
}
