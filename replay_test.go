package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// A replay gives the client what the first call gave it: the response or
// error, and the headers and trailers the handler set.

func TestHeadersAndTrailersAreReplayed(t *testing.T) {
	t.Parallel()
	var e *env
	e = newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		resp, err := e.insertLedger(ctx, req)
		if err != nil {
			return nil, err
		}
		if err := grpc.SetHeader(ctx, metadata.Pairs("x-charge-id", "ch_"+req.GetValue(), "x-multi", "1", "x-multi", "2")); err != nil {
			return nil, err
		}
		if err := grpc.SetTrailer(ctx, metadata.Pairs("x-ledger-entry", resp.GetValue(), "x-trace-bin", "\x00\xff")); err != nil {
			return nil, err
		}
		switch req.GetValue() {
		case "declined":
			return nil, status.Error(codes.FailedPrecondition, "card declined")
		case "huge":
			_ = grpc.SetHeader(ctx, metadata.Pairs("x-huge", strings.Repeat("h", idempotency.MaxStoredMetadata)))
		}
		return resp, nil
	}})
	call := func(key, body string) (metadata.MD, metadata.MD, error) {
		var header, trailer metadata.MD
		ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, key)
		err := e.conn.Invoke(ctx, methodCharge, wrapperspb.String(body), &wrapperspb.StringValue{}, grpc.Header(&header), grpc.Trailer(&trailer))
		return header, trailer, err
	}
	for _, body := range []string{"ok", "declined"} {
		h1, t1, err1 := call("k-"+body, body)
		h2, t2, err2 := call("k-"+body, body)
		require.Equal(t, status.Code(err1), status.Code(err2), body)
		require.Equal(t, []string{"ch_" + body}, h2.Get("x-charge-id"), "%s: the header is replayed", body)
		require.Equal(t, []string{"1", "2"}, h2.Get("x-multi"), "%s: every value, in order", body)
		require.Equal(t, t1.Get("x-ledger-entry"), t2.Get("x-ledger-entry"), "%s: the trailer is replayed", body)
		require.NotEmpty(t, t2.Get("x-ledger-entry"))
		require.Equal(t, []string{"\x00\xff"}, t2.Get("x-trace-bin"), "%s: binary values too", body)
		require.Equal(t, []string{"true"}, t2.Get(idempotency.ReplayedTrailer))
		require.Empty(t, t1.Get(idempotency.ReplayedTrailer))
		require.Equal(t, h1.Get("x-charge-id"), h2.Get("x-charge-id"))
	}
	require.EqualValues(t, 2, e.runs.Load())

	_, _, err := call("k-huge", "huge")
	require.Equal(t, codes.Internal, status.Code(err))
	require.Contains(t, err.Error(), "MaxStoredMetadata")
	require.Equal(t, "", e.keyState("k-huge"), "nothing half-stored")
	require.Equal(t, 1, e.ledgerRows(), "the ok charge's write alone: the declined one rolled back (a final error), the huge one with its unstored result")
}

