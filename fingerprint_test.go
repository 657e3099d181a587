package idempotency_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/mem"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"
	"google.golang.org/protobuf/types/known/anypb"
	"google.golang.org/protobuf/types/known/structpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// Requests whose schema changes between a call and its retry: two releases
// of one service, each a gRPC server with its own request schema (built at
// run time, as two builds of the service would have it generated) and its
// own store on one shared database, as replicas mid-deploy are. Clients
// send bytes exactly as given, as a client of any version would.

const methodPay = "/idempotency.test.Pay/Charge"

// payField declares one field of a request schema.
type payField struct {
	name     string
	number   int32
	kind     descriptorpb.FieldDescriptorProto_Type
	typeName string // for messages
	optional bool   // proto3 explicit presence
}

// paySchema builds the request message "idempotency.test.PayRequest" of
// one release of the service, in a file of its own (each release is a
// separate build, so nothing is registered globally).
func paySchema(t *testing.T, syntax string, fields []payField, extensionRanges bool, deps ...string) protoreflect.MessageDescriptor {
	t.Helper()
	msg := &descriptorpb.DescriptorProto{Name: proto.String("PayRequest")}
	for _, f := range fields {
		fdp := &descriptorpb.FieldDescriptorProto{
			Name: proto.String(f.name), Number: proto.Int32(f.number), Type: f.kind.Enum(),
			Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum(), JsonName: proto.String(f.name),
		}
		if f.typeName != "" {
			fdp.TypeName = proto.String(f.typeName)
		}
		if f.optional {
			fdp.Proto3Optional = proto.Bool(true)
			fdp.OneofIndex = proto.Int32(int32(len(msg.OneofDecl)))
			msg.OneofDecl = append(msg.OneofDecl, &descriptorpb.OneofDescriptorProto{Name: proto.String("_" + f.name)})
		}
		msg.Field = append(msg.Field, fdp)
	}
	if extensionRanges {
		msg.ExtensionRange = []*descriptorpb.DescriptorProto_ExtensionRange{{Start: proto.Int32(100), End: proto.Int32(200)}}
	}
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("idempotency/test/pay.proto"), Package: proto.String("idempotency.test"),
		Syntax: proto.String(syntax), Dependency: deps, MessageType: []*descriptorpb.DescriptorProto{msg},
	}, protoregistry.GlobalFiles)
	require.NoError(t, err)
	return fd.Messages().Get(0)
}

// payServer serves methodPay with requests decoded as md, on a store of its
// own on db's schema. The handler writes one ledger row naming the call's
// key and answers "charged <amount>#<row>" (or the request in text when it
// has no amount). opts are the server's (a codec, say).
func payServer(t *testing.T, schema string, md protoreflect.MessageDescriptor, opts ...grpc.ServerOption) *grpc.ClientConn {
	t.Helper()
	store, err := idempotency.NewStore(schemaPool(t, schema, 4, nil))
	require.NoError(t, err)
	handler := func(ctx context.Context, req proto.Message) (*wrapperspb.StringValue, error) {
		note := fmt.Sprint(req)
		if fd := md.Fields().ByName("amount"); fd != nil {
			note = fmt.Sprint("charged ", req.ProtoReflect().Get(fd).Int())
		}
		tx := idempotency.MustTxFromContext(ctx)
		key := metadata.ValueFromIncomingContext(ctx, idempotency.MetadataKey)[0]
		var id int64
		if err := tx.QueryRow(ctx, `INSERT INTO ledger (note, key) VALUES ($1, $2) RETURNING id`, note, key).Scan(&id); err != nil {
			return nil, err
		}
		return wrapperspb.String(fmt.Sprintf("%s#%d", note, id)), nil
	}
	return servePay(t, store, md, func(ctx context.Context, req proto.Message) (any, error) { return handler(ctx, req) }, opts...)
}

