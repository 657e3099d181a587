package idempotency

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/grpc/codes"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
)

// Call names one execution that must happen at most once.
type Call struct {
	// Scope isolates keys: the same key in two scopes names two calls. Use
	// the authenticated caller (tenant, client ID) so one caller can never
	// see another's results. It must be valid UTF-8 without NUL bytes.
	Scope string
	// Key is the idempotency key chosen by the client: 1 to 255 printable
	// ASCII characters (see [ValidateKey]).
	Key string
	// Method names the operation, e.g. the full gRPC method. A key first used
	// for one method is rejected for any other with [ErrKeyReused].
	Method string
	// Fingerprint identifies the request body (e.g. [Fingerprint]). The same
	// key with a different fingerprint is rejected with [ErrKeyReused].
	// Fingerprints made by this package carry the version of their
	// algorithm and a digest of the request's schema; two that differ in
	// those are not compared, so that a new release or a schema change
	// during a rolling deploy never turns a retry into ErrKeyReused. Other
	// byte strings are compared byte for byte.
	Fingerprint []byte
	// TTL is how long the key is kept, counted from when the call's result
	// was stored (a commit that takes a large part of the TTL has it counted
	// from the commit), so a retry right after the call always replays it.
	// Defaults to [DefaultTTL].
	TTL time.Duration
	// Retry says the call may have run before: the transport marks it as a
	// retry attempt (gRPC's grpc-previous-rpc-attempts, go-grpc-middleware's
	// x-retry-attempt, a redelivered message). The stored result is then
	// looked for first, in one read outside any transaction. A first attempt
	// skips that read and goes straight to the claim, which finds a stored
	// result too, at the cost of a transaction; so Retry only makes replays
	// cheaper, never changes an outcome.
	Retry bool
	// NewKey says the key was made for this call and never sent before: the
	// client interceptor's generated keys, on their first attempt. The claim
	// then skips looking for a stored result, which no such key can have. A
	// key that was in fact used before is still caught, by the key's
	// primary key, at the cost of running Func and rolling it back; so
	// NewKey too only changes the cost, never an outcome. Retry wins over
	// it.
	NewKey bool

	// responseType is the type the call's method declares for its
	// response, set by a transport that knows it: a replay decodes the
	// stored response with it. Nil: the type of the stored name in the
	// global registry.
	responseType protoreflect.MessageType
	// metadata, when set, is called once fn has succeeded or failed with a
	// final error: what it returns (the handler's headers and trailers, in
	// the transport's encoding) is stored with the result and handed back on
	// replay in Result.metadata. An error fails the call, nothing stored.
	metadata func() ([]byte, error)

	// trace, when set, is the transport's trace of the call; Execute
	// starts one of its own otherwise.
	trace *callTrace

	// finalCode decides whether a FailedPrecondition that the engine finds
	// at COMMIT (a deferred constraint of fn's writes) is final; the gRPC
	// interceptor sets its policy here. Nil: the key is released.
	finalCode func(codes.Code) bool
}

// Func is the work done at most once per key. tx is the call's transaction:
// everything written through it commits together with the stored result, or
// not at all. Func must not commit or roll back tx; the returned error does
// that (see [Final]). The same tx, and the call's key, are available to code
// deeper in the call through [TxFromContext] and [CallKeyFromContext].
type Func func(ctx context.Context, tx pgx.Tx) (proto.Message, error)

// Outcome says what [Store.Execute] did with a call.
type Outcome int

// Outcomes of [Store.Execute].
const (
	// OutcomeExecuted: the key was new; Func ran and its result committed,
	// a response or a [Final] error.
	OutcomeExecuted Outcome = iota + 1
	// OutcomeReplayed: the key was finished; its stored result was returned
	// and Func did not run.
	OutcomeReplayed
	// OutcomeReleased: Func ran and failed with an error not marked
	// [Final], or panicked; the transaction rolled back and the key is free
	// again.
	OutcomeReleased
	// OutcomeInProgress: another call held the key past the wait ([ErrInProgress]).
	OutcomeInProgress
	// OutcomeKeyReused: the key belongs to another request ([ErrKeyReused]).
	OutcomeKeyReused
	// OutcomeRejected: the call was malformed, e.g. an invalid or missing
	// key ([ErrInvalidKey], [ErrMissingKey]).
	OutcomeRejected
	// OutcomeUnavailable: the database failed ([ErrStoreUnavailable]).
	OutcomeUnavailable
)

var outcomeNames = [...]string{"unknown", "executed", "replayed", "released", "in_progress", "key_reused", "rejected", "unavailable"}

// String returns the outcome's name in snake_case, such as "replayed" or
// "key_reused", for logs and metric labels.
func (o Outcome) String() string {
	if o < 0 || int(o) >= len(outcomeNames) {
		return outcomeNames[0]
	}
	return outcomeNames[o]
}

// Result is what a call returned, fresh or replayed.
type Result struct {
	// Response is the message Func returned, or its stored copy on replay.
	// It is nil when the call ended in an error or Func returned nil.
	Response proto.Message
	// Outcome says whether Func ran, was replayed, or why neither.
	Outcome Outcome

	metadata []byte // the transport's stored metadata (Call.metadata)
}
