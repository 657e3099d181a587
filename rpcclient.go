package idempotency

import (
	"context"
	"fmt"
	"time"

	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency/internal/seam"
)

// unaryClient is the client side of the layer for the unary calls of an
// RPC framework that has no retry interceptor of its own, lent to its
// adapter by package unary: it gives each logical call one key and retries
// it with that key, as [UnaryClientInterceptor] does for grpc-go (the same
// options, defaults, codes, backoff, RetryInfo and budget; the same key
// choice, derived keys inside a running call included).
type unaryClient struct {
	o *clientOptions
}

var _ seam.Client = (*unaryClient)(nil)

func init() {
	seam.NewClient = func(opts any) (seam.Client, error) {
		o := defaultClientOptions()
		for _, opt := range opts.([]ClientOption) {
			opt(&o)
		}
		if err := o.validate(); err != nil {
			return nil, err
		}
		return &unaryClient{o: &o}, nil
	}
}

// Invoke makes a call of method with req: it picks the call's key (the one
// md carries already, [WithOutgoingKey]'s, one derived from the call
// running in ctx, or a new one; none for a method that needs none) and
// sends attempts until one succeeds, one fails with a code not worth
// retrying, or a limit ends the retries (the error then says which). md is
// the call's metadata as the application set it. key is the key the
// attempts carried ("" when none: the method needs none, or its request
// carries it in its key field).
func (c *unaryClient) Invoke(ctx context.Context, method string, req proto.Message, md metadata.MD, attempt seam.Attempt) (key string, err error) {
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
func (c *unaryClient) attempt(ctx context.Context, method string, md metadata.MD, attempt seam.Attempt, retried bool) error {
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