// servePay serves methodPay, its requests decoded as md, behind the
// server interceptor on store, and returns a connection to it.
func servePay(t *testing.T, store *idempotency.Store, md protoreflect.MessageDescriptor, handler func(context.Context, proto.Message) (any, error), opts ...grpc.ServerOption) *grpc.ClientConn {
	t.Helper()
	desc := &grpc.ServiceDesc{
		ServiceName: "idempotency.test.Pay",
		HandlerType: (*any)(nil),
		Methods: []grpc.MethodDesc{{MethodName: "Charge", Handler: func(_ any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
			req := dynamicpb.NewMessage(md)
			if err := dec(req); err != nil {
				return nil, err
			}
			return icpt(ctx, req, &grpc.UnaryServerInfo{FullMethod: methodPay}, func(ctx context.Context, req any) (any, error) {
				return handler(ctx, req.(proto.Message))
			})
		}}},
	}
	srv := grpc.NewServer(append([]grpc.ServerOption{grpc.UnaryInterceptor(idempotency.UnaryServerInterceptor(store))}, opts...)...)
	srv.RegisterService(desc, struct{}{})
	return dial(t, serve(t, srv))
}

// sendRaw sends body as the request, byte for byte, with key.
func sendRaw(conn *grpc.ClientConn, key string, body []byte) reply {
	var trailer metadata.MD
	ctx := metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, key)
	req, out := rawMessage(body), rawMessage(nil)
	err := conn.Invoke(ctx, methodPay, &req, &out, grpc.ForceCodecV2(rawCodec{}), grpc.Trailer(&trailer))
	r := reply{err: err, raw: out, replayed: len(trailer.Get(idempotency.ReplayedTrailer)) == 1}
	if err == nil {
		r.resp = &wrapperspb.StringValue{}
		if uerr := proto.Unmarshal(out, r.resp); uerr != nil {
			r.err = uerr
		}
	}
	return r
}

// requireReplayOf asserts that again is a replay of first, byte for byte.
func requireReplayOf(t *testing.T, first, again reply, what string) {
	t.Helper()
	require.NoError(t, again.err, "%s: a genuine retry must replay", what)
	require.True(t, again.replayed, "%s: replayed", what)
	require.Equal(t, first.raw, again.raw, "%s: the stored response, byte for byte", what)
}

func requireKeyReused(t *testing.T, r reply, what string) {
	t.Helper()
	require.Equal(t, codes.FailedPrecondition, status.Code(r.err), "%s: %v", what, r.err)
	require.Equal(t, "KEY_REUSED", errorReason(r.err), what)
}

// wire appends fields to a request encoding.
func varintField(b []byte, num protowire.Number, v uint64) []byte {
	return protowire.AppendVarint(protowire.AppendTag(b, num, protowire.VarintType), v)
}

func bytesField(b []byte, num protowire.Number, v []byte) []byte {
	return protowire.AppendBytes(protowire.AppendTag(b, num, protowire.BytesType), v)
}

// structInOrder encodes a google.protobuf.Struct of n entries ("k00": 0,
// "k01": 1, ...), with one entry's number replaced by changed when
// changed >= 0, its map entries in the given order, as Go's marshal does in
// whichever order its map yields them.
func structInOrder(t *testing.T, n int, order []int, changed float64) []byte {
	t.Helper()
	var b []byte
	for _, i := range order {
		v := float64(i)
		if i == 0 && changed >= 0 {
			v = changed
		}
		one, err := proto.MarshalOptions{Deterministic: true}.Marshal(&structpb.Struct{Fields: map[string]*structpb.Value{fmt.Sprintf("k%02d", i): structpb.NewNumberValue(v)}})
		require.NoError(t, err)
		b = append(b, one...) // one map entry: field 1 of Struct
	}
	require.Len(t, order, n)
	return b
}

