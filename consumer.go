package idempotency

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	grpcstatus "google.golang.org/grpc/status"
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
	// Redelivered says the broker delivered the message before (NATS's
	// NumDelivered > 1, a Kafka record read again after a rebalance): the
	// stored outcome is looked for first, in one read outside any
	// transaction. It only makes duplicates cheaper; a duplicate not marked
	// is still found.
	Redelivered bool
}

// messageMethod is the Call.Method of every message, so a message ID can
// never replay a gRPC call's result or the other way round.
const messageMethod = "idempotency/message"

// ProcessMessage applies a message's effect at most once per (scope, ID):
// fn runs in a transaction that also records the ID, and both commit
// together. The outcome says what happened: [OutcomeExecuted] (fn ran and
// committed now), [OutcomeReplayed] (an earlier delivery was processed; fn
// did not run), or why neither. [DispositionOf] turns outcome and error
// into what the consumer must do with the message: acknowledge it,
// redeliver it, or dead-letter it.
//
// The rules are those of [Store.Execute]: an error from fn rolls back
// everything and leaves the ID unprocessed, so a redelivery runs fn again;
// an error marked with [Final] (a poison message, say) is stored, and
// redeliveries return it again with [OutcomeReplayed]. So is a deferred
// constraint of fn's writes that fails at COMMIT on the message's own data
// (a unique, check or exclusion constraint: FailedPrecondition), which
// would fail on every redelivery. What the COMMIT refuses for a reason
// that can pass is fn's failure, as fn's own error would be: nothing is
// stored and the message is redelivered ([OutcomeReleased], [Redeliver]).
// That is a deferred foreign key whose referenced row is not there (yet):
// FailedPrecondition, not final, as an immediate foreign key would fail
// fn's statement; and an error raised at COMMIT by a deferred trigger of
// fn's tables (RAISE EXCEPTION, or a failed statement of its function),
// whose error names the SQLSTATE and the message and unwraps to the
// *pgconn.PgError. A consumer that bounds a message's attempts counts
// both as the handler's failures. Message IDs live in a namespace of their
// own in the key table: no gRPC or HTTP client's key can ever take one. A redelivery that
// arrives while the first delivery is still being processed waits for it
// up to the store's in-progress wait, then gets [ErrInProgress].
func (s *Store) ProcessMessage(ctx context.Context, m Message, fn func(ctx context.Context, tx pgx.Tx) error) (outcome Outcome, err error) {
	// A deferred constraint of the message's own data that fails at COMMIT
	// would fail every redelivery too: it is final, stored, and the
	// message dead-lettered (a missing referenced row is not; see
	// commitFailed).
	tp := &transport{kind: TransportMessage, namespace: namespaceMessage, finalCode: func(c codes.Code) bool { return c == codes.FailedPrecondition }}
	if s.opts.tracer != nil {
		// The scope apart from the method: it may name a tenant, one of
		// thousands, and a method is what metrics are labelled with.
		ctx, tp.trace = s.startTrace(ctx, TraceCallStartData{Transport: TransportMessage, Scope: m.Scope, Key: m.ID})
		defer tp.trace.endDeferred(ctx, &outcome, &err)
	}
	if err := ValidateKey(m.ID); err != nil {
		return OutcomeRejected, keyError(err, "ID", "message ID")
	}
	if err := validateText("Message.Scope", m.Scope, MaxScopeLen); err != nil {
		// The consumer's setting, not the message's fault: fix it, and the
		// message comes back.
		return OutcomeMisconfigured, grpcstatus.Errorf(codes.Internal, "%s (the consumer's configuration; the message is good)", grpcstatus.Convert(err).Message())
	}
	call := Call{Scope: m.Scope, Key: m.ID, Method: messageMethod, Fingerprint: messageFingerprint(m.Body), TTL: m.TTL, Retry: m.Redelivered}
	res, err := s.execute(ctx, call, tp, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		return nil, fn(ctx, tx)
	})
	return res.Outcome, err
}

// Disposition is what a consumer does with a message once
// [Store.ProcessMessage] returned.
type Disposition int

const (
	// Ack: the message's effect is committed, by this delivery or an
	// earlier one. Acknowledge it (commit its offset).
	Ack Disposition = iota + 1
	// Redeliver: nothing was committed, the outcome is unknown (the
	// database failed during COMMIT), or another delivery of the same ID is
	// being processed. Let the message come back after a delay (at least
	// [RetryDelay] of the error when it has one); a redelivery finds it
	// processed if it was.
	Redeliver
	// DeadLetter: the message can never be processed: its error is final (a
	// poison message; stored, so every redelivery gets it again), its ID is
	// invalid, or its ID was first used with another body. Redelivering it
	// would loop forever: move it to a dead-letter queue or terminate it,
	// and acknowledge it.
	DeadLetter
)

var dispositionNames = [...]string{"unknown", "ack", "redeliver", "dead_letter"}

// String returns "ack", "redeliver" or "dead_letter".
func (d Disposition) String() string {
	if d < 0 || int(d) >= len(dispositionNames) {
		return dispositionNames[0]
	}
	return dispositionNames[d]
}

// DispositionOf says what to do with a message after [Store.ProcessMessage]
// returned outcome and err. A database that is down or misconfigured is
// Redeliver, never DeadLetter: the message is good, and an operator can
// fix the rest.
func DispositionOf(outcome Outcome, err error) Disposition {
	switch {
	case err == nil:
		return Ack
	case IsFinal(err), outcome == OutcomeKeyReused, outcome == OutcomeRejected:
		return DeadLetter
	}
	return Redeliver
}
