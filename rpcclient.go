package idempotency

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
)

// UnaryClient is the client side of the idempotency layer for the unary
// calls of an RPC framework that has no retry interceptor of its own: it
// gives each logical call one key and retries it with that key, as
// [UnaryClientInterceptors] does for grpc-go (the same options, defaults,
// codes, backoff, RetryInfo and budget; the same key choice, derived keys
// inside a running call included).
// github.com/exactlyonce/idempotency/idempotencyconnect runs connect-go's
// client interceptor on it.
type UnaryClient struct {
	o *clientOptions
}

// NewUnaryClient returns the client side of the idempotency layer with
// the options [UnaryClientInterceptors] takes. It fails if an option is
// invalid, naming it.
func NewUnaryClient(opts ...ClientOption) (*UnaryClient, error) {
	o := defaultClientOptions()
	for _, opt := range opts {
		opt(&o)
	}
	if err := o.validate(); err != nil {
		return nil, err
	}
	return &UnaryClient{o: &o}, nil
}

// UnaryAttempt sends one attempt of a call with md, the call's outgoing
// metadata with its key (lower-case keys, as gRPC has them; an HTTP
// framework sends them as request headers). Its error is read as a gRPC
// status (status.FromError): a framework's own error type should
// implement GRPCStatus, or be converted, so that its code and details
// (RetryInfo) decide whether the call is retried.
type UnaryAttempt func(ctx context.Context, md metadata.MD) error

// Invoke makes a call of method with req: it picks the call's key (the one
// md carries already, [WithOutgoingKey]'s, one derived from the call
// running in ctx, or a new one; none for a method that needs none) and
// sends attempts until one succeeds, one fails with a code not worth
// retrying, or a limit ends the retries (the error then says which). md is
// the call's metadata as the application set it. key is the key the
// attempts carried ("" when none: the method needs none, or its request
// carries it in its key field).
func (c *UnaryClient) Invoke(ctx context.Context, method string, req proto.Message, md metadata.MD, attempt UnaryAttempt) (key string, err error) {
	pol := policyForRequest(method, req)
	key, inMetadata, err := c.o.keyWith(ctx, method, pol, md)
	if err != nil {
		return "", err
	}
	md = md.Copy()
	if key != "" && !inMetadata {
		md.Set(MetadataKey, key)
	}
	if key == "" && !pol.retrySafeWithoutKey() {
		// Nothing would deduplicate a retry of this call.
		return "", c.attempt(ctx, method, md, attempt, false)
	}
	rs := c.o.newRetryState(ctx)
	for n := 1; ; n++ {
		if n > 1 {
			// The mark retry interceptors set: the server looks for the
			// key's stored result first (it changes the cost only).
			md.Set(retryMarkers[0], fmt.Sprint(n-1))
		}
		err = c.attempt(ctx, method, md, attempt, true)
		if err == nil || !rs.retriable(err) {
			return key, rs.explain(err)
		}
		t := time.NewTimer(rs.next)
		select {
		case <-ctx.Done():
			// The caller gave up waiting for the retry: its context's
			// error, as a gRPC client's retry interceptor answers.
			t.Stop()
			return key, status.FromContextError(ctx.Err()).Err()
		case <-t.C:
		}
	}
}

// attempt sends one attempt, bounded by WithPerAttemptTimeout when the
// call is retried.
func (c *UnaryClient) attempt(ctx context.Context, method string, md metadata.MD, attempt UnaryAttempt, retried bool) error {
	if !retried || c.o.perAttemptTimeout <= 0 {
		return attempt(ctx, md)
	}
	actx, cancel := context.WithTimeout(ctx, c.o.perAttemptTimeout)
	defer cancel()
	err := attempt(actx, md)
	if err != nil && c.o.cut(ctx, actx) {
		return ErrAttemptTimeout.with(fmt.Sprintf("%s cut after %v (%v)", method, c.o.perAttemptTimeout, err), nil)
	}
	return err
}
