package idempotency_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// A key sent as binary metadata (idempotency-key-bin) is a different
// header to gRPC; neither the client interceptor nor the server may run the
// call as if it had no key, or mint one beside it. Both refuse it.
func TestGRPCBinaryKeyIsRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{opts: []idempotency.ServerOption{idempotency.WithKeyRequired()}})
	conn, _ := retryingClient(t, "passthrough:///"+e.addr, 2)
	for range 2 { // the same logical call, sent twice through the library's client
		ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey+"-bin", "order-77")
		err := conn.Invoke(ctx, methodCharge, wrapperspb.String("order 77"), &wrapperspb.StringValue{})
		require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
		require.True(t, hasInvalidKeyInfo(err), "%v", err)
	}
	require.Zero(t, e.arrived.Load(), "the client refuses before sending")

	// A client without the library's interceptor: the server refuses the
	// binary key even beside a text one.
	for _, md := range [][]string{
		{idempotency.MetadataKey + "-bin", "order-78"},
		{idempotency.MetadataKey, "order-78", idempotency.MetadataKey + "-bin", "order-78"},
	} {
		ctx := metadata.AppendToOutgoingContext(context.Background(), md...)
		r := invoke(ctx, e.conn, methodCharge, "order 78")
		require.Equal(t, codes.InvalidArgument, status.Code(r.err), "%v", r.err)
		require.True(t, hasInvalidKeyInfo(r.err), "%v", r.err)
	}
	require.Zero(t, e.runs.Load())
	require.Zero(t, e.ledgerRows())
	require.Zero(t, e.keyRows())
}
