package idempotencykafka

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/exactlyonce/idempotency"
)

// Option configures a [Consumer]. An invalid value makes [New] return an
// error that names the option.
type Option func(*options)

type options struct {
	scope                    func(topic string) string
	idHeader                 string
	deadLetterTopic          func(topic string) string
	maxAttempts, commitEvery int
	backoffBase, backoffMax  time.Duration
	commitTimeout, ttl       time.Duration
	ttlSet                   bool // WithTTL was given
	retryable                func(error) bool
	commitPerPartition       bool // tests: each partition's last offset of a poll committed on its own
	maxPollRecords           int
	onError                  func(error)
	onOutcome                func(*kgo.Record, idempotency.Outcome, error)
	onDeadLetter             func(*kgo.Record, string)
	now                      func() time.Time // tests: the clock that ages the configs read (see retentionRefresh)
}

// DefaultIDHeader is the record header read for a producer-set message ID.
const DefaultIDHeader = "message-id"

func defaultOptions(group string) options {
	return options{
		scope:           func(topic string) string { return "kafka/" + group + "/" + topic },
		idHeader:        DefaultIDHeader,
		deadLetterTopic: defaultDeadLetterTopic,
		maxAttempts:     10,
		commitEvery:     100,
		maxPollRecords:  10000,
		backoffBase:     50 * time.Millisecond,
		backoffMax:      5 * time.Second,
		commitTimeout:   10 * time.Second,
		retryable:       func(error) bool { return false },
		onError:         func(error) {},
		onOutcome:       func(*kgo.Record, idempotency.Outcome, error) {},
		onDeadLetter:    func(*kgo.Record, string) {},
		now:             time.Now,
	}
}

func (o *options) validate() error {
	switch {
	case o.scope == nil || o.scope("") == "":
		return fmt.Errorf("idempotencykafka: WithScope: the scope must not be empty")
	case o.idHeader == "":
		return fmt.Errorf("idempotencykafka: WithIDHeader: the header name must not be empty")
	case o.deadLetterTopic == nil:
		return fmt.Errorf("idempotencykafka: WithDeadLetterTopic: the function must not be nil")
	case o.maxAttempts < 1:
		return fmt.Errorf("idempotencykafka: WithMaxAttempts: need at least 1, got %d", o.maxAttempts)
	case o.maxPollRecords < 1:
		return fmt.Errorf("idempotencykafka: WithMaxPollRecords: need at least 1, got %d", o.maxPollRecords)
	case o.commitEvery < 1:
		return fmt.Errorf("idempotencykafka: WithCommitEvery: need at least 1, got %d", o.commitEvery)
	case o.backoffBase <= 0 || o.backoffMax < o.backoffBase:
		return fmt.Errorf("idempotencykafka: WithRetryBackoff: need 0 < base <= max, got %v and %v", o.backoffBase, o.backoffMax)
	case o.retryable == nil:
		return fmt.Errorf("idempotencykafka: WithRetryable: the function must not be nil")
	case o.ttl < 0:
		return fmt.Errorf("idempotencykafka: WithTTL: must not be negative, got %v", o.ttl)
	}
	return nil
}

// backoff is the wait before try wait+1 of a record: base doubled per try,
// capped at the maximum, with jitter, and never less than the delay err
// suggests (an ID held by another member).
func (o *options) backoff(wait uint, err error) time.Duration {
	d := o.backoffBase << min(wait, 16)
	if d > o.backoffMax || d <= 0 {
		d = o.backoffMax
	}
	d = jitter(d)
	if s, ok := idempotency.RetryDelay(err); ok {
		d = max(d, s)
	}
	return d
}

// defaultDeadLetterTopic is topic followed by ".dead-letter", or, when
// that is longer than a topic name may be, the topic's name cut short and
// a hash of it: two long topics never share a dead-letter topic.
func defaultDeadLetterTopic(topic string) string {
	const suffix = ".dead-letter"
	if len(topic)+len(suffix) <= maxTopicLen {
		return topic + suffix
	}
	sum := sha256.Sum256([]byte(topic))
	short := "-" + hex.EncodeToString(sum[:8]) + suffix
	return topic[:maxTopicLen-len(short)] + short
}

// WithScope sets the scope of the message IDs, one for every topic the
// consumer reads. Defaults to "kafka/<group>/<topic>": two groups on one
// topic apply each record once each, and producer-set IDs of two topics
// never meet.
func WithScope(scope string) Option {
	return func(o *options) { o.scope = func(string) string { return scope } }
}

// WithIDHeader names the record header that carries a producer-set message
// ID, which also catches a record produced twice. Records without it are
// identified by their position, topic/partition/offset, which catches a
// record delivered twice. Defaults to [DefaultIDHeader].
func WithIDHeader(name string) Option { return func(o *options) { o.idHeader = name } }

