package idempotency

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/google/uuid"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// WithOutgoingKey returns a context whose outgoing calls use key as their
// idempotency key instead of a generated one; it is the client side's
// choice. Use it when the key comes from outside the call, such as an order
// ID or a key the application stored to retry a call later.
// [UnaryClientInterceptor] rejects an invalid key before sending.
//
// The key of the call a server is running is read with
// [IncomingKey] instead; the two never see each other's key.
//
// The key also goes into the context's outgoing metadata, replacing the one
// an earlier WithOutgoingKey put there, so that a call no client
// interceptor of this package sees (a streaming call) still carries it, and
// [StreamServerInterceptor] refuses it rather than run it unprotected.
// Beside a different key set in the metadata by other means
// (metadata.AppendToOutgoingContext), before or after it, neither wins: the
// call fails with codes.InvalidArgument before anything is sent, as the two
// may name two operations.
func WithOutgoingKey(ctx context.Context, key string) context.Context {
	md, _ := metadata.FromOutgoingContext(ctx)
	vals := md.Get(MetadataKey)
	prev, hadPrev := ctx.Value(outgoingKey{}).(string)
	switch {
	case len(vals) == 1 && vals[0] == key:
	case hadPrev && len(vals) == 1 && vals[0] == prev:
		md = md.Copy()
		md.Set(MetadataKey, key)
		ctx = metadata.NewOutgoingContext(ctx, md)
	default: // beside a key set otherwise, it makes two: refused when sent
		ctx = metadata.AppendToOutgoingContext(ctx, MetadataKey, key)
	}
	return context.WithValue(ctx, outgoingKey{}, key)
}

type outgoingKey struct{}

// CaptureKey is a call option that stores the idempotency key a call used in
// *dst, so the application can log it or retry the same logical call later
// with [WithOutgoingKey]: the key in the metadata, or, for a method whose
// request carries its key (the option's key_field), that field's value;
// empty when the call carried none.
func CaptureKey(dst *string) grpc.CallOption { return captureKey{dst: dst} }

type captureKey struct {
	grpc.EmptyCallOption
	dst *string
}

