package idempotency_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// Headers an interceptor outside the key interceptor already sent cannot
// be added to: a handler's grpc.SetHeader then fails, as it does without
// the interceptor, instead of reporting success and losing the header (and
// storing it for replays that could not send it either). Before the outer
// interceptor sends anything, headers still reach the client.
func TestGRPCHeadersAfterAnOuterInterceptorSentThem(t *testing.T) {
	t.Parallel()
	var setErr error
	var e *env
	outer := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		if req.(*wrapperspb.StringValue).GetValue() == "early" {
			if err := grpc.SendHeader(ctx, metadata.Pairs("x-outer", "1")); err != nil {
				return nil, err
			}
		}
		return next(ctx, req)
	}
	e = newEnv(t, envConfig{interceptors: []grpc.UnaryServerInterceptor{outer}, handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		setErr = grpc.SetHeader(ctx, metadata.Pairs("x-charge-id", "ch-1"))
		if setErr != nil {
			return nil, setErr
		}
		return e.insertLedger(ctx, req)
	}})
	call := func(key, body string) (metadata.MD, error) {
		var header metadata.MD
		ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, key)
		err := e.conn.Invoke(ctx, methodCharge, wrapperspb.String(body), &wrapperspb.StringValue{}, grpc.Header(&header))
		return header, err
	}

	header, err := call("h-early", "early")
	require.Error(t, setErr, "the handler learns that its header cannot be sent")
	require.NotEqual(t, codes.OK, status.Code(err))
	require.Equal(t, []string{"1"}, header.Get("x-outer"))
	require.Empty(t, header.Get("x-charge-id"))
	require.Equal(t, "", e.keyState("h-early"), "nothing stored that a replay could not give")
	require.Zero(t, e.ledgerRows())

	for range 2 { // the first call and its replay
		header, err = call("h-late", "late")
		require.NoError(t, err)
		require.Equal(t, []string{"ch-1"}, header.Get("x-charge-id"))
		require.Len(t, header.Get("content-type"), 1)
	}
	require.Equal(t, 1, e.ledgerRows())
}
