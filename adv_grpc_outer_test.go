package idempotency_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// exact.go: the wrapper handed to gRPC for a response type with a map "is
// the decoded message in every other respect: an interceptor outside this
// package's reads its fields through ProtoReflect". An interceptor outside
// that edits the response through ProtoReflect (redaction, a served-by
// field, an error-to-field mapping), as it can for any other response,
// changes the message the wrapper reports but not what is sent: the wire
// carries the stored bytes, so the edit is silently lost, for map types
// only.
//
// Correct: what the client receives is the message the outer interceptor
// returned (its edit visible), or the edit is refused loudly.
func TestAdvOuterEditOfMapResponseReachesTheClient(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	var edited proto.Message
	addr := mapService(t, e, 4, func(resp any) {
		m := resp.(proto.Message).ProtoReflect()
		m.Set(m.Descriptor().Fields().ByName("id"), protoreflect.ValueOfString("redacted"))
		edited = resp.(proto.Message)
	})
	conn := dial(t, addr)
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "edit-1")
	req := rawMessage(nil)
	var out rawMessage
	require.NoError(t, conn.Invoke(ctx, "/dynmap.v1.Receipts/Issue", &req, &out, grpc.ForceCodecV2(rawCodec{})))
	require.Equal(t, "redacted", edited.ProtoReflect().Get(edited.ProtoReflect().Descriptor().Fields().ByName("id")).String(), "the outer interceptor sees its edit")
	require.True(t, bytes.Contains(out, []byte("redacted")), "the client receives the edited response; got %q (the handler's id r-1)", []byte(out))
}

// wrappedStream is a ServerTransportStream wrapper, as tracing or logging
// interceptors install to see the headers a call sends.
type wrappedStream struct{ grpc.ServerTransportStream }

// README, Limitations: when an interceptor outside this one wrapped the
// call's ServerTransportStream and sent the headers itself, a handler's
// later grpc.SetHeader on a keyed call cannot be told it is too late: the
// recorder asks grpc-go's own stream whether its headers went, and a
// wrapper hides it. The header is stored with the result and replayed
// (both answers agree), and the first answer lacks it, as the headers had
// gone. This test holds the limitation to what the README says: without
// the key the late SetHeader fails, with it SetHeader returns nil and the
// first answer has no x-charge-id; a replay carries it.
func TestAdvSetHeaderBehindAWrappedStreamIsTheDocumentedLimit(t *testing.T) {
	t.Parallel()
	outer := func(ctx context.Context, req any, _ *grpc.UnaryServerInfo, next grpc.UnaryHandler) (any, error) {
		ctx = grpc.NewContextWithServerTransportStream(ctx, wrappedStream{grpc.ServerTransportStreamFromContext(ctx)})
		if err := grpc.SendHeader(ctx, metadata.Pairs("x-outer", "1")); err != nil {
			return nil, err
		}
		return next(ctx, req)
	}
	var setErr error
	e := newEnv(t, envConfig{interceptors: []grpc.UnaryServerInterceptor{outer}, handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		setErr = grpc.SetHeader(ctx, metadata.Pairs("x-charge-id", "ch-1"))
		return wrapperspb.String("ok"), nil
	}})

	// Without the key the interceptor passes the call through: grpc-go's
	// own stream refuses the late header.
	var header metadata.MD
	require.NoError(t, e.conn.Invoke(context.Background(), methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{}, grpc.Header(&header)))
	require.Error(t, setErr, "without the key interceptor's recorder, the late SetHeader fails")

	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "wrapped-1")
	header = nil
	require.NoError(t, e.conn.Invoke(ctx, methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{}, grpc.Header(&header)))
	require.Equal(t, []string{"1"}, header.Get("x-outer"))
	require.NoError(t, setErr, "if this fails, the recorder now sees through the wrapper: drop the README's limitation")
	require.Empty(t, header.Get("x-charge-id"), "the headers had gone before the handler set it")
}