// UnaryClientInterceptor returns a client interceptor that gives every
// logical call one idempotency key, in the outgoing metadata under
// [MetadataKey], and retries the call under that key, with
// go-grpc-middleware's retry interceptor inside it:
//
//	conn, err := grpc.NewClient(target,
//		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor()))
//
// The key is, in order: the "idempotency-key" already in the outgoing
// metadata or the key set with [WithOutgoingKey] (both at once, naming
// different keys, fail with codes.InvalidArgument before anything is
// sent, saying to set the key one way only), when ctx is inside a
// running call (a handler calling another service: a re-run of the handler
// sends the same key) the key of the effect [WithEffect] names, or outside
// one a new UUIDv7. Inside a running call, a call with neither a key nor a
// name is refused with [ErrUnnamedEffect], and a call made with the
// context of a call that has ended with [ErrCallEnded]: nothing is sent.
// No key is generated, nor a name needed, for methods whose .proto says
// they need none: the
// (idempotency.v1.method) option with MODE_DISABLED or a key_field (the
// request carries its key), or idempotency_level NO_SIDE_EFFECTS or
// IDEMPOTENT without an explicit mode. Methods whose descriptor is not
// linked in get a key unless [WithKeysForUnknownMethods](false). A key in
// the binary metadata "idempotency-key-bin" is refused with
// codes.InvalidArgument before anything is sent, as the server would
// refuse it: it is another header to gRPC, not the key.
//
// The retries' defaults, each changed by the option named:
//
//   - it retries Unavailable, Aborted (the key is in progress on the
//     server, or the database aborted the transaction) and
//     ResourceExhausted, and an attempt cut by [WithPerAttemptTimeout];
//   - for up to 30 seconds from the call's start ([WithRetryBudget]),
//     longer than a typical database failover, and never past the call's
//     deadline, with no limit on the number of attempts ([WithMaxAttempts]);
//   - waiting 50 milliseconds before the first retry, twice as long before
//     each later one, at most 2 seconds, each ±20%, and never less than
//     the delay of the server's RetryInfo ([WithRetryBackoff]);
//   - with no timeout per attempt ([WithPerAttemptTimeout]): the call's
//     own deadline bounds each attempt, so a slow handler is never cut
//     and run again.
//
// When it stops retrying because the budget, the call's deadline or
// WithMaxAttempts leaves no room for another attempt, the error is the
// last attempt's (its code and details), its message saying how many
// attempts were made and which limit stopped them.
//
// Calls that carry no key in the metadata are not retried, unless protobuf
// marks the method NO_SIDE_EFFECTS or IDEMPOTENT or its request carries the
// key (key_field): nothing would deduplicate them. Those are retried the
// same way, with the same codes, backoff and RetryInfo.
//
// With [WithMaxAttempts](1) it is the key alone, for a client with retries
// of its own. Those must run below it, so that they reuse the key: after
// it in the chain, or gRPC's own retry policy, which runs below every
// interceptor. A call that arrives as a retry attempt of
// go-grpc-middleware's retry interceptor (or of v1's, whose marker is
// x-retry-attempty) without a key, from a retry interceptor chained
// before this one, is refused with [ErrChainOrder] instead of getting a
// fresh key, which would make the retry a second, different operation. A
// retry loop of another kind above this interceptor marks nothing, so
// each of its attempts is a new call with a new key: such a loop must
// carry the key itself ([CaptureKey] on the first attempt,
// [WithOutgoingKey] on the others) or run below this interceptor.
//
// It panics if an option is invalid.
func UnaryClientInterceptor(opts ...ClientOption) grpc.UnaryClientInterceptor {
	o := evaluateClientOptions(opts)
	if o.maxAttempts == 1 {
		return o.interceptor(nil)
	}
	// retry.WithMax counts attempts, the first included, as WithMaxAttempts
	// does; without a count the budget ends the retries (retryState).
	attempts := ^uint(0)
	if o.maxAttempts > 0 {
		attempts = uint(o.maxAttempts)
	}
	return o.interceptor(retry.UnaryClientInterceptor(retry.WithMax(attempts)))
}

// ClientOption configures [UnaryClientInterceptor]. An invalid value
// makes it panic, naming the option.
type ClientOption func(*clientOptions)

type clientOptions struct {
	unknownMethodKeys bool
	maxAttempts       int // 0: no limit, the budget ends the retries
	retryBudget       time.Duration
	backoffBase       time.Duration
	backoffMax        time.Duration
	perAttemptTimeout time.Duration // 0: none, the call's deadline bounds an attempt
	recordEffects     bool
	err               error // the first invalid option
}

// backoffJitter is the relative jitter of every retry delay: ±20%.
const backoffJitter = 0.2

func defaultClientOptions() clientOptions {
	return clientOptions{
		unknownMethodKeys: true,
		retryBudget:       30 * time.Second,
		backoffBase:       50 * time.Millisecond,
		backoffMax:        2 * time.Second,
	}
}

func evaluateClientOptions(opts []ClientOption) *clientOptions {
	o := defaultClientOptions()
	for _, opt := range opts {
		opt(&o)
	}
	if err := o.validate(); err != nil {
		panic(err.Error())
	}
	return &o
}

func (o *clientOptions) validate() error {
	switch {
	case o.err != nil:
		return o.err
	case o.retryBudget <= 0:
		return fmt.Errorf("idempotency: WithRetryBudget: must be positive, got %v", o.retryBudget)
	case o.backoffBase <= 0 || o.backoffMax < o.backoffBase:
		return fmt.Errorf("idempotency: WithRetryBackoff: need 0 < base <= max, got %v and %v", o.backoffBase, o.backoffMax)
	case o.perAttemptTimeout < 0:
		return fmt.Errorf("idempotency: WithPerAttemptTimeout: must not be negative, got %v", o.perAttemptTimeout)
	}
	return nil
}

