package idempotencyconnect_test

import (
	"context"
	"errors"
	"sync/atomic"
	"testing"
	"time"

	"connectrpc.com/connect"
	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/idempotencyconnect"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// The caller cancels its call while the client interceptor waits before a
// retry (the first attempt answered Unavailable). The caller asked to stop:
// the call ends with Canceled, as grpc-go's (idempotency.UnaryClientInterceptor)
// ends it, not with the attempt's Unavailable, which tells the caller to
// retry a call it gave up.
func TestReview32bCancelledDuringTheBackoff(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := r32Mount(t, e.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		return nil, connect.NewError(connect.CodeUnavailable, errors.New("busy"))
	}, nil, nil, nil)
	backoff := idempotency.WithRetryBackoff(20*time.Second, 20*time.Second)

	// connect-go, the idempotency client interceptor outermost.
	answered := make(chan struct{}, 1)
	inner := connect.UnaryInterceptorFunc(func(next connect.UnaryFunc) connect.UnaryFunc {
		return func(ctx context.Context, req connect.AnyRequest) (connect.AnyResponse, error) {
			resp, err := next(ctx, req)
			answered <- struct{}{}
			return resp, err
		}
	})
	ic, err := idempotencyconnect.NewClientInterceptor(backoff)
	require.NoError(t, err)
	c := connect.NewClient[testingv1.Request, testingv1.Response](httpClient(t, false), url+procRequired, connect.WithInterceptors(ic, inner))
	ctx, cancel := context.WithCancel(context.Background())
	go func() { <-answered; cancel() }()
	_, err = c.CallUnary(ctx, connect.NewRequest(&testingv1.Request{Body: "c"}))
	connectErr := err

	// grpc-go, the library's chain, against the same handler.
	answered2 := make(chan struct{}, 1)
	gc := grpcClient(t, url, idempotency.UnaryClientInterceptor(backoff), func(ctx context.Context, method string, req, reply any, cc *grpc.ClientConn, invoker grpc.UnaryInvoker, opts ...grpc.CallOption) error {
		err := invoker(ctx, method, req, reply, cc, opts...)
		answered2 <- struct{}{}
		return err
	})
	ctx2, cancel2 := context.WithCancel(context.Background())
	go func() { <-answered2; cancel2() }()
	_, err = gc.Required(ctx2, &testingv1.Request{Body: "g"})
	require.Equal(t, codes.Canceled, status.Code(err), "grpc-go's chain: %v", err)

	require.Equal(t, connect.CodeCanceled, connectCode(connectErr), "connect's interceptor: %v", connectErr)
	_, hasDelay := idempotencyconnect.RetryDelay(connectErr)
	require.False(t, hasDelay, "no RetryInfo on a call the caller cancelled")
	require.EqualValues(t, 2, runs.Load(), "one attempt each")
}

// The server asks for a wait longer than the retry budget (RetryInfo of
// 10 s, budget 1 s), and a call's deadline is shorter than the backoff:
// one attempt each, the handler's code and RetryInfo kept, the message
// saying why no retry followed.
func TestReview32bRetryInfoBeyondTheBudgetAndADeadlineShorterThanTheBackoff(t *testing.T) {
	t.Parallel()
	e := newEnv(t)
	var runs atomic.Int64
	url := r32Mount(t, e.store, func(ctx context.Context, req *connect.Request[testingv1.Request]) (*connect.Response[testingv1.Response], error) {
		runs.Add(1)
		ce := connect.NewError(connect.CodeUnavailable, errors.New("maintenance"))
		d, err := connect.NewErrorDetail(&errdetails.RetryInfo{RetryDelay: durationpb.New(10 * time.Second)})
		require.NoError(t, err)
		ce.AddDetail(d)
		return nil, ce
	}, nil, nil, nil)
	c := client(t, url, procRequired, protocols[1], false, idempotency.WithRetryBudget(time.Second))
	_, err := c.CallUnary(context.Background(), connect.NewRequest(&testingv1.Request{Body: "a"}))
	require.Equal(t, connect.CodeUnavailable, connectCode(err))
	d, ok := idempotencyconnect.RetryDelay(err)
	require.True(t, ok)
	require.Equal(t, 10*time.Second, d)
	require.Contains(t, err.Error(), "WithRetryBudget")
	require.EqualValues(t, 1, runs.Load())

	c = client(t, url, procRequired, protocols[2], false, idempotency.WithRetryBackoff(5*time.Second, 5*time.Second))
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Second)
	defer cancel()
	_, err = c.CallUnary(ctx, connect.NewRequest(&testingv1.Request{Body: "b"}))
	require.Equal(t, connect.CodeUnavailable, connectCode(err))
	require.Contains(t, err.Error(), "deadline")
	require.EqualValues(t, 2, runs.Load())
}
