package idempotency_test

import (
	"bytes"
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

	"github.com/exactlyonce/idempotency"
)

// mapService serves /dynmap.v1.Receipts/Issue, described at run time: the
// response has a map field, whose entries protobuf marshals in random order
// unless told to be deterministic. outer, an interceptor outside the key
// interceptor, records what it sees of each response.
func mapService(t *testing.T, e *env, entries int, outer func(resp any)) string {
	t.Helper()
	str := func(name string, n int32) *descriptorpb.FieldDescriptorProto {
		return &descriptorpb.FieldDescriptorProto{Name: proto.String(name), Number: proto.Int32(n),
			Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum(), Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum()}
	}
	lines := &descriptorpb.FieldDescriptorProto{Name: proto.String("lines"), Number: proto.Int32(2),
		Type: descriptorpb.FieldDescriptorProto_TYPE_MESSAGE.Enum(), Label: descriptorpb.FieldDescriptorProto_LABEL_REPEATED.Enum(),
		TypeName: proto.String(".dynmap.v1.Receipt.LinesEntry")}
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("dynmap/v1/receipts.proto"), Package: proto.String("dynmap.v1"), Syntax: proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{
			{Name: proto.String("Req"), Field: []*descriptorpb.FieldDescriptorProto{str("note", 1)}},
			{Name: proto.String("Receipt"), Field: []*descriptorpb.FieldDescriptorProto{str("id", 1), lines},
				NestedType: []*descriptorpb.DescriptorProto{{Name: proto.String("LinesEntry"),
					Field:   []*descriptorpb.FieldDescriptorProto{str("key", 1), str("value", 2)},
					Options: &descriptorpb.MessageOptions{MapEntry: proto.Bool(true)}}}},
		},
		Service: []*descriptorpb.ServiceDescriptorProto{{Name: proto.String("Receipts"), Method: []*descriptorpb.MethodDescriptorProto{{
			Name: proto.String("Issue"), InputType: proto.String(".dynmap.v1.Req"), OutputType: proto.String(".dynmap.v1.Receipt"),
		}}}},
	}, nil)
	require.NoError(t, err)
	reqDesc, respDesc := fd.Messages().ByName("Req"), fd.Messages().ByName("Receipt")
	icpt := idempotency.UnaryServerInterceptor(e.store)
	info := &grpc.UnaryServerInfo{FullMethod: "/dynmap.v1.Receipts/Issue"}
	srv := grpc.NewServer()
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: "dynmap.v1.Receipts", HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{MethodName: "Issue", Handler: func(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
			req := dynamicpb.NewMessage(reqDesc)
			if err := dec(req); err != nil {
				return nil, err
			}
			resp, err := icpt(ctx, req, info, func(ctx context.Context, req any) (any, error) {
				e.runs.Add(1)
				out := dynamicpb.NewMessage(respDesc)
				out.Set(respDesc.Fields().ByName("id"), protoreflect.ValueOfString("r-1"))
				m := out.Mutable(respDesc.Fields().ByName("lines")).Map()
				for i := range entries {
					m.Set(protoreflect.ValueOfString(fmt.Sprintf("line-%02d", i)).MapKey(), protoreflect.ValueOfString(fmt.Sprint(i)))
				}
				return out, nil
			})
			if err == nil {
				outer(resp)
			}
			return resp, err
		}}},
	}, struct{}{})
	return serve(t, srv)
}

// The first response and every replay are the same bytes on the wire, even
// for a response with a map, and they are the stored bytes; an interceptor
// outside still reads the response as a message of its declared type.
func TestGRPCReplayIsByteIdenticalWithMaps(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	const entries = 32
	var seen []proto.Message
	addr := mapService(t, e, entries, func(resp any) { seen = append(seen, resp.(proto.Message)) })
	conn := dial(t, addr)
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "receipt-1")
	req := rawMessage(nil) // Req{}: the empty message
	raws, stored := rawAnswers(t, e, conn, ctx, "/dynmap.v1.Receipts/Issue", &req, "receipt-1", 6)
	for i, raw := range raws {
		require.Equal(t, stored, raw, "response %d is the stored bytes (0 is the first call's)", i)
	}
	require.Len(t, seen, 6)
	for _, m := range seen {
		r := m.ProtoReflect()
		require.EqualValues(t, "dynmap.v1.Receipt", r.Descriptor().FullName())
		require.Equal(t, entries, r.Get(r.Descriptor().Fields().ByName("lines")).Map().Len(), "the outer interceptor reads every entry")
		b, err := proto.Marshal(m)
		require.NoError(t, err)
		require.Equal(t, stored, b, "marshalled outside, it is the stored bytes too")
	}
}

// rawAnswers sends req n times under key (in ctx) and returns the bytes of
// each answer as they came off the wire, and the response stored for the
// key; the handler must have run once.
func rawAnswers(t *testing.T, e *env, conn *grpc.ClientConn, ctx context.Context, method string, req *rawMessage, key string, n int) (raws [][]byte, stored []byte) {
	t.Helper()
	for range n {
		var out rawMessage
		require.NoError(t, conn.Invoke(ctx, method, req, &out, grpc.ForceCodecV2(rawCodec{})))
		raws = append(raws, out)
	}
	require.EqualValues(t, 1, e.runs.Load(), "one run, the rest replays")
	require.NoError(t, e.db.Pool.QueryRow(context.Background(), `SELECT response FROM idempotency_keys WHERE key = $1`, key).Scan(&stored))
	return raws, stored
}

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
func TestOuterEditOfMapResponseReachesTheClient(t *testing.T) {
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