// Item 5: the application rebuilds its request for the retry, packing a
// 16-entry Struct in an Any; Go encodes the map's entries in another
// order. The retry replays; a Struct with one value changed is another
// request.
func TestFingerprintAnyHoldingAMapRetriedReplays(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	md := paySchema(t, "proto3", []payField{{name: "payload", number: 1, kind: descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, typeName: ".google.protobuf.Any"}},
		false, "google/protobuf/any.proto")
	conn := payServer(t, db.Schema, md)
	request := func(order []int, changed float64) []byte {
		a, err := proto.Marshal(&anypb.Any{TypeUrl: "type.googleapis.com/google.protobuf.Struct", Value: structInOrder(t, 16, order, changed)})
		require.NoError(t, err)
		return bytesField(nil, 1, a)
	}
	forward, backward, shuffled := make([]int, 16), make([]int, 16), make([]int, 16)
	for i := range 16 {
		forward[i], backward[i], shuffled[i] = i, 15-i, (i*7)%16
	}
	first := sendRaw(conn, "k-any", request(forward, -1))
	require.NoError(t, first.err)
	for _, order := range [][]int{backward, shuffled} {
		requireReplayOf(t, first, sendRaw(conn, "k-any", request(order, -1)), "the same Struct, its entries in another order")
	}
	requireKeyReused(t, sendRaw(conn, "k-any", request(backward, 42)), "one value of the Struct changed")
	require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger`))
}

// Item 6: v2 of the request adds a field. A key used on v1 and then sent
// with another amount to v2 is KEY_REUSED, not answered with v1's
// response; the same amount (with or without the new field) replays,
// across the deploy in either direction.
func TestFingerprintAddedFieldStillDetectsReuseAcrossADeploy(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	amount := payField{name: "amount", number: 1, kind: descriptorpb.FieldDescriptorProto_TYPE_INT64}
	memo := payField{name: "memo", number: 2, kind: descriptorpb.FieldDescriptorProto_TYPE_STRING}
	v1 := payServer(t, db.Schema, paySchema(t, "proto3", []payField{amount}, false))
	v2 := payServer(t, db.Schema, paySchema(t, "proto3", []payField{amount, memo}, false))
	charge := func(n uint64, memo string) []byte {
		b := varintField(nil, 1, n)
		if memo != "" {
			b = bytesField(b, 2, []byte(memo))
		}
		return b
	}

	first := sendRaw(v1, "k", charge(100, ""))
	require.NoError(t, first.err)
	require.Contains(t, first.resp.GetValue(), "charged 100#")
	requireKeyReused(t, sendRaw(v2, "k", charge(999, "")), "v2, another amount")
	requireKeyReused(t, sendRaw(v2, "k", charge(999, "note")), "v2, another amount and a memo")
	requireReplayOf(t, first, sendRaw(v2, "k", charge(100, "")), "v2, the same amount")
	requireReplayOf(t, first, sendRaw(v2, "k", charge(100, "note")), "v2, the same amount and a memo v1 never knew")

	// A new client's request, first served by v1, retried on v2 and back.
	second := sendRaw(v1, "k2", charge(7, "note"))
	require.NoError(t, second.err)
	requireReplayOf(t, second, sendRaw(v2, "k2", charge(7, "note")), "v1 then v2")
	requireKeyReused(t, sendRaw(v2, "k2", charge(8, "note")), "v1 then v2, another amount")
	third := sendRaw(v2, "k3", charge(7, "note"))
	require.NoError(t, third.err)
	requireReplayOf(t, third, sendRaw(v1, "k3", charge(7, "note")), "v2 then v1")
	requireKeyReused(t, sendRaw(v2, "k3", charge(7, "other note")), "v2 twice, another memo")
	require.Equal(t, 3, db.Count(t, `SELECT count(*) FROM ledger`))
}

// resolvingCodec decodes requests with extensions resolved from types, as
// a build that links in the extension's generated code does.
type resolvingCodec struct{ types *protoregistry.Types }

func (c resolvingCodec) Marshal(v any) (mem.BufferSlice, error) {
	b, err := proto.Marshal(v.(proto.Message))
	return mem.BufferSlice{mem.SliceBuffer(b)}, err
}

func (c resolvingCodec) Unmarshal(data mem.BufferSlice, v any) error {
	return proto.UnmarshalOptions{Resolver: c.types}.Unmarshal(data.Materialize(), v.(proto.Message))
}

func (resolvingCodec) Name() string { return "proto" }

// Item 7, extensions: a proto2 request with an extension range; a rebuild
// links in an extension of it between a call and its retry, and the client
// resends the same bytes. The retry replays. Once both know it, another
// value of the extension is another request.
func TestFingerprintExtensionLinkedInByARebuildReplays(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	md := paySchema(t, "proto2", []payField{{name: "amount", number: 1, kind: descriptorpb.FieldDescriptorProto_TYPE_INT64}}, true)
	xfd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("idempotency/test/pay_note.proto"), Package: proto.String("idempotency.test"), Syntax: proto.String("proto2"),
		Dependency: []string{"idempotency/test/pay.proto"},
		Extension: []*descriptorpb.FieldDescriptorProto{{
			Name: proto.String("note"), Number: proto.Int32(100), Type: descriptorpb.FieldDescriptorProto_TYPE_STRING.Enum(),
			Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum(), Extendee: proto.String(".idempotency.test.PayRequest"),
		}},
	}, resolverOf(t, md.ParentFile()))
	require.NoError(t, err)
	types := new(protoregistry.Types)
	require.NoError(t, types.RegisterExtension(dynamicpb.NewExtensionType(xfd.Extensions().Get(0))))

	before := payServer(t, db.Schema, md)
	after := payServer(t, db.Schema, md, grpc.ForceServerCodecV2(resolvingCodec{types}))
	withNote := func(n uint64, note string) []byte { return bytesField(varintField(nil, 1, n), 100, []byte(note)) }

	first := sendRaw(before, "k", withNote(100, "x"))
	require.NoError(t, first.err)
	requireReplayOf(t, first, sendRaw(after, "k", withNote(100, "x")), "the same bytes, the extension now known")
	requireKeyReused(t, sendRaw(after, "k", withNote(999, "x")), "another amount")

	second := sendRaw(after, "k2", withNote(100, "x"))
	require.NoError(t, second.err)
	requireReplayOf(t, second, sendRaw(after, "k2", withNote(100, "x")), "known on both")
	requireReplayOf(t, second, sendRaw(before, "k2", withNote(100, "x")), "a replica not yet rebuilt")
	requireKeyReused(t, sendRaw(after, "k2", withNote(100, "y")), "another value of an extension both know")
	require.Equal(t, 2, db.Count(t, `SELECT count(*) FROM ledger`))
}

// resolverOf is a registry of fd and what it imports.
func resolverOf(t *testing.T, fd protoreflect.FileDescriptor) *protoregistry.Files {
	t.Helper()
	files := new(protoregistry.Files)
	require.NoError(t, files.RegisterFile(fd))
	return files
}

// Item 7, presence: v2 makes "int64 tip" "optional int64 tip". A client
// that sends tip=0 explicitly resends the same bytes to the other release:
// the same request, replayed. Another tip is still another request.
func TestFingerprintFieldMadeOptionalReplays(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	amount := payField{name: "amount", number: 1, kind: descriptorpb.FieldDescriptorProto_TYPE_INT64}
	tip := payField{name: "tip", number: 2, kind: descriptorpb.FieldDescriptorProto_TYPE_INT64}
	v1 := payServer(t, db.Schema, paySchema(t, "proto3", []payField{amount, tip}, false))
	tip.optional = true
	v2 := payServer(t, db.Schema, paySchema(t, "proto3", []payField{amount, tip}, false))
	withTip := func(n, tip uint64) []byte { return varintField(varintField(nil, 1, n), 2, tip) }

	first := sendRaw(v1, "k", withTip(100, 0))
	require.NoError(t, first.err)
	requireReplayOf(t, first, sendRaw(v2, "k", withTip(100, 0)), "tip=0 sent explicitly, now with presence")
	requireReplayOf(t, first, sendRaw(v2, "k", varintField(nil, 1, 100)), "tip left out")
	requireKeyReused(t, sendRaw(v2, "k", withTip(100, 5)), "another tip")

	second := sendRaw(v2, "k2", withTip(100, 0))
	require.NoError(t, second.err)
	requireReplayOf(t, second, sendRaw(v1, "k2", withTip(100, 0)), "back to the release without presence")
	require.Equal(t, 2, db.Count(t, `SELECT count(*) FROM ledger`))
}

// e2ePaySchema builds "idempotency.test.PayRequest" from fields, in a file
// of its own name.
func e2ePaySchema(t *testing.T, file string, fields ...*descriptorpb.FieldDescriptorProto) protoreflect.MessageDescriptor {
	t.Helper()
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("idempotency/test/" + file + ".proto"), Package: proto.String("idempotency.test"),
		Syntax: proto.String("proto3"), Dependency: []string{"google/protobuf/any.proto"},
		MessageType: []*descriptorpb.DescriptorProto{{Name: proto.String("PayRequest"), Field: fields}},
	}, protoregistry.GlobalFiles)
	require.NoError(t, err)
	return fd.Messages().Get(0)
}

func e2eField(name string, num int32, typ descriptorpb.FieldDescriptorProto_Type, repeated bool, typeName string) *descriptorpb.FieldDescriptorProto {
	label := descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL
	if repeated {
		label = descriptorpb.FieldDescriptorProto_LABEL_REPEATED
	}
	f := &descriptorpb.FieldDescriptorProto{Name: proto.String(name), Number: proto.Int32(num), Type: typ.Enum(), Label: label.Enum(), JsonName: proto.String(name)}
	if typeName != "" {
		f.TypeName = proto.String(typeName)
	}
	return f
}

// End to end, the defect: `repeated google.protobuf.Any lines`. The first
// call charges one line; the same key with two lines (a different request:
// twice the charge) is answered with the first call's stored response,
// and the second line is never charged.
//
// What holds now: the second call is FailedPrecondition KEY_REUSED and
// the ledger keeps one row, the first call's.
func TestFingerprintListOfAnysOfAnotherLengthIsKeyReused(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	md := e2ePaySchema(t, "adv_lines",
		e2eField("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, false, ""),
		e2eField("lines", 2, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, true, ".google.protobuf.Any"))
	conn := payServer(t, db.Schema, md)
	request := func(lines ...int64) []byte {
		b := varintField(nil, 1, 100)
		for _, l := range lines {
			a, err := anypb.New(wrapperspb.Int64(l))
			require.NoError(t, err)
			ab, err := proto.Marshal(a)
			require.NoError(t, err)
			b = bytesField(b, 2, ab)
		}
		return b
	}
	first := sendRaw(conn, "k-lines", request(100))
	require.NoError(t, first.err)
	requireReplayOf(t, first, sendRaw(conn, "k-lines", request(100)), "sanity: the genuine retry")
	requireKeyReused(t, sendRaw(conn, "k-lines", request(100, 100)), "two lines where the first call had one")
}

// End to end, the defect: a request whose per-field fingerprint passes
// 16 KiB is stored as one whole-request leaf, which a small request of
// the same method is never compared with. The first call (amount 100,
// with many notes) is stored; the same key with amount 999 and no notes
// replays "charged 100".
//
// What holds now: the second call is FailedPrecondition KEY_REUSED.
func TestFingerprintLargeThenSmallRequestIsKeyReused(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	fields := []*descriptorpb.FieldDescriptorProto{e2eField("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, false, "")}
	for i := int32(2); i <= 1200; i++ {
		fields = append(fields, e2eField(fmt.Sprintf("note%d", i), i, descriptorpb.FieldDescriptorProto_TYPE_STRING, false, ""))
	}
	conn := payServer(t, db.Schema, e2ePaySchema(t, "adv_wide", fields...))
	request := func(amount uint64, notes int) []byte {
		b := varintField(nil, 1, amount)
		for i := 2; i < 2+notes; i++ {
			b = bytesField(b, protowire.Number(i), []byte("n"))
		}
		return b
	}
	first := sendRaw(conn, "k-wide", request(100, 1000))
	require.NoError(t, first.err)
	require.Contains(t, first.resp.GetValue(), "charged 100#")
	requireKeyReused(t, sendRaw(conn, "k-wide", request(999, 0)), "amount 999 where the first call charged 100")
}

// End to end, the defect: `google.protobuf.Any opts` whose packed type
// (Opts {bool notify = 1}) is linked into the server. The first call packs
// Opts{} as an empty value; the client, rebuilt with `optional bool
// notify` and setting notify = false (the value it had), retries with the
// value "08 00". The server decodes both to Opts{}, yet the retry is
// FailedPrecondition KEY_REUSED, which tells an obedient client to use a
// new key: it charges twice.
//
// What holds now: the retry replays the first call's response, byte for
// byte, and the ledger keeps one row.
func TestFingerprintLinkedAnyExplicitDefaultRetryReplays(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	ofd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name: proto.String("idempotency/test/adv2_opts.proto"), Package: proto.String("idempotency.test.adv2"), Syntax: proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{{Name: proto.String("Opts"), Field: []*descriptorpb.FieldDescriptorProto{
			e2eField("notify", 1, descriptorpb.FieldDescriptorProto_TYPE_BOOL, false, "")}}},
	}, protoregistry.GlobalFiles)
	require.NoError(t, err)
	require.NoError(t, protoregistry.GlobalTypes.RegisterMessage(dynamicpb.NewMessageType(ofd.Messages().Get(0))))
	md := e2ePaySchema(t, "adv2_anyopts",
		e2eField("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, false, ""),
		e2eField("opts", 2, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE, false, ".google.protobuf.Any"))
	conn := payServer(t, db.Schema, md)
	request := func(packed []byte) []byte {
		a, err := proto.Marshal(&anypb.Any{TypeUrl: "type.googleapis.com/idempotency.test.adv2.Opts", Value: packed})
		require.NoError(t, err)
		return bytesField(varintField(nil, 1, 100), 2, a)
	}
	first := sendRaw(conn, "k-adv2-anyopts", request(nil))
	require.NoError(t, first.err)
	requireReplayOf(t, first, sendRaw(conn, "k-adv2-anyopts", request(nil)), "sanity: the same bytes")
	requireReplayOf(t, first, sendRaw(conn, "k-adv2-anyopts", request([]byte{0x08, 0x00})),
		"Opts{} packed with notify=false written: the same request")
}

