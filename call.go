package idempotency

import (
	"context"
	"time"

	"github.com/jackc/pgx/v5"
	"google.golang.org/protobuf/proto"
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
	// algorithm; those of proto requests ([Fingerprint]) hold a hash per
	// field and are compared on the fields both schemas know, so that a
	// field added or linked in during a rolling deploy neither turns a
	// retry into ErrKeyReused nor lets another request replay the old
	// response. Fingerprints of different versions are not compared. Other
	// byte strings are compared byte for byte.
	Fingerprint []byte
	// TTL is how long the key is kept, counted from when the call claimed
	// it (a call that takes a large part of the TTL has it counted from its
	// commit), so a retry right after the call always replays it. Defaults
	// to [DefaultTTL].
	TTL time.Duration
	// Retry says the call may have run before: the transport marks it as a
	// retry attempt (gRPC's grpc-previous-rpc-attempts, go-grpc-middleware's
	// x-retry-attempt, a redelivered message). The stored result is then
	// looked for first, in one read outside any transaction. It only makes
	// replays cheaper: a first attempt looks the key up too, under the
	// key's lock and before Func runs, so whatever a client marks, a key
	// with a stored result never runs Func again.
	Retry bool
	// Isolation is the isolation level of the call's transaction, for Func's
	// own statements. Empty means the store's ([WithIsolation]), whose
	// default is the database's (default_transaction_isolation). Every
	// guarantee holds at each level; see the package documentation for what
	// REPEATABLE READ and SERIALIZABLE cost.
	Isolation pgx.TxIsoLevel
}

// Func is the work done at most once per key. tx is the call's transaction:
// everything written through it commits together with the stored result, or
// not at all. Func must not commit or roll back tx; the returned error does
// that (see [Final]). The same tx, and the call's key, are available to code
// deeper in the call through [TxFromContext] and [IncomingKey].
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
	// OutcomeCanceled: the caller's context was cancelled or its deadline
	// passed before Func ran (while the key was claimed or waited for).
	// Nothing ran; a retry with the same key is safe.
	OutcomeCanceled
	// OutcomeMisconfigured: the store cannot work as configured: the key
	// table is missing or outdated, the role lacks privileges, the login is
	// refused. An operator must act; retrying does not help.
	OutcomeMisconfigured
)

var outcomeNames = [...]string{"unknown", "executed", "replayed", "released", "in_progress", "key_reused", "rejected", "unavailable", "canceled", "misconfigured"}

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
	//
	// A replay decodes the stored bytes with the type linked into the
	// binary under the stored type's name. When none is (a dynamic message,
	// or a process that does not link the method's generated code), it is
	// a message of that name whose fields are all unknown: proto.Marshal of
	// it gives back the stored bytes exactly, so it can be sent on, or
	// decoded into a type of the caller's choosing.
	Response proto.Message
	// Outcome says whether Func ran, was replayed, or why neither.
	Outcome Outcome
}
