package idempotencyconnect

import (
	"context"
	"net/http"
	"strings"

	"connectrpc.com/connect"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/unary"
)

// NewClientInterceptor returns a connect client interceptor that gives
// each unary call one idempotency key and retries it with that key: it is
// [idempotency.UnaryClientInterceptor] for connect-go, which has no retry
// interceptor of its own, with the same options and defaults (the codes
// Unavailable, Aborted and ResourceExhausted, exponential backoff from
// 50 ms to 2 s, at least the server's RetryInfo, a 30 s budget, no timeout
// per attempt). The key
// is, in order: an Idempotency-Key header already on the request,
// [idempotency.WithOutgoingKey]'s (both at once, different, is an error),
// inside a running call (a handler's downstream call: a re-run sends the
// same key) the key of the effect [idempotency.WithEffect] names, or
// outside one a new one. Inside a running call, a call with neither a key
// nor a name is refused with [idempotency.ErrUnnamedEffect], nothing sent. Methods that need no key
// ((idempotency.v1.method) MODE_DISABLED, idempotency_level NO_SIDE_EFFECTS
// or IDEMPOTENT) get none and are retried all the same; a call without a
// key that nothing would deduplicate is never retried.
// [idempotency.CaptureKey]'s counterpart is [KeyOf]: the key a call used
// is in its request's header once it returned.
//
// Give it to the client with connect.WithInterceptors, outermost (first),
// so that the interceptors after it see each attempt.
func NewClientInterceptor(opts ...idempotency.ClientOption) (connect.Interceptor, error) {
	c, err := unary.NewClient(opts...)
	if err != nil {
		return nil, err
	}
	return &clientInterceptor{client: c}, nil
}

// KeyOf returns the idempotency key a call of the client interceptor sent
// with req (the header it set), "" if none; send the same request again
// later with idempotency.WithOutgoingKey(ctx, key) to retry the same call.
func KeyOf(req connect.AnyRequest) string {
	return req.Header().Get(idempotency.HeaderKey)
}

type clientInterceptor struct {
	client *unary.Client
}

func (c *clientInterceptor) WrapUnary(next connect.UnaryFunc) connect.UnaryFunc {
	return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
		if !req.Spec().IsClient {
			return next(ctx, req)
		}
		msg, _ := req.Any().(proto.Message)
		var resp connect.AnyResponse
		_, err := c.client.Invoke(ctx, req.Spec().Procedure, msg, metadataOf(req.Header()), func(ctx context.Context, md metadata.MD) error {
			for _, k := range []string{idempotency.MetadataKey, retryAttemptHeader} {
				if vs := md.Get(k); len(vs) > 0 {
					// One spelling: an application's own ("idempotency-key"
					// set in the map) would go out beside it.
					for name := range req.Header() {
						if strings.EqualFold(name, k) {
							delete(req.Header(), name)
						}
					}
					req.Header()[http.CanonicalHeaderKey(k)] = vs
				}
			}
			r, err := next(ctx, req)
			resp = r
			return toGRPC(err)
		})
		if err != nil {
			return nil, toConnect(err, nil)
		}
		return resp, nil
	}
}

func (c *clientInterceptor) WrapStreamingClient(next connect.StreamingClientFunc) connect.StreamingClientFunc {
	return next
}

func (c *clientInterceptor) WrapStreamingHandler(next connect.StreamingHandlerFunc) connect.StreamingHandlerFunc {
	return next
}

// retryAttemptHeader marks a retry, as go-grpc-middleware's retry
// interceptor does (x-retry-attempt): the server looks for the key's stored
// result first, which only makes the replay cheaper.
const retryAttemptHeader = "x-retry-attempt"