// End to end, the defect: a wide request type (220 fields, its row over
// 4 KiB, so left out of the fingerprint). The first call charges amount
// 100; the same key with amount 100 and field 3 set (capture_only, say)
// replays "charged 100" on the same server, no deploy.
//
// What holds now: the second call is FailedPrecondition KEY_REUSED.
func TestFingerprintWideRequestWithAnotherFieldIsKeyReused(t *testing.T) {
	t.Parallel()
	db := suiteDB(t)
	fields := []*descriptorpb.FieldDescriptorProto{e2eField("amount", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64, false, "")}
	for i := int32(2); i <= 220; i++ {
		typ := descriptorpb.FieldDescriptorProto_TYPE_INT64
		if i%2 == 0 {
			typ = descriptorpb.FieldDescriptorProto_TYPE_STRING
		}
		fields = append(fields, e2eField(fmt.Sprintf("f%d", i), i, typ, false, ""))
	}
	conn := payServer(t, db.Schema, e2ePaySchema(t, "adv2_wide", fields...))
	first := sendRaw(conn, "k-adv2-wide", varintField(nil, 1, 100))
	require.NoError(t, first.err)
	requireReplayOf(t, first, sendRaw(conn, "k-adv2-wide", varintField(nil, 1, 100)), "sanity: the genuine retry")
	requireKeyReused(t, sendRaw(conn, "k-adv2-wide", varintField(varintField(nil, 1, 100), 3, 1)),
		"amount 100 with field 3 set where the first call had it unset")
}