// dynamicService serves /dyn.v1.Payments/Charge from descriptors built at
// run time and never registered globally, as a gateway or proxy might: the
// request is dyn.v1.Req and the response the message named resp.
func dynamicService(t *testing.T, e *env, resp string) (protoreflect.MessageDescriptor, protoreflect.MessageDescriptor, string) {
	t.Helper()
	str := func(name string, n int32) *descriptorpb.FieldDescriptorProto {
		return &descriptorpb.FieldDescriptorProto{Name: proto.String(name), Number: proto.Int32(n),
			Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum(), Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum()}
	}
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("dyn/v1/payments.proto"), Package: proto.String("dyn.v1"), Syntax: proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{
			{Name: proto.String("Req"), Field: []*descriptorpb.FieldDescriptorProto{str("note", 1)}},
			{Name: proto.String(resp), Field: []*descriptorpb.FieldDescriptorProto{str("charge_id", 1)}},
		},
		Service: []*descriptorpb.ServiceDescriptorProto{{Name: proto.String("Payments"), Method: []*descriptorpb.MethodDescriptorProto{{
			Name: proto.String("Charge"), InputType: proto.String(".dyn.v1.Req"), OutputType: proto.String(".dyn.v1." + resp),
		}}}},
	}, nil)
	require.NoError(t, err)
	reqDesc, respDesc := fd.Messages().ByName("Req"), fd.Messages().ByName(protoreflect.Name(resp))
	icpt := idempotency.UnaryServerInterceptor(e.store)
	srv := grpc.NewServer()
	srv.RegisterService(&grpc.ServiceDesc{
		ServiceName: "dyn.v1.Payments", HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{MethodName: "Charge", Handler: func(_ any, ctx context.Context, dec func(any) error, _ grpc.UnaryServerInterceptor) (any, error) {
			req := dynamicpb.NewMessage(reqDesc)
			if err := dec(req); err != nil {
				return nil, err
			}
			return icpt(ctx, req, &grpc.UnaryServerInfo{FullMethod: "/dyn.v1.Payments/Charge"}, func(ctx context.Context, req any) (any, error) {
				e.runs.Add(1)
				out := dynamicpb.NewMessage(respDesc)
				note := req.(proto.Message).ProtoReflect().Get(reqDesc.Fields().ByName("note")).String()
				out.Set(respDesc.Fields().ByName("charge_id"), protoreflect.ValueOfString("ch_"+note))
				return out, nil
			})
		}}},
	}, struct{}{})
	return reqDesc, respDesc, serve(t, srv)
}

// A response type linked into no binary (dynamicpb) is replayed with the
// type the method declares.
func TestDynamicResponseIsReplayed(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	reqDesc, respDesc, addr := dynamicService(t, e, "Receipt")
	conn := dial(t, addr)
	req := dynamicpb.NewMessage(reqDesc)
	req.Set(reqDesc.Fields().ByName("note"), protoreflect.ValueOfString("dyn"))
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "k")
	var raws [][]byte
	for range 2 {
		resp := dynamicpb.NewMessage(respDesc)
		var trailer metadata.MD
		require.NoError(t, conn.Invoke(ctx, "/dyn.v1.Payments/Charge", req, resp, grpc.Trailer(&trailer)))
		b, err := proto.Marshal(resp)
		require.NoError(t, err)
		raws = append(raws, b)
		require.Equal(t, "ch_dyn", resp.Get(respDesc.Fields().ByName("charge_id")).String())
	}
	require.Equal(t, raws[0], raws[1])
	require.EqualValues(t, 1, e.runs.Load(), "the second call was a replay")
}

// A deploy changed the method's response type: the stored response of the
// old type is refused with a clear error, never decoded as the new type.
func TestResponseTypeChangedBetweenDeploys(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	reqOld, respOld, oldAddr := dynamicService(t, e, "Receipt")
	reqNew, respNew, newAddr := dynamicService(t, e, "ReceiptV2")
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "k")
	send := func(addr string, reqDesc, respDesc protoreflect.MessageDescriptor) error {
		req := dynamicpb.NewMessage(reqDesc)
		req.Set(reqDesc.Fields().ByName("note"), protoreflect.ValueOfString("x"))
		return dial(t, addr).Invoke(ctx, "/dyn.v1.Payments/Charge", req, dynamicpb.NewMessage(respDesc))
	}
	require.NoError(t, send(oldAddr, reqOld, respOld))
	err := send(newAddr, reqNew, respNew)
	require.Equal(t, codes.Internal, status.Code(err))
	require.Contains(t, status.Convert(err).Message(), "is a dyn.v1.Receipt, but /dyn.v1.Payments/Charge now returns dyn.v1.ReceiptV2")
	require.EqualValues(t, 1, e.runs.Load())
}