// WithDeadLetterTopic sets the topic a record that can never succeed is
// produced to, from the record's own topic. Defaults to the topic's name
// followed by ".dead-letter" (a name too long for that is cut short and
// followed by a hash of it and ".dead-letter"). New refuses a function
// that gives an invalid topic name for a topic the client names; one that
// gives an invalid name for a topic met later gives the record up without
// a dead letter, reported to WithErrorHandler (and stored as given up).
func WithDeadLetterTopic(f func(topic string) string) Option {
	return func(o *options) { o.deadLetterTopic = f }
}

// WithMaxAttempts bounds how many times a record whose handler fails is
// tried before it is given up: stored as given up with its ID, so that no
// redelivery applies it after the records behind it, and dead-lettered (a
// final error dead-letters it at once). [Consumer.Redrive] applies it
// again once its cause is fixed. Waiting for the database or for another
// member holding the ID does not count, and neither do the database's own
// failures (down, overloaded, a lock or statement timeout, a serialization
// failure) nor the errors [WithRetryable] names. Defaults to 10.
func WithMaxAttempts(n int) Option { return func(o *options) { o.maxAttempts = n } }

// WithRetryable says which of the handler's errors are not the record's
// fault: a downstream service that is down, a quota used up. A record
// whose handler fails with one waits, tried again with backoff, for as
// long as it lasts, and the try does not count against [WithMaxAttempts];
// the partition waits with it. Every other error counts, so that a record
// that fails for its own reasons is given up. The database's own trouble
// (an outage, a lock or statement timeout, a serialization failure) always
// waits, whatever f says: it is recognised by the engine, not by f. err is
// the error ProcessMessage returned, which wraps the handler's. By default
// no handler error is retryable.
func WithRetryable(f func(err error) bool) Option { return func(o *options) { o.retryable = f } }

// WithCommitEvery sets how many records of a partition are applied between
// two offset commits (and a partition's last record of a poll is always
// committed). Fewer commits cost Kafka less; a consumer that dies
// redelivers, and replays, up to that many records. Defaults to 100.
func WithCommitEvery(n int) Option { return func(o *options) { o.commitEvery = n } }

// WithMaxPollRecords bounds how many records Run takes in one poll (all
// partitions together). A poll's records are done before the next
// rebalance is allowed (with kgo.BlockRebalanceOnPoll), so the bound is
// what a rebalance may wait for, and what the consumer holds in memory:
// keep a poll's work well within the group's rebalance timeout. franz-go
// fills a poll partition by partition, so a bound below a partition's
// backlog leaves the other partitions for later polls and applies fewer
// partitions at once (BENCHMARKS.md: 500 against 10,000). Defaults to
// 10,000.
func WithMaxPollRecords(n int) Option { return func(o *options) { o.maxPollRecords = n } }

// WithRetryBackoff sets the wait between tries of a record: base, doubled
// per try up to max, with ±20% jitter. Defaults to 50 milliseconds and 5
// seconds.
func WithRetryBackoff(base, max time.Duration) Option {
	return func(o *options) { o.backoffBase, o.backoffMax = base, max }
}

// WithTTL sets how long message IDs are remembered. A record read again
// after its ID was forgotten is applied again, and a group re-reads its
// topics from the start when its offsets go (expired after the broker's
// offsets.retention.minutes, reset, the group recreated): so the TTL must
// outlast each topic's retention.ms and segment.ms plus the offsets' retention (a record
// stamped ahead of now keeps its ID that much longer), and a
// shorter one is refused (see [Consumer.CheckRetention]): at the start,
// and when a topic's retention is raised past it while the consumer runs
// (Run returns the refusal; leave room for raises). Without WithTTL
// each topic's IDs are kept for that sum, read from the brokers; a topic
// that keeps its records forever (retention.ms -1, or compacted without
// delete) needs an explicit TTL, the operator's decision. A topic deleted
// and created again within the TTL starts its offsets over: records
// identified by their position would be taken for the old ones (replayed,
// or dead-lettered as reused IDs), so give them producer-set IDs or the
// consumer a new scope.
func WithTTL(ttl time.Duration) Option { return func(o *options) { o.ttl, o.ttlSet = ttl, true } }

// The handlers of WithErrorHandler, WithOutcomeHandler and
// WithDeadLetterHandler are called from the goroutines that apply the
// partitions, possibly at once: they must be safe for concurrent use.

// WithErrorHandler is told of errors Run goes on after: failed fetches,
// offset commits and dead-letter produces (each retried).
func WithErrorHandler(f func(error)) Option { return func(o *options) { o.onError = f } }

// WithOutcomeHandler is told of every try of a record: the outcome and
// error of its idempotency.Store.ProcessMessage.
func WithOutcomeHandler(f func(r *kgo.Record, outcome idempotency.Outcome, err error)) Option {
	return func(o *options) { o.onOutcome = f }
}

// WithDeadLetterHandler is told of every record produced to the
// dead-letter topic, with its cause.
func WithDeadLetterHandler(f func(r *kgo.Record, cause string)) Option {
	return func(o *options) { o.onDeadLetter = f }
}
