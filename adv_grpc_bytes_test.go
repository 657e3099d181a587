package idempotency_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// advFlatService serves /advflat.v1.Orders/Place, a service built at run
// time (dynamicpb) whose response has no map, only fields string f1..f<n>,
// all set. The key interceptor is installed on the server as usual.
func advFlatService(t *testing.T, e *env, fields int) string {
	t.Helper()
	str := func(name string, n int32) *descriptorpb.FieldDescriptorProto {
		return &descriptorpb.FieldDescriptorProto{Name: proto.String(name), Number: proto.Int32(n),
			Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum(), Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum()}
	}
	var respFields []*descriptorpb.FieldDescriptorProto
	for i := 1; i <= fields; i++ {
		respFields = append(respFields, str(fmt.Sprintf("f%d", i), int32(i)))
	}
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("advflat/v1/orders.proto"), Package: proto.String("advflat.v1"), Syntax: proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{
			{Name: proto.String("Req"), Field: []*descriptorpb.FieldDescriptorProto{str("note", 1)}},
			{Name: proto.String("Order"), Field: respFields},
		},
		Service: []*descriptorpb.ServiceDescriptorProto{{Name: proto.String("Orders"), Method: []*descriptorpb.MethodDescriptorProto{{
			Name: proto.String("Place"), InputType: proto.String(".advflat.v1.Req"), OutputType: proto.String(".advflat.v1.Order"),
		}}}},
	}, nil)
	require.NoError(t, err)
	reqDesc, respDesc := fd.Messages().ByName("Req"), fd.Messages().ByName("Order")
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(e.store)))
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: "advflat.v1.Orders", HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{MethodName: "Place", Handler: func(_ any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
			req := dynamicpb.NewMessage(reqDesc)
			if err := dec(req); err != nil {
				return nil, err
			}
			info := &grpc.UnaryServerInfo{FullMethod: "/advflat.v1.Orders/Place"}
			return icpt(ctx, req, info, func(ctx context.Context, req any) (any, error) {
				e.runs.Add(1)
				out := dynamicpb.NewMessage(respDesc)
				for i := 1; i <= fields; i++ {
					out.Set(respDesc.Fields().ByName(protoreflect.Name(fmt.Sprintf("f%d", i))), protoreflect.ValueOfString(fmt.Sprintf("v%d", i)))
				}
				return out, nil
			})
		}}},
	}, struct{}{})
	return serve(t, srv)
}

// README, "Replays are the first response's bytes": a dynamicpb message (a
// service built at run time) marshals its fields in random order unless
// deterministic output is asked for, map or no map, so its responses are
// handed to gRPC to marshal deterministically: every response of the key,
// the first and each replay, is byte-identical to the stored row. (They
// went out in 8 encodings when only types with a map were.)
func TestAdvDynamicResponseIsTheStoredBytes(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	conn := dial(t, advFlatService(t, e, 12))
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "flat-1")
	req := rawMessage(nil)
	raws, stored := rawAnswers(t, e, conn, ctx, "/advflat.v1.Orders/Place", &req, "flat-1", 8)
	differ, distinct := 0, map[string]bool{}
	for _, raw := range raws {
		distinct[string(raw)] = true
		if string(raw) != string(stored) {
			differ++
		}
	}
	require.Zero(t, differ, "%d of %d responses of one key are not the stored bytes (same fields, other order; %d distinct encodings)", differ, len(raws), len(distinct))
}

// README, "What a handler may do with the call's stream": headers and
// trailers the handler sets are stored with the result and replayed, so
// every caller of a key gets the same answer. A handler that echoes the
// key back in a response header (as HTTP APIs commonly echo
// Idempotency-Key) sends it on the first call, but the header is silently
// left out of storage (storable refuses the name), so replays come back
// without it; the same happens to any custom "grpc-"-prefixed header.
//
// Correct: the first call and its replays carry the same headers (either
// both with the echoed header, or the handler's SetHeader refuses it).
func TestAdvEchoedKeyHeaderIsReplayed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		key := metadata.ValueFromIncomingContext(ctx, idempotency.MetadataKey)[0]
		if err := grpc.SetHeader(ctx, metadata.Pairs(idempotency.MetadataKey, key, "grpc-shard", "7", "x-shard", "7")); err != nil {
			return nil, err
		}
		return wrapperspb.String("ok"), nil
	}})
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "echo-1")
	get := func() (metadata.MD, metadata.MD) {
		var header, trailer metadata.MD
		require.NoError(t, e.conn.Invoke(ctx, methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{}, grpc.Header(&header), grpc.Trailer(&trailer)))
		return header, trailer
	}
	h1, _ := get()
	h2, t2 := get()
	require.Equal(t, []string{"true"}, t2.Get(idempotency.ReplayedTrailer), "the second call is a replay")
	require.Equal(t, []string{"7"}, h2.Get("x-shard"), "ordinary headers are replayed")
	for _, name := range []string{idempotency.MetadataKey, "grpc-shard"} {
		require.Equal(t, h1.Get(name), h2.Get(name), "header %q: the first call had %q, its replay %q", name, h1.Get(name), h2.Get(name))
	}
}