// WithKeysForUnknownMethods decides whether methods whose descriptor is not
// in the global protobuf registry (so their idempotency_level cannot be
// read) get a generated key. Defaults to true: a key is harmless on a safe
// method and essential on an unsafe one.
func WithKeysForUnknownMethods(generate bool) ClientOption {
	return func(o *clientOptions) { o.unknownMethodKeys = generate }
}

// WithMaxAttempts bounds how many attempts [UnaryClientInterceptor] makes
// of one call, the first included: 1 turns retries off (the interceptor is
// then the key alone, for a client whose retries run below it), 3 is the
// first attempt and two retries. It counts as go-grpc-middleware's
// retry.WithMax does (its loop makes n attempts, whatever its doc's word
// "retries" suggests), as gRPC's service config maxAttempts and
// [HTTPClient].MaxAttempts do. n must be at least 1. Defaults to no limit:
// the retry budget ([WithRetryBudget]) and the call's deadline end the
// retries, so that the count of a fast-failing outage does not run out
// before the outage does.
func WithMaxAttempts(n int) ClientOption {
	return func(o *clientOptions) {
		if n < 1 {
			o.err = fmt.Errorf("idempotency: WithMaxAttempts: need at least 1 (the first attempt counts, 1 turns retries off), got %d", n)
			return
		}
		o.maxAttempts = n
	}
}

// WithRetryBudget bounds how long [UnaryClientInterceptor] keeps retrying
// a call: a retry whose wait would end more than d after the call started
// is not made, and the call returns the last attempt's error. It bounds
// the retries, not the call: an attempt still running when d ends runs on
// until the call's deadline (set one with context.WithTimeout to bound the
// call). Must be positive. Defaults to 30 seconds, longer than a typical
// database failover, so that a call caught in one succeeds once it is over;
// lower it when callers would rather fail fast.
func WithRetryBudget(d time.Duration) ClientOption {
	return func(o *clientOptions) { o.retryBudget = d }
}

// WithRetryBackoff sets the exponential backoff of [UnaryClientInterceptor]:
// the first retry waits about base, each later one twice as long, never more
// than max, each with ±20% jitter; a server's RetryInfo delay is a lower
// bound. Needs 0 < base <= max. Defaults to 50 milliseconds and 2 seconds.
func WithRetryBackoff(base, max time.Duration) ClientOption {
	return func(o *clientOptions) { o.backoffBase, o.backoffMax = base, max }
}

// WithPerAttemptTimeout bounds each attempt of the calls
// [UnaryClientInterceptor] retries (with [WithMaxAttempts](1), their one
// attempt). An attempt still running after d is
// cut with [ErrAttemptTimeout] (DeadlineExceeded, naming this option) and
// retried with the same key, within the budget. 0 turns it off; negative
// is invalid. Defaults to 0: the call's own deadline bounds every attempt.
//
// Use with care: the server rolls a cut call back, and the retry runs its
// handler again from the start, with the calls the handler makes to other
// systems (those not deduplicated by a derived key are made twice). A
// handler that takes longer than d never succeeds. Set it only above the
// slowest handler's time, to get past a server that hangs; gRPC's
// keepalive (grpc.WithKeepaliveParams) finds a dead connection without
// cutting slow handlers.
func WithPerAttemptTimeout(d time.Duration) ClientOption {
	return func(o *clientOptions) { o.perAttemptTimeout = d }
}

// interceptor is the key interceptor, with retries, the retry interceptor
// to run inside it, or nil for the key alone.
// WithRecordedEffects makes a call inside a running call whose effect is
// named ([WithEffect]) and whose key is derived from that name a recorded
// step (see [Step]): its reply, or an error with one of
// [DefaultFinalCodes], is recorded under the running call and the name,
// and a re-run of the running call gets it back without sending the call
// again, even when the server called has forgotten the key. Calls with a
// key of their own, and calls outside a running call, are sent as without
// it. Each recorded call costs a lookup and a commit on another connection
// of the running call's store. Defaults to off.
func WithRecordedEffects() ClientOption {
	return func(o *clientOptions) { o.recordEffects = true }
}

