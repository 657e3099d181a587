package idempotency_test

import (
	"context"
	"errors"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	idempotencyv1 "github.com/exactlyonce/idempotency/proto/idempotency/v1"
)

// The streaming test service idempotency.test.Uploads, described in the
// global registry as generated code would: Upload (client streaming) is
// annotated MODE_REQUIRED, Watch (server streaming) is not annotated, and
// Tail (server streaming) is MODE_DISABLED.
const (
	methodUpload = "/idempotency.test.Uploads/Upload"
	methodWatch  = "/idempotency.test.Uploads/Watch"
	methodTail   = "/idempotency.test.Uploads/Tail"
)

func init() {
	policy := func(mode idempotencyv1.MethodPolicy_Mode) *descriptorpb.MethodOptions {
		opts := &descriptorpb.MethodOptions{}
		proto.SetExtension(opts, idempotencyv1.E_Method, &idempotencyv1.MethodPolicy{Mode: mode})
		return opts
	}
	method := func(name string, client, server bool, opts *descriptorpb.MethodOptions) *descriptorpb.MethodDescriptorProto {
		return &descriptorpb.MethodDescriptorProto{
			Name: proto.String(name), InputType: proto.String(".google.protobuf.StringValue"),
			OutputType: proto.String(".google.protobuf.StringValue"), Options: opts,
			ClientStreaming: proto.Bool(client), ServerStreaming: proto.Bool(server),
		}
	}
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name:       proto.String("idempotency/test/uploads.proto"),
		Package:    proto.String("idempotency.test"),
		Dependency: []string{"google/protobuf/wrappers.proto", idempotencyv1.File_idempotency_v1_idempotency_proto.Path()},
		Syntax:     proto.String("proto3"),
		Service: []*descriptorpb.ServiceDescriptorProto{{
			Name: proto.String("Uploads"),
			Method: []*descriptorpb.MethodDescriptorProto{
				method("Upload", true, false, policy(idempotencyv1.MethodPolicy_MODE_REQUIRED)),
				method("Watch", false, true, nil),
				method("Tail", false, true, policy(idempotencyv1.MethodPolicy_MODE_DISABLED)),
			},
		}},
	}, protoregistry.GlobalFiles)
	if err != nil {
		panic(err)
	}
	if err := protoregistry.GlobalFiles.RegisterFile(fd); err != nil {
		panic(err)
	}
}

// uploadsDesc serves the streaming test service: Upload writes one ledger
// row for the whole stream; Watch and Tail send back what they got.
func uploadsDesc(e *env, runs *atomic.Int64) *grpc.ServiceDesc {
	echo := func(_ any, ss grpc.ServerStream) error {
		runs.Add(1)
		in := &wrapperspb.StringValue{}
		if err := ss.RecvMsg(in); err != nil {
			return err
		}
		return ss.SendMsg(in)
	}
	return &grpc.ServiceDesc{
		ServiceName: "idempotency.test.Uploads",
		HandlerType: (*any)(nil),
		Streams: []grpc.StreamDesc{
			{StreamName: "Upload", ClientStreams: true, Handler: func(_ any, ss grpc.ServerStream) error {
				runs.Add(1)
				n := 0
				for {
					err := ss.RecvMsg(&wrapperspb.StringValue{})
					if errors.Is(err, io.EOF) {
						break
					}
					if err != nil {
						return err
					}
					n++
				}
				if _, err := e.db.Pool.Exec(ss.Context(), `INSERT INTO ledger (note) VALUES ('upload')`); err != nil {
					return err
				}
				return ss.SendMsg(wrapperspb.String("uploaded"))
			}},
			{StreamName: "Watch", ServerStreams: true, Handler: echo},
			{StreamName: "Tail", ServerStreams: true, Handler: echo},
		},
	}
}

// stream makes one streaming call of method with key in the metadata
// (pairs, may be empty) and returns its error.
func stream(ctx context.Context, conn *grpc.ClientConn, method string, client bool, pairs ...string) error {
	ctx = metadata.AppendToOutgoingContext(ctx, pairs...)
	cs, err := conn.NewStream(ctx, &grpc.StreamDesc{ClientStreams: client, ServerStreams: !client}, method)
	if err != nil {
		return err
	}
	if err := cs.SendMsg(wrapperspb.String("part")); err != nil && !errors.Is(err, io.EOF) {
		return err
	}
	if err := cs.CloseSend(); err != nil {
		return err
	}
	return cs.RecvMsg(&wrapperspb.StringValue{})
}

