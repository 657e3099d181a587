package idempotencykafka

// WithCommitPerPartition commits each partition's last offset of a poll in
// a request of its own, as the consumer did before one commit per poll:
// the baseline of BenchmarkConsume.
func WithCommitPerPartition() Option { return func(o *options) { o.commitPerPartition = true } }

// DefaultDeadLetterTopic is the dead-letter topic of topic by default.
var DefaultDeadLetterTopic = defaultDeadLetterTopic