// A run whose key turns out to hold another writer's result (the primary key
// refused its row) sends nothing of its own: the client gets the stored
// result and only its headers.
func TestRolledBackRunSendsNoHeaders(t *testing.T) {
	t.Parallel()
	committed, settled := make(chan struct{}), make(chan struct{})
	e := newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		if err := grpc.SetHeader(ctx, metadata.Pairs("x-run", "rolled back")); err != nil {
			return nil, err
		}
		if err := grpc.SetTrailer(ctx, metadata.Pairs("x-run-trailer", "rolled back")); err != nil {
			return nil, err
		}
		// The handler commits the claim itself, and a duplicate settles
		// the key before this run returns: the key's answer is the
		// duplicate's, stored, not this run's.
		if _, err := idempotency.MustTxFromContext(ctx).Conn().Exec(ctx, `COMMIT`); err != nil {
			return nil, err
		}
		close(committed)
		<-settled
		return wrapperspb.String("mine"), nil
	}})
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, "k")
	type answer struct {
		err             error
		header, trailer metadata.MD
	}
	first := make(chan answer, 1)
	go func() {
		var a answer
		a.err = e.conn.Invoke(ctx, methodCharge, wrapperspb.String("x"), &wrapperspb.StringValue{}, grpc.Header(&a.header), grpc.Trailer(&a.trailer))
		first <- a
	}()
	<-committed
	dup := invoke(ctx, e.conn, methodCharge, "x")
	close(settled)
	require.Equal(t, codes.Internal, status.Code(dup.err), "%v", dup.err)
	a := await(t, first, "the first call")
	require.Equal(t, status.Convert(dup.err).Proto(), status.Convert(a.err).Proto(), "one answer for both")
	require.Empty(t, a.header.Get("x-run"), "the rolled-back run's header was not sent")
	require.Empty(t, a.trailer.Get("x-run-trailer"))
	require.Equal(t, []string{"true"}, a.trailer.Get(idempotency.ReplayedTrailer))
}