// A streaming method annotated to need a key is refused loudly, at startup
// and on every call, whether or not the call carries a key: the package
// cannot protect it, and passing it through would run every duplicate.
// Keys on other streaming calls are refused too; a streaming call without
// annotation or key passes untouched.
func TestGRPCStreamingMethodsAskingForKeysAreRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	var runs atomic.Int64
	srv := grpc.NewServer(
		grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(e.store, idempotency.WithKeyRequired())),
		grpc.ChainStreamInterceptor(idempotency.StreamServerInterceptor(e.store, idempotency.WithKeyRequired())),
	)
	srv.RegisterService(uploadsDesc(e, &runs), struct{}{})
	srv.RegisterService(ledgerDesc(), &ledger{handler: e.insertLedger})

	err := idempotency.CheckStreamingMethods(srv)
	require.ErrorIs(t, err, idempotency.ErrStreamingUnsupported)
	require.Contains(t, err.Error(), methodUpload)
	require.NotContains(t, err.Error(), methodWatch)
	require.NotContains(t, err.Error(), methodTail)
	require.NoError(t, idempotency.CheckStreamingMethods(e.srv), "a server without annotated streaming methods passes")

	conn := dial(t, serve(t, srv))
	ctx := context.Background()
	for _, c := range []struct {
		what   string
		method string
		client bool
		md     []string
	}{
		{"annotated, no key", methodUpload, true, nil},
		{"annotated, a key", methodUpload, true, []string{idempotency.MetadataKey, "upload-1"}},
		{"annotated, the same key again", methodUpload, true, []string{idempotency.MetadataKey, "upload-1"}},
		{"not annotated, a key", methodWatch, false, []string{idempotency.MetadataKey, "watch-1"}},
		{"not annotated, a binary key", methodWatch, false, []string{idempotency.MetadataKey + "-bin", "watch-1"}},
	} {
		err := stream(ctx, conn, c.method, c.client, c.md...)
		require.Equal(t, codes.Unimplemented, status.Code(err), "%s: %v", c.what, err)
		var reason string
		for _, d := range status.Convert(err).Details() {
			if ei, ok := d.(*errdetails.ErrorInfo); ok && ei.GetDomain() == idempotency.ErrorDomain {
				reason = ei.GetReason()
			}
		}
		require.Equal(t, "STREAMING_UNSUPPORTED", reason, c.what)
		require.Contains(t, status.Convert(err).Message(), c.method, c.what)
	}
	require.Zero(t, runs.Load(), "no refused call reached its handler")
	require.Zero(t, e.ledgerRows())

	require.NoError(t, stream(ctx, conn, methodWatch, false), "not annotated, no key: untouched")
	require.NoError(t, stream(ctx, conn, methodTail, false, idempotency.MetadataKey, "tail-1"), "MODE_DISABLED: the key is ignored")
	require.EqualValues(t, 2, runs.Load())
	require.Zero(t, e.keyRows())
}

// README, Client: "WithOutgoingKey returns a context whose outgoing calls
// use key as their idempotency key", and "streaming calls go through
// untouched (and a key on one is refused by the server)". A key chosen with
// WithOutgoingKey on a streaming call through the library's own client
// chain is neither sent nor refused: there is no stream client
// interceptor, so the key is dropped silently, the server sees a keyless
// stream of an unannotated method and runs it, and the application's
// "retry with the same key" of that stream runs the handler a second time
// with no error anywhere.
//
// Correct: a streaming call whose context names a key is refused (on the
// client, or by sending the key so the server refuses it with
// STREAMING_UNSUPPORTED); it never runs twice unnoticed.
func TestStreamWithOutgoingKeyIsRefused(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	var runs atomic.Int64
	srv := grpc.NewServer(
		grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(e.store)),
		grpc.ChainStreamInterceptor(idempotency.StreamServerInterceptor(e.store)),
	)
	srv.RegisterService(uploadsDesc(e, &runs), struct{}{})
	conn, err := grpc.NewClient("passthrough:///"+serve(t, srv),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })

	ctx := idempotency.WithOutgoingKey(context.Background(), "watch-order-1001")
	var errs []error
	for range 2 { // the call and the application's retry with the same key
		errs = append(errs, stream(ctx, conn, methodWatch, false))
	}
	require.EqualValues(t, 0, runs.Load(), "a stream with a chosen key ran %d times; errors %v", runs.Load(), errs)
}

