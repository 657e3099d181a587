package idempotency

import (
	"context"
	"fmt"
	"math/rand/v2"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
)

// WithKey returns a context whose calls use key as their idempotency key
// instead of a generated one. Use it when the key comes from outside the
// call, such as an order ID or a key the application stored to retry a call
// later. [UnaryClientInterceptor] rejects an invalid key before sending.
func WithKey(ctx context.Context, key string) context.Context {
	return context.WithValue(ctx, clientKey{}, key)
}

type clientKey struct{}

// CaptureKey is a call option that stores the idempotency key a call used in
// *dst (empty when the call carried none), so the application can log it or
// retry the same logical call later with [WithKey].
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
// metadata, the key set with [WithKey], or a new UUIDv7. No key is
// generated for methods whose .proto says they need none: the
// (idempotency.v1.method) option with MODE_DISABLED or a key_field (the
// request carries its key), or idempotency_level NO_SIDE_EFFECTS or
// IDEMPOTENT without an explicit mode. Methods whose descriptor is not
// linked in get a key unless [WithKeysForUnknownMethods](false).
//
// Retries must happen below this interceptor, so that they reuse the key:
// put it before go-grpc-middleware's retry interceptor in the chain (or use
// [UnaryClientInterceptors], which does), or rely on gRPC's own retry
// policy, which runs below every interceptor. A call that arrives as a retry
// attempt of that retry interceptor without a key is refused with
// [ErrChainOrder] instead of getting a fresh key, which would make the retry
// a second, different operation.
func UnaryClientInterceptor(opts ...ClientOption) grpc.UnaryClientInterceptor {
	o := evaluateClientOptions(opts)
	return o.interceptor(false)
}

// UnaryClientInterceptors returns the key interceptor followed by
// go-grpc-middleware's retry interceptor, configured for calls that are safe
// to retry because they carry a key: up to 5 retries on Unavailable, Aborted
// (the key is in progress on the server), ResourceExhausted and a
// per-attempt DeadlineExceeded, with exponential backoff and jitter, waiting
// at least the delay of the server's RetryInfo when it sends one. Calls that
// carry no key are not retried, unless protobuf marks the method
// NO_SIDE_EFFECTS or IDEMPOTENT or its request carries the key (key_field):
// nothing would deduplicate them.
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

// RetryCodes are the codes [UnaryClientInterceptors] retries. A per-attempt
// DeadlineExceeded is retried too (see [WithPerAttemptTimeout]).
var RetryCodes = []codes.Code{codes.Unavailable, codes.Aborted, codes.ResourceExhausted}

func (o *clientOptions) interceptor(retryHints bool) grpc.UnaryClientInterceptor {
	return func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		key, inMetadata, err := o.keyFor(ctx, method)
		if err != nil {
			return err
		}
		for _, opt := range opts {
			if c, ok := opt.(captureKey); ok && c.dst != nil {
				*c.dst = key
			}
		}
		if key == "" {
			if retryHints && !policyFor(method).retrySafeWithoutKey() {
				// Nothing would deduplicate a retry of this call.
				opts = append(opts, retry.Disable())
			}
			return invoker(ctx, method, req, reply, cc, opts...)
		}
		if !inMetadata {
			ctx = metadata.AppendToOutgoingContext(ctx, MetadataKey, key)
		}
		if retryHints {
			// Per-call retry options come first so the caller's own retry
			// call options still override them.
			opts = append(o.retryHints(), opts...)
		}
		return invoker(ctx, method, req, reply, cc, opts...)
	}
}

// keyFor picks the key of a call; "" means the call needs none.
func (o *clientOptions) keyFor(ctx context.Context, method string) (key string, inMetadata bool, err error) {
	md, _ := metadata.FromOutgoingContext(ctx)
	vals := md.Get(MetadataKey)
	chosen, hasChosen := ctx.Value(clientKey{}).(string)
	switch {
	case len(vals) > 1:
		return "", false, invalidKey(fmt.Sprintf("%d values in outgoing metadata, exactly one is allowed", len(vals)))
	case len(vals) == 1:
		if hasChosen && chosen != vals[0] {
			return "", false, invalidKey("WithKey and the outgoing metadata name different keys")
		}
		return vals[0], true, ValidateKey(vals[0])
	case hasChosen:
		return chosen, false, ValidateKey(chosen)
	}
	if !policyFor(method).clientGeneratesKey(o.unknownMethodKeys) {
		return "", false, nil
	}
	if len(md.Get(retry.AttemptMetadataKey)) > 0 {
		return "", false, ErrChainOrder.with(method, nil)
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
	retriable := func(err error) bool {
		d, _ := RetryDelay(err)
		serverDelay.Store(int64(d))
		c := status.Code(err)
		for _, rc := range RetryCodes {
			if c == rc {
				return true
			}
		}
		return false
	}
	backoff := func(_ context.Context, attempt uint) time.Duration {
		d := o.backoffBase << min(attempt-1, 16)
		if d > o.backoffMax || d <= 0 {
			d = o.backoffMax
		}
		d = time.Duration(float64(d) * (1 - o.backoffJitter + 2*o.backoffJitter*rand.Float64()))
		return max(d, time.Duration(serverDelay.Load()))
	}
	return []grpc.CallOption{retry.WithRetriable(retriable), retry.WithBackoff(backoff)}
}
