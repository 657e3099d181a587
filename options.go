package idempotency

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/codes"
)

// StoreOption configures a [Store].
type StoreOption func(*storeOptions)

type storeOptions struct {
	schema, table  string
	inProgressWait time.Duration
	retryDelay     time.Duration
	finishTimeout  time.Duration
}

var defaultStoreOptions = storeOptions{
	table:          DefaultTable,
	inProgressWait: 2 * time.Second,
	retryDelay:     500 * time.Millisecond,
	finishTimeout:  10 * time.Second,
}

func evaluateStoreOptions(opts []StoreOption) storeOptions {
	o := defaultStoreOptions
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

func (o storeOptions) validate() error {
	for name, v := range map[string]string{"schema": o.schema, "table": o.table} {
		if len(v) > 63 {
			return fmt.Errorf("idempotency: WithTable: %s name %q is longer than PostgreSQL's 63-byte identifier limit", name, v)
		}
		for i := 0; i < len(v); i++ {
			if v[i] == 0 {
				return fmt.Errorf("idempotency: WithTable: %s name contains a NUL byte", name)
			}
		}
	}
	switch {
	case o.table == "":
		return fmt.Errorf("idempotency: WithTable: table name is empty")
	case o.inProgressWait < time.Millisecond:
		return fmt.Errorf("idempotency: WithInProgressWait: must be at least 1ms, got %v", o.inProgressWait)
	case o.retryDelay < 0:
		return fmt.Errorf("idempotency: WithRetryDelay: must not be negative, got %v", o.retryDelay)
	case o.finishTimeout <= 0:
		return fmt.Errorf("idempotency: WithFinishTimeout: must be positive, got %v", o.finishTimeout)
	}
	return nil
}

// WithTable sets the key table. An empty schema means the connection's
// search_path decides. Names are quoted as identifiers, so any name is safe.
// Defaults to "idempotency_keys" with no schema.
func WithTable(schema, table string) StoreOption {
	return func(o *storeOptions) { o.schema, o.table = schema, table }
}

// WithInProgressWait bounds how long a duplicate waits for a call holding the
// same key before it gets [ErrInProgress] (it is PostgreSQL's lock_timeout
// during the claim, so it bounds each wait for one holder). The wait holds a
// database connection, so keep it short. Defaults to 2 seconds.
func WithInProgressWait(d time.Duration) StoreOption {
	return func(o *storeOptions) { o.inProgressWait = d }
}

// WithRetryDelay sets the delay suggested to clients in the RetryInfo detail
// of [ErrInProgress]. Defaults to 500 milliseconds.
func WithRetryDelay(d time.Duration) StoreOption {
	return func(o *storeOptions) { o.retryDelay = d }
}

// WithFinishTimeout bounds storing the result and committing once the call's
// work is done. It runs on a context detached from the caller's, so that a
// client that hung up still has its result stored. Defaults to 10 seconds.
func WithFinishTimeout(d time.Duration) StoreOption {
	return func(o *storeOptions) { o.finishTimeout = d }
}

// Option configures [UnaryServerInterceptor].
type Option func(*options)

type options struct {
	scope      func(context.Context) (string, error)
	requireKey bool
	ttl        time.Duration
	decided    map[codes.Code]bool
	onOutcome  func(ctx context.Context, method string, o Outcome, err error)
}

// DefaultDecidedCodes are the handler error codes stored and replayed by
// default: they mean the request was decided and repeating it gives the same
// answer. Every other code releases the key so a retry executes again.
var DefaultDecidedCodes = []codes.Code{
	codes.InvalidArgument, codes.NotFound, codes.AlreadyExists, codes.PermissionDenied,
	codes.FailedPrecondition, codes.OutOfRange, codes.Unimplemented, codes.Unauthenticated,
}

func evaluateOptions(opts []Option) options {
	o := options{
		scope:   func(context.Context) (string, error) { return "", nil },
		ttl:     DefaultTTL,
		decided: codeSet(DefaultDecidedCodes),
	}
	for _, opt := range opts {
		opt(&o)
	}
	return o
}

func codeSet(cs []codes.Code) map[codes.Code]bool {
	set := make(map[codes.Code]bool, len(cs))
	for _, c := range cs {
		set[c] = true
	}
	return set
}

// WithScope sets the function that names the caller's key scope, usually
// from the authenticated identity an earlier interceptor put in ctx. Keys
// are unique per scope, so two callers can use the same key without seeing
// each other's results. An error from the function rejects the call; return
// a status error (e.g. codes.Unauthenticated) to choose its code, other
// errors become codes.Internal.
//
// Defaults to one scope ("") shared by every caller. That is only safe when
// all callers trust each other: a caller who learns another caller's key
// and request body can read that call's stored response.
func WithScope(f func(ctx context.Context) (string, error)) Option {
	return func(o *options) { o.scope = f }
}

// WithKeyRequired makes calls without an idempotency key fail with
// codes.InvalidArgument ([ErrMissingKey]) instead of passing through.
// Defaults to false.
func WithKeyRequired(required bool) Option {
	return func(o *options) { o.requireKey = required }
}

// WithTTL sets how long finished keys are kept; a retry after that runs the
// call again. Defaults to 24 hours ([DefaultTTL]).
func WithTTL(ttl time.Duration) Option {
	return func(o *options) { o.ttl = ttl }
}

// WithDecidedCodes replaces the set of handler error codes that are stored
// and replayed like responses (their business writes still roll back).
// Errors with other codes release the key. Use with care: storing a
// transient code such as Unavailable makes the failure permanent for that
// key. Defaults to [DefaultDecidedCodes].
func WithDecidedCodes(cs ...codes.Code) Option {
	return func(o *options) { o.decided = codeSet(cs) }
}

// WithOutcomeHook calls f once per call that carried a key, after its
// outcome is known, e.g. to log or count executions and replays. err is the
// error returned to the client, if any. f runs on the request's goroutine;
// keep it fast. Defaults to none.
func WithOutcomeHook(f func(ctx context.Context, fullMethod string, o Outcome, err error)) Option {
	return func(o *options) { o.onOutcome = f }
}

// ClientOption configures [UnaryClientInterceptor] and
// [UnaryClientInterceptors].
type ClientOption func(*clientOptions)

type clientOptions struct {
	unknownMethodKeys bool
	retryMax          uint
	backoffBase       time.Duration
	backoffMax        time.Duration
	backoffJitter     float64
	perAttemptTimeout time.Duration
}

func evaluateClientOptions(opts []ClientOption) *clientOptions {
	o := &clientOptions{
		unknownMethodKeys: true,
		retryMax:          5,
		backoffBase:       50 * time.Millisecond,
		backoffMax:        2 * time.Second,
		backoffJitter:     0.2,
		perAttemptTimeout: 10 * time.Second,
	}
	for _, opt := range opts {
		opt(o)
	}
	if o.backoffBase <= 0 || o.backoffMax < o.backoffBase {
		panic(fmt.Sprintf("idempotency: WithRetryBackoff: need 0 < base <= max, got %v and %v", o.backoffBase, o.backoffMax))
	}
	return o
}

// WithKeysForUnknownMethods decides whether methods whose descriptor is not
// in the global protobuf registry (so their idempotency_level cannot be
// read) get a generated key. Defaults to true: a key is harmless on a safe
// method and essential on an unsafe one.
func WithKeysForUnknownMethods(generate bool) ClientOption {
	return func(o *clientOptions) { o.unknownMethodKeys = generate }
}

// WithRetryMax sets how many times [UnaryClientInterceptors] retries a call
// after its first attempt. Defaults to 5.
func WithRetryMax(n uint) ClientOption {
	return func(o *clientOptions) { o.retryMax = n }
}

// WithRetryBackoff sets the exponential backoff of [UnaryClientInterceptors]:
// the first retry waits about base, each later one twice as long, never more
// than max, each with ±20% jitter; a server's RetryInfo delay is a lower
// bound. Defaults to 50 milliseconds and 2 seconds.
func WithRetryBackoff(base, max time.Duration) ClientOption {
	return func(o *clientOptions) { o.backoffBase, o.backoffMax = base, max }
}

// WithPerAttemptTimeout bounds each attempt of [UnaryClientInterceptors]; an
// attempt that times out is retried with the same key while the call's own
// deadline allows. 0 disables it. Defaults to 10 seconds.
func WithPerAttemptTimeout(d time.Duration) ClientOption {
	return func(o *clientOptions) { o.perAttemptTimeout = d }
}