// README, Server: streaming calls whose method the (idempotency.v1.method)
// option annotates are refused (Unimplemented, STREAMING_UNSUPPORTED), and
// CheckStreamingMethods names them at startup; the descriptor of a
// service built at run time is the one in the file of its request type.
// For a run-time (dynamicpb) service the stream interceptor and
// CheckStreamingMethods read the global registry only, so an annotated
// MODE_REQUIRED client-streaming method is not seen: CheckStreamingMethods
// reports nothing and every keyless call passes to its handler, each
// duplicate running again, where the unary interceptor would refuse it.
//
// Correct: the keyless call is refused before the handler can act on its
// request. The request's descriptor, and with it the method's policy, is
// known only once the handler reads the first message, so the stream
// interceptor refuses it there: that RecvMsg fails with
// STREAMING_UNSUPPORTED (CheckStreamingMethods, which sees only what the
// global registry holds, cannot name such a method at startup).
func TestRuntimeAnnotatedStreamIsRefusedAtItsFirstMessage(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	fd := buildFile(&descriptorpb.FileDescriptorProto{
		Name:       proto.String("advstream/v1/feed.proto"),
		Package:    proto.String("advstream.v1"),
		Syntax:     proto.String("proto3"),
		Dependency: []string{idempotencyv1.File_idempotency_v1_idempotency_proto.Path()},
		MessageType: []*descriptorpb.DescriptorProto{{Name: proto.String("Part"), Field: []*descriptorpb.FieldDescriptorProto{
			rtField("data", 1, descriptorpb.FieldDescriptorProto_TYPE_STRING)}}},
		Service: []*descriptorpb.ServiceDescriptorProto{{Name: proto.String("Feed"), Method: []*descriptorpb.MethodDescriptorProto{{
			Name: proto.String("Push"), InputType: proto.String(".advstream.v1.Part"), OutputType: proto.String(".advstream.v1.Part"),
			ClientStreaming: proto.Bool(true),
			Options:         withPolicy(&idempotencyv1.MethodPolicy{Mode: idempotencyv1.MethodPolicy_MODE_REQUIRED}),
		}}}},
	}, false)
	part := fd.Messages().ByName("Part")
	var runs atomic.Int64
	srv := grpc.NewServer(grpc.ChainStreamInterceptor(idempotency.StreamServerInterceptor(e.store, idempotency.WithKeyRequired())))
	srv.RegisterService(&grpc.ServiceDesc{ServiceName: "advstream.v1.Feed", HandlerType: (*any)(nil), Streams: []grpc.StreamDesc{{
		StreamName: "Push", ClientStreams: true, Handler: func(_ any, ss grpc.ServerStream) error {
			for {
				m := dynamicpb.NewMessage(part)
				if err := ss.RecvMsg(m); errors.Is(err, io.EOF) {
					break
				} else if err != nil {
					return err
				}
				runs.Add(1) // the handler's effect of each part it reads
			}
			return ss.SendMsg(dynamicpb.NewMessage(part))
		}}}}, struct{}{})
	checkErr := idempotency.CheckStreamingMethods(srv)
	conn := dial(t, serve(t, srv))
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var codesSeen []codes.Code
	for range 2 {
		cs, err := conn.NewStream(ctx, &grpc.StreamDesc{ClientStreams: true}, "/advstream.v1.Feed/Push")
		require.NoError(t, err)
		_ = cs.SendMsg(dynamicpb.NewMessage(part))
		_ = cs.CloseSend()
		codesSeen = append(codesSeen, status.Code(cs.RecvMsg(&wrapperspb.StringValue{})))
	}
	require.Equal(t, []codes.Code{codes.Unimplemented, codes.Unimplemented}, codesSeen)
	require.Zero(t, runs.Load(), "an annotated (MODE_REQUIRED) run-time streaming method ran %d times without a key (codes %v; CheckStreamingMethods said %v)", runs.Load(), codesSeen, checkErr)
}