func (o *clientOptions) interceptor(retries grpc.UnaryClientInterceptor) grpc.UnaryClientInterceptor {
	send := o.send(retries)
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		if o.recordEffects {
			md, _ := metadata.FromOutgoingContext(ctx)
			t, name, derived := recordedEffect(ctx)
			if m, ok := reply.(proto.Message); ok && derived && len(md.Get(MetadataKey)) == 0 {
				return stepInto(ctx, t, name, m, func(ctx context.Context, _ string) error {
					err := send(ctx, method, req, reply, cc, invoker, opts...)
					if err != nil && defaultFinal[status.Code(err)] {
						err = Final(err)
					}
					return err
				})
			}
		}
		return send(ctx, method, req, reply, cc, invoker, opts...)
	}
}

// defaultFinal are DefaultFinalCodes, as a set.
var defaultFinal = codeSet(DefaultFinalCodes())

// send is the interceptor without recorded effects.
func (o *clientOptions) send(retries grpc.UnaryClientInterceptor) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		pol := policyForRequest(method, req)
		md, _ := metadata.FromOutgoingContext(ctx)
		key, inMetadata, err := o.keyWith(ctx, method, pol, md)
		if err != nil {
			return err
		}
		for _, opt := range opts {
			if c, ok := opt.(captureKey); ok && c.dst != nil {
				*c.dst = key
				if key == "" {
					*c.dst = pol.requestKey(req)
				}
			}
		}
		if key != "" && !inMetadata {
			ctx = metadata.AppendToOutgoingContext(ctx, MetadataKey, key)
		}
		var rs *retryState
		switch {
		case key == "" && !pol.retrySafeWithoutKey():
			// Nothing would deduplicate a retry of this call.
			if retries != nil {
				opts = append(opts, retry.Disable())
			}
		default:
			// A key in the metadata or in the request (key_field), or a
			// method safe to repeat: retried alike, with the codes,
			// backoff, RetryInfo and budget of the options. Per-call retry
			// options come first so the caller's own retry call options
			// still override them.
			rs = o.newRetryState(ctx)
			ctx = context.WithValue(ctx, retryStateKey{}, rs)
			if retries != nil {
				opts = append(rs.callOptions(), opts...)
			}
		}
		if o.perAttemptTimeout > 0 {
			invoker = o.boundAttempts(invoker)
		}
		if retries != nil {
			err = retries(ctx, method, req, reply, cc, invoker, opts...)
		} else {
			err = invoker(ctx, method, req, reply, cc, opts...)
		}
		if rs != nil {
			err = rs.explain(err)
		}
		return err
	}
}

// requestKey is the key a request carries in its method's key_field, ""
// when the method has none or the request is not a proto message.
func (pol methodPolicy) requestKey(req any) string {
	m, ok := req.(proto.Message)
	if pol.keyField == nil || !ok {
		return ""
	}
	return pol.keyFromField(m)
}

