package idempotency

import (
	"context"
	"fmt"
	"math/rand/v2"
	"slices"
	"sync/atomic"
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
// [CallKeyFromContext] instead; the two never see each other's key.
//
// The key also goes into the context's outgoing metadata, replacing the one
// an earlier WithOutgoingKey put there, so that a call no client
// interceptor of this package sees (a streaming call) still carries it, and
// [StreamServerInterceptor] refuses it rather than run it unprotected.
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
// [MetadataKey], and keeps it for all of the call's attempts.
//
// The key is, in order: the "idempotency-key" already in the outgoing
// metadata, the key set with [WithOutgoingKey], when ctx is inside a
// running call (a handler calling another service: a re-run of the handler
// sends the same key) the key of the effect [WithEffect] names or else the
// key [DownstreamKey] counts for the method, or a new UUIDv7. A call made
// with the context of a call that has ended is refused with
// [ErrCallEnded]. No key is
// generated for methods whose .proto says they need none: the
// (idempotency.v1.method) option with MODE_DISABLED or a key_field (the
// request carries its key), or idempotency_level NO_SIDE_EFFECTS or
// IDEMPOTENT without an explicit mode. Methods whose descriptor is not
// linked in get a key unless [WithKeysForUnknownMethods](false). A key in
// the binary metadata "idempotency-key-bin" is refused with
// codes.InvalidArgument before anything is sent, as the server would
// refuse it: it is another header to gRPC, not the key.
//
// Retries must happen below this interceptor, so that they reuse the key:
// put it before go-grpc-middleware's retry interceptor in the chain (or use
// [UnaryClientInterceptors], which does), or rely on gRPC's own retry
// policy, which runs below every interceptor. A call that arrives as a retry
// attempt of that retry interceptor (or of go-grpc-middleware v1's, whose
// marker is x-retry-attempty) without a key is refused with [ErrChainOrder]
// instead of getting a fresh key, which would make the retry a second,
// different operation. A retry loop of another kind above this interceptor
// marks nothing, so each of its attempts is a new call with a new key: such
// a loop must carry the key itself ([CaptureKey] on the first attempt,
// [WithOutgoingKey] on the others) or run below this interceptor.
//
// It panics if an option is invalid.
func UnaryClientInterceptor(opts ...ClientOption) grpc.UnaryClientInterceptor {
	return evaluateClientOptions(opts).interceptor(false)
}

// UnaryClientInterceptors returns the key interceptor followed by
// go-grpc-middleware's retry interceptor, configured for calls that are safe
// to retry because they carry a key: up to 5 retries on [RetryCodes] and a
// per-attempt DeadlineExceeded, with exponential backoff and jitter,
// waiting at least the delay of the server's RetryInfo when it sends one.
// Calls that carry no key in the metadata are not retried, unless protobuf
// marks the method NO_SIDE_EFFECTS or IDEMPOTENT or its request carries the
// key (key_field): nothing would deduplicate them. Those are retried the
// same way, with the same codes, backoff and RetryInfo.
//
// It panics if an option is invalid.
//
//	conn, err := grpc.NewClient(target,
//		grpc.WithChainUnaryInterceptor(idempotency.UnaryClientInterceptors()...))
func UnaryClientInterceptors(opts ...ClientOption) []grpc.UnaryClientInterceptor {
	o := evaluateClientOptions(opts)
	ropts := []retry.CallOption{retry.WithMax(o.retryMax + 1)} // WithMax counts attempts, the first included
	if o.perAttemptTimeout > 0 {
		ropts = append(ropts, retry.WithPerRetryTimeout(o.perAttemptTimeout))
	}
	return []grpc.UnaryClientInterceptor{o.interceptor(true), retry.UnaryClientInterceptor(ropts...)}
}

// RetryCodes returns the codes [UnaryClientInterceptors] retries:
// Unavailable, Aborted (the key is in progress on the server) and
// ResourceExhausted. A per-attempt DeadlineExceeded is retried too (see
// [WithPerAttemptTimeout]).
func RetryCodes() []codes.Code {
	return []codes.Code{codes.Unavailable, codes.Aborted, codes.ResourceExhausted}
}

// ClientOption configures [UnaryClientInterceptor] and
// [UnaryClientInterceptors]. An invalid value makes them panic, naming the
// option.
type ClientOption func(*clientOptions)

type clientOptions struct {
	unknownMethodKeys bool
	retryMax          uint
	backoffBase       time.Duration
	backoffMax        time.Duration
	perAttemptTimeout time.Duration
}

// backoffJitter is the relative jitter of every retry delay: ±20%.
const backoffJitter = 0.2

func defaultClientOptions() clientOptions {
	return clientOptions{
		unknownMethodKeys: true,
		retryMax:          5,
		backoffBase:       50 * time.Millisecond,
		backoffMax:        2 * time.Second,
		perAttemptTimeout: 10 * time.Second,
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

// WithRetryMax sets how many times [UnaryClientInterceptors] retries a call
// after its first attempt; 0 disables retries. Defaults to 5.
func WithRetryMax(n uint) ClientOption {
	return func(o *clientOptions) { o.retryMax = n }
}

// WithRetryBackoff sets the exponential backoff of [UnaryClientInterceptors]:
// the first retry waits about base, each later one twice as long, never more
// than max, each with ±20% jitter; a server's RetryInfo delay is a lower
// bound. Needs 0 < base <= max. Defaults to 50 milliseconds and 2 seconds.
func WithRetryBackoff(base, max time.Duration) ClientOption {
	return func(o *clientOptions) { o.backoffBase, o.backoffMax = base, max }
}

// WithPerAttemptTimeout bounds each attempt of [UnaryClientInterceptors]; an
// attempt that times out is retried with the same key while the call's own
// deadline allows. 0 disables it; negative is invalid. Defaults to 10
// seconds.
func WithPerAttemptTimeout(d time.Duration) ClientOption {
	return func(o *clientOptions) { o.perAttemptTimeout = d }
}

func (o *clientOptions) interceptor(retryHints bool) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		pol := policyForRequest(method, req)
		key, inMetadata, err := o.keyWith(ctx, method, pol)
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
		switch {
		case !retryHints:
		case key == "" && !pol.retrySafeWithoutKey():
			// Nothing would deduplicate a retry of this call.
			opts = append(opts, retry.Disable())
		default:
			// A key in the metadata or in the request (key_field), or a
			// method safe to repeat: retried alike, with the chain's codes,
			// backoff and RetryInfo. Per-call retry options come first so
			// the caller's own retry call options still override them.
			opts = append(o.retryHints(), opts...)
		}
		return invoker(ctx, method, req, reply, cc, opts...)
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
func (o *clientOptions) keyWith(ctx context.Context, method string, pol methodPolicy) (key string, inMetadata bool, err error) {
	if pol.known && pol.mode == modePassThrough && pol.err == nil {
		// The server ignores any key of this method (MODE_DISABLED, a safe
		// idempotency_level, gRPC's infrastructure services): so does the
		// client, whatever the context's metadata holds.
		return "", false, nil
	}
	md, _ := metadata.FromOutgoingContext(ctx)
	vals := md.Get(MetadataKey)
	chosen, hasChosen := ctx.Value(outgoingKey{}).(string)
	switch {
	case len(md.Get(binaryMetadataKey)) > 0:
		return "", false, binaryKey()
	case len(vals) > 1:
		return "", false, invalidKey(MetadataKey, fmt.Sprintf("%d values in outgoing metadata, exactly one is allowed", len(vals)))
	case len(vals) == 1:
		if hasChosen && chosen != vals[0] {
			return "", false, invalidKey(MetadataKey, "WithOutgoingKey and the outgoing metadata name different keys")
		}
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
	if k, how, err := derivedOutgoingKey(ctx, method); how != outgoingNone || err != nil {
		return k, false, err
	}
	k, err := uuid.NewV7()
	if err != nil {
		return "", false, fmt.Errorf("idempotency: generate key: %w", err)
	}
	return k.String(), false, nil
}

// retryHints returns per-call options for the retry interceptor: the codes
// to retry, and a backoff that honours the RetryInfo of the last error.
func (o *clientOptions) retryHints() []grpc.CallOption {
	var serverDelay atomic.Int64 // RetryInfo of the last failed attempt, in ns
	retryable := RetryCodes()
	retriable := func(err error) bool {
		d, _ := RetryDelay(err)
		serverDelay.Store(int64(d))
		return slices.Contains(retryable, status.Code(err))
	}
	backoff := func(_ context.Context, attempt uint) time.Duration {
		return backoffDelay(attempt, o.backoffBase, o.backoffMax, rand.Float64(), time.Duration(serverDelay.Load()))
	}
	return []grpc.CallOption{retry.WithRetriable(retriable), retry.WithBackoff(backoff)}
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