// flatService serves /advflat.v1.Orders/Place, a service built at run
// time (dynamicpb) whose response has no map, only fields string f1..f<n>,
// all set. The key interceptor is installed on the server as usual.
func flatService(t *testing.T, e *env, fields int) string {
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
func TestDynamicResponseIsTheStoredBytes(t *testing.T) {
	t.Parallel()
	e := newEnv(t, envConfig{})
	conn := dial(t, flatService(t, e, 12))
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
func TestEchoedKeyHeaderIsReplayed(t *testing.T) {
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

// A service mesh resends a request exactly as it was first sent, markers
// included: a finished key must replay, and the handler (whose second run
// would fail on its own unique constraint, or call a payment provider
// again) must not run.
func TestProxyResendOfAFinishedCallNeverRunsTheHandler(t *testing.T) {
	t.Parallel()
	var e *env
	e = newEnv(t, envConfig{handler: func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		// One charge per order: a second run fails on the unique index.
		if _, err := idempotency.MustTxFromContext(ctx).Exec(ctx, `INSERT INTO charges (order_id) VALUES ($1)`, req.GetValue()); err != nil {
			return nil, err
		}
		return e.insertLedger(ctx, req)
	}})
	_, err := e.db.Pool.Exec(context.Background(), `CREATE TABLE charges (order_id text PRIMARY KEY)`)
	require.NoError(t, err)
	// As a client of the previous release sent its generated keys.
	sent := metadata.Pairs(idempotency.MetadataKey, "k", "idempotency-key-new", "true", "x-request-id", "r-1")
	ctx := metadata.NewOutgoingContext(context.Background(), sent)
	first := invoke(ctx, e.conn, methodCharge, "order-1")
	require.NoError(t, first.err)
	for i := 0; i < 3; i++ {
		again := invoke(ctx, e.conn, methodCharge, "order-1")
		require.NoError(t, again.err, "the stored success, not the handler's second-run error")
		require.True(t, again.replayed)
		require.Equal(t, first.raw, again.raw)
	}
	require.EqualValues(t, 1, e.runs.Load(), "the handler ran once")
	require.Equal(t, 1, e.ledgerRows())
}

// A response whose type this process does not know (a dynamic message, a
// service whose descriptors are registered nowhere) replays its bytes
// exactly, through Execute and through gRPC.
func TestUnknownResponseTypeReplaysItsBytes(t *testing.T) {
	t.Parallel()
	receipt := unregisteredReceiptType(t)
	newReceipt := func(v string) proto.Message {
		m := dynamicpb.NewMessage(receipt)
		m.Set(receipt.Fields().ByName("value"), protoreflect.ValueOfString(v))
		return m
	}
	e := newEnv(t, envConfig{})
	ctx := context.Background()

	res, err := e.store.Execute(ctx, idempotency.Call{Key: "d", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) { return newReceipt("paid"), nil })
	require.NoError(t, err)
	want, err := proto.Marshal(res.Response)
	require.NoError(t, err)
	again, err := e.store.Execute(ctx, idempotency.Call{Key: "d", Method: "m"}, func(context.Context, pgx.Tx) (proto.Message, error) { return nil, errors.New("ran") })
	require.NoError(t, err)
	require.Equal(t, idempotency.OutcomeReplayed, again.Outcome)
	require.Equal(t, "idempotency.test.unregistered.Receipt", string(again.Response.ProtoReflect().Descriptor().FullName()))
	got, err := proto.Marshal(again.Response)
	require.NoError(t, err)
	require.Equal(t, want, got, "the stored bytes, exactly")

	// Through gRPC: a hand-written service (no descriptor registered)
	// whose handler answers with the dynamic type.
	var runs atomic.Int64
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(e.store)))
	desc := ledgerDesc()
	desc.ServiceName = "idempotency.test.Unregistered"
	desc.Methods = desc.Methods[:1]
	desc.Methods[0].Handler = func(srv any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
		req := &wrapperspb.StringValue{}
		if err := dec(req); err != nil {
			return nil, err
		}
		info := &grpc.UnaryServerInfo{Server: srv, FullMethod: "/idempotency.test.Unregistered/Charge"}
		return icpt(ctx, req, info, func(context.Context, any) (any, error) {
			runs.Add(1)
			return newReceipt("charged " + req.GetValue()), nil
		})
	}
	srv.RegisterService(desc, &ledger{})
	conn := dial(t, serve(t, srv))
	kctx := metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, "g")
	r1 := invoke(kctx, conn, "/idempotency.test.Unregistered/Charge", "x")
	require.NoError(t, r1.err)
	require.Equal(t, "charged x", r1.resp.GetValue(), "the receipt's bytes read as the client's type")
	r2 := invoke(kctx, conn, "/idempotency.test.Unregistered/Charge", "x")
	require.NoError(t, r2.err, "replayed, not Internal 'not linked into this binary'")
	require.True(t, r2.replayed)
	require.Equal(t, r1.raw, r2.raw)
	require.EqualValues(t, 1, runs.Load())
}

// unregisteredReceiptType is a message type registered nowhere:
// idempotency.test.unregistered.Receipt {string value = 1}, the wire
// shape of a StringValue.
func unregisteredReceiptType(t *testing.T) protoreflect.MessageDescriptor {
	t.Helper()
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name:    proto.String("idempotency/test/unregistered.proto"),
		Package: proto.String("idempotency.test.unregistered"),
		Syntax:  proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{{
			Name: proto.String("Receipt"),
			Field: []*descriptorpb.FieldDescriptorProto{{
				Name: proto.String("value"), Number: proto.Int32(1), JsonName: proto.String("value"),
				Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum(), Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum(),
			}},
		}},
	}, new(protoregistry.Files))
	require.NoError(t, err)
	return fd.Messages().Get(0)
}