// keyWith picks the key of a call of a method with policy pol; "" means
// the call needs none.
func (o *clientOptions) keyWith(ctx context.Context, method string, pol methodPolicy, md metadata.MD) (key string, inMetadata bool, err error) {
	if pol.known && pol.mode == modePassThrough && pol.err == nil {
		// The server ignores any key of this method (MODE_DISABLED, a safe
		// idempotency_level, gRPC's infrastructure services): so does the
		// client, whatever the call's metadata holds.
		return "", false, nil
	}
	vals := md.Get(MetadataKey)
	chosen, hasChosen := ctx.Value(outgoingKey{}).(string)
	switch {
	case len(md.Get(binaryMetadataKey)) > 0:
		return "", false, binaryKey()
	case hasChosen && slices.ContainsFunc(vals, func(v string) bool { return v != chosen }):
		// WithOutgoingKey beside a key set in the metadata otherwise: two
		// parts of the code disagree about which operation this is, and
		// picking one could merge two operations or split one.
		return "", false, invalidKey(MetadataKey, outgoingKeyConflict)
	case len(vals) > 1:
		return "", false, invalidKey(MetadataKey, fmt.Sprintf("%d values in outgoing metadata, exactly one is allowed: "+
			"set the key once (metadata.AppendToOutgoingContext adds a value each time; WithOutgoingKey replaces its own)", len(vals)))
	case len(vals) == 1:
		from := ""
		if hasChosen {
			from = "WithOutgoingKey"
		}
		if err := ValidateKey(vals[0]); err != nil {
			return "", false, keyError(err, MetadataKey, from)
		}
		return vals[0], true, nil
	case hasChosen:
		if err := ValidateKey(chosen); err != nil {
			return "", false, keyError(err, MetadataKey, "WithOutgoingKey")
		}
		return chosen, false, nil
	}
	if !pol.clientGeneratesKey(o.unknownMethodKeys) {
		return "", false, nil
	}
	if isMarkedRetry(md) {
		return "", false, ErrChainOrder.with(method, nil)
	}
	fix := " (or, if calling it again changes nothing, mark it idempotency_level NO_SIDE_EFFECTS or IDEMPOTENT in its .proto)"
	if !pol.known {
		fix = " (its descriptor is not linked in, so it is taken to need a key: see WithKeysForUnknownMethods)"
	}
	if k, inCall, err := derivedOutgoingKey(ctx, method, fix); inCall || err != nil {
		return k, false, err
	}
	k, err := uuid.NewV7()
	if err != nil {
		return "", false, fmt.Errorf("idempotency: generate key: %w", err)
	}
	return k.String(), false, nil
}

// outgoingKeyConflict is the error of a call whose context has a key from
// WithOutgoingKey and another in its outgoing metadata.
const outgoingKeyConflict = "WithOutgoingKey set one key and the outgoing metadata carries another " + MetadataKey + "; " +
	"a call has one key, and the client does not pick one for you: set it one way only " +
	"(remove the " + MetadataKey + " metadata, or call WithOutgoingKey on a context without it)"

type retryStateKey struct{}

// retryState is one call's retrying by [UnaryClientInterceptor]: it
// decides after each failed attempt whether another is made and how long
// to wait for it, so that the budget, the call's deadline and the
// server's RetryInfo are weighed together, and it remembers why it
// stopped, for the caller's error. The retry interceptor calls retriable
// and then backoff, one attempt at a time.
type retryState struct {
	o        *clientOptions
	start    time.Time
	end      time.Time // the budget's end, or the call's deadline if sooner
	deadline bool      // end is the call's deadline
	attempts int       // failed attempts so far
	next     time.Duration
	stop     string // which limit ended the retries; "" if none did
}

func (o *clientOptions) newRetryState(ctx context.Context) *retryState {
	now := time.Now()
	rs := &retryState{o: o, start: now, end: now.Add(o.retryBudget)}
	if d, ok := ctx.Deadline(); ok && d.Before(rs.end) {
		rs.end, rs.deadline = d, true
	}
	return rs
}

// callOptions are the per-call options of the retry interceptor.
func (rs *retryState) callOptions() []grpc.CallOption {
	return []grpc.CallOption{
		retry.WithRetriable(rs.retriable),
		retry.WithBackoff(func(context.Context, uint) time.Duration { return rs.next }),
	}
}

// retriable reports whether the attempt that failed with err is followed
// by another, and sets the wait before it: the backoff, at least the
// server's RetryInfo delay. No retry is made whose wait would end past the
// budget or the call's deadline: the caller gets the last answer at once
// rather than a bare DeadlineExceeded after a wait that leads nowhere.
func (rs *retryState) retriable(err error) bool {
	rs.attempts++
	if !retryableCode(status.Code(err)) && !errors.Is(err, ErrAttemptTimeout) {
		return false
	}
	if rs.o.maxAttempts > 0 && rs.attempts >= rs.o.maxAttempts {
		if rs.o.maxAttempts > 1 { // 1 turned retries off: nothing gave up
			rs.stop = fmt.Sprintf("WithMaxAttempts(%d) allows no more", rs.o.maxAttempts)
		}
		return false
	}
	server, _ := RetryDelay(err)
	rs.next = backoffDelay(uint(rs.attempts), rs.o.backoffBase, rs.o.backoffMax, rand.Float64(), server)
	if time.Now().Add(rs.next).After(rs.end) {
		rs.stop = fmt.Sprintf("the next retry, %v later, would start past the retry budget of %v (WithRetryBudget)", rs.next.Round(time.Millisecond), rs.o.retryBudget)
		if rs.deadline {
			rs.stop = fmt.Sprintf("the next retry, %v later, would start past the call's deadline", rs.next.Round(time.Millisecond))
		}
		return false
	}
	return true
}

