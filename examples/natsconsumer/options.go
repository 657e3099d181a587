package natsconsumer

import (
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
	onOutcome               func(Delivery)
	pull                    []jetstream.PullMessagesOpt
}

var defaultOptions = options{
	ttl:         idempotency.DefaultTTL,
	backoffBase: 100 * time.Millisecond,
	backoffMax:  10 * time.Second,
}

func evaluateOptions(opts []Option) options {
	o := defaultOptions
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

// WithScope sets the scope of the consumer's message IDs in the key table.
// Consumers that apply the same effect must share a scope; consumers that
// apply different effects of the same stream (a billing and a mailing
// consumer, say) must not, or one would skip the other's messages.
// Defaults to "<stream>/<consumer name>".
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
// to 100 milliseconds and 10 seconds.
func WithRetryBackoff(base, max time.Duration) Option {
	return func(o *options) { o.backoffBase, o.backoffMax = base, max }
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
