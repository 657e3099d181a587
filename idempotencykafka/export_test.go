package idempotencykafka

import "time"

// WithCommitPerPartition commits each partition's last offset of a poll in
// a request of its own, as the consumer did before one commit per poll:
// the baseline of BenchmarkConsume.
func WithCommitPerPartition() Option { return func(o *options) { o.commitPerPartition = true } }

// DefaultDeadLetterTopic is the dead-letter topic of topic by default.
var DefaultDeadLetterTopic = defaultDeadLetterTopic

// WithClock makes now the clock that ages the topics' configs the consumer
// read: a test moves it past RetentionRefresh instead of waiting.
func WithClock(now func() time.Time) Option { return func(o *options) { o.now = now } }

// RetentionRefresh is how long configs read are used before they are read
// again.
const RetentionRefresh = retentionRefresh