// explain adds to the error of a call the interceptor stopped retrying how many
// attempts it made and which limit stopped it.
func (rs *retryState) explain(err error) error {
	if err == nil || rs.stop == "" {
		return err
	}
	attempts := "1 attempt"
	if rs.attempts != 1 {
		attempts = fmt.Sprintf("%d attempts", rs.attempts)
	}
	return &retriesEnded{err: err, why: fmt.Sprintf("idempotency: gave up after %s in %v: %s",
		attempts, time.Since(rs.start).Round(time.Millisecond), rs.stop)}
}

// retriesEnded is the last attempt's error of a call whose retries ran
// out: the same code and details, the message saying why no retry
// followed.
type retriesEnded struct {
	err error
	why string
}

func (e *retriesEnded) Error() string { return e.err.Error() + " (" + e.why + ")" }
func (e *retriesEnded) Unwrap() error { return e.err }

// GRPCStatus is the last attempt's status with the reason appended to its
// message.
func (e *retriesEnded) GRPCStatus() *status.Status {
	p := status.Convert(e.err).Proto()
	p.Message += " (" + e.why + ")"
	return status.FromProto(p)
}

// cut reports whether the attempt made with actx, derived from the call's
// ctx, reached the deadline of WithPerAttemptTimeout rather than the call's
// own. It goes by the clock, as grpc-go does when it reports an attempt
// DeadlineExceeded: the server, which knows the attempt's deadline, may
// end the stream a moment before the timer of actx marks it done.
func (o *clientOptions) cut(ctx, actx context.Context) bool {
	end, _ := actx.Deadline()
	if d, ok := ctx.Deadline(); ok && !d.After(end) || ctx.Err() != nil {
		return false // the call's own deadline or cancellation
	}
	return !time.Now().Before(end)
}

// boundAttempts applies [WithPerAttemptTimeout] to each attempt invoker
// sends of a call that is retried (the retry interceptor runs it once per
// attempt), and names the option when it cut one: retry.WithPerRetryTimeout's
// error would be a bare DeadlineExceeded, retried past the budget.
func (o *clientOptions) boundAttempts(invoker grpc.UnaryInvoker) grpc.UnaryInvoker {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, opts ...grpc.CallOption) error {
		if ctx.Value(retryStateKey{}) == nil {
			return invoker(ctx, method, req, reply, cc, opts...) // not retried: bounded by its deadline only
		}
		actx, cancel := context.WithTimeout(ctx, o.perAttemptTimeout)
		defer cancel()
		err := invoker(actx, method, req, reply, cc, opts...)
		if c := status.Code(err); (c == codes.DeadlineExceeded || c == codes.Canceled) && o.cut(ctx, actx) {
			return ErrAttemptTimeout.with(fmt.Sprintf("%s cut after %v (%v)", method, o.perAttemptTimeout, status.Convert(err).Message()), nil)
		}
		return err
	}
}

// backoffDelay is the wait before retry attempt (1 for the first retry):
// base doubled per attempt, capped at ceiling, scaled by a jitter factor drawn
// from r in [0, 1), and never less than the server's suggested delay.
func backoffDelay(attempt uint, base, ceiling time.Duration, r float64, server time.Duration) time.Duration {
	d := base << min(attempt-1, 16)
	if d > ceiling || d <= 0 {
		d = ceiling
	}
	d = time.Duration(float64(d) * (1 - backoffJitter + 2*backoffJitter*r))
	return max(d, server)
}
