package idempotency

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"
)

// Message identifies one message of an at-least-once stream (NATS
// JetStream, Kafka, SQS, ...) for [Store.ProcessMessage].
type Message struct {
	// Scope isolates IDs, e.g. the stream and consumer name, or the Kafka
	// topic and consumer group.
	Scope string
	// ID is the message's unique ID: a producer-set ID such as NATS's
	// Nats-Msg-Id header, or a position such as "topic/partition/offset".
	// It must be a valid key (see [ValidateKey]).
	ID string
	// Body is fingerprinted: a redelivery with the same ID but a different
	// body is rejected with [ErrKeyReused] instead of being skipped as a
	// duplicate. A nil and an empty body are the same.
	Body []byte
	// TTL is how long the ID is remembered. Defaults to [DefaultTTL]; keep it
	// longer than the longest redelivery horizon of the stream.
	TTL time.Duration
}

// messageMethod is the Call.Method of every message, so a message ID can
// never replay a gRPC call's result or the other way round.
const messageMethod = "idempotency/message"

// ProcessMessage applies a message's effect at most once per (scope, ID):
// fn runs in a transaction that also records the ID, and both commit
// together. The outcome says what happened: [OutcomeExecuted] (fn ran and
// committed now), [OutcomeReplayed] (an earlier delivery was processed; fn
// did not run and the message only needs to be acknowledged), or why
// neither.
//
// The rules are those of [Store.Execute]: an error from fn rolls back
// everything and leaves the ID unprocessed, so a redelivery runs fn again;
// an error marked with [Final] (a poison message, say) is stored, and
// redeliveries return it again with [OutcomeReplayed]. [IsFinal] tells a
// final error (acknowledge or terminate the message) from any other error,
// after which the message must be redelivered: it was not processed, or
// (the database failed during COMMIT) it may have been, and the redelivery
// then finds it processed. A redelivery that arrives while the first
// delivery is still being processed waits for it up to the store's
// in-progress wait, then gets [ErrInProgress]: negatively acknowledge it
// with a delay. Acknowledge a message only after ProcessMessage returned
// without error, or with an error for which IsFinal is true.
func (s *Store) ProcessMessage(ctx context.Context, m Message, fn func(ctx context.Context, tx pgx.Tx) error) (Outcome, error) {
	if err := ValidateKey(m.ID); err != nil {
		return OutcomeRejected, keyError(err, "ID", "message ID")
	}
	call := Call{Scope: m.Scope, Key: m.ID, Method: messageMethod, Fingerprint: messageFingerprint(m.Body), TTL: m.TTL}
	res, err := s.Execute(ctx, call, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		return nil, fn(ctx, tx)
	})
	return res.Outcome, err
}
