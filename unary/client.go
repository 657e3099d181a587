package unary

import (
	"context"

	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/seam"
)

// Client is the client side of the idempotency layer for the unary calls
// of an RPC framework that has no retry interceptor of its own: it gives
// each logical call one key and retries it with that key, as
// [idempotency.UnaryClientInterceptor] does for grpc-go (the same options,
// defaults, codes, backoff, RetryInfo and budget; the same key choice,
// derived keys inside a running call included).
type Client struct {
	c seam.Client
}

// NewClient returns the client side of the idempotency layer with the
// options [idempotency.UnaryClientInterceptor] takes. It fails if an option
// is invalid, naming it.
func NewClient(opts ...idempotency.ClientOption) (*Client, error) {
	c, err := seam.NewClient(opts)
	if err != nil {
		return nil, err
	}
	return &Client{c: c}, nil
}

// Attempt sends one attempt of a call with md, the call's outgoing
// metadata with its key (lower-case keys, as gRPC has them; an HTTP
// framework sends them as request headers). Its error is read as a gRPC
// status (status.FromError): a framework's own error type should
// implement GRPCStatus, or be converted, so that its code and details
// (RetryInfo) decide whether the call is retried.
type Attempt func(ctx context.Context, md metadata.MD) error

// Invoke makes a call of method with req: it picks the call's key (the one
// md carries already, [idempotency.WithOutgoingKey]'s, one derived from the
// call running in ctx, or a new one; none for a method that needs none)
// and sends attempts until one succeeds, one fails with a code not worth
// retrying, or a limit ends the retries (the error then says which). md is
// the call's metadata as the application set it. key is the key the
// attempts carried ("" when none: the method needs none, or its request
// carries it in its key field).
func (c *Client) Invoke(ctx context.Context, method string, req proto.Message, md metadata.MD, attempt Attempt) (key string, err error) {
	return c.c.Invoke(ctx, method, req, md, seam.Attempt(attempt))
}
