package idempotency_test

import (
	"context"
	"testing"

	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
	idempotencyv1 "github.com/exactlyonce/idempotency/proto/idempotency/v1"
)

// Services whose descriptors are built at run time, as a gateway or a
// plugin host builds them: a FileDescriptorProto turned into descriptors by
// protodesc, messages that are dynamicpb, and a grpc.ServiceDesc written by
// hand. No generated code, so proto2 and editions files are as easy to test
// as proto3 ones.

// withPolicy is method options carrying (idempotency.v1.method) = mp.
func withPolicy(mp *idempotencyv1.MethodPolicy) *descriptorpb.MethodOptions {
	opts := &descriptorpb.MethodOptions{}
	proto.SetExtension(opts, idempotencyv1.E_Method, mp)
	return opts
}

func required(keyField string) *descriptorpb.MethodOptions {
	return withPolicy(&idempotencyv1.MethodPolicy{Mode: idempotencyv1.MethodPolicy_MODE_REQUIRED, KeyField: keyField})
}

// rtMethod declares name taking in and returning Receipt.
func rtMethod(name, in string, opts *descriptorpb.MethodOptions) *descriptorpb.MethodDescriptorProto {
	return &descriptorpb.MethodDescriptorProto{Name: proto.String(name), InputType: proto.String(in), OutputType: proto.String("Receipt"), Options: opts}
}

func rtField(name string, number int32, typ descriptorpb.FieldDescriptorProto_Type) *descriptorpb.FieldDescriptorProto {
	return &descriptorpb.FieldDescriptorProto{Name: proto.String(name), Number: proto.Int32(number), Type: typ.Enum(),
		Label: descriptorpb.FieldDescriptorProto_LABEL_OPTIONAL.Enum()}
}

// receipt is the response message of every run-time service: the ledger row
// the call wrote.
var receipt = &descriptorpb.DescriptorProto{Name: proto.String("Receipt"), Field: []*descriptorpb.FieldDescriptorProto{
	rtField("ledger_id", 1, descriptorpb.FieldDescriptorProto_TYPE_INT64),
}}

// buildFile turns fdp into descriptors, resolving imports in the global
// registry; register also adds the file there, as generated code would.
func buildFile(fdp *descriptorpb.FileDescriptorProto, register bool) protoreflect.FileDescriptor {
	fd, err := protodesc.NewFile(fdp, protoregistry.GlobalFiles)
	if err != nil {
		panic(err)
	}
	if register {
		if err := protoregistry.GlobalFiles.RegisterFile(fd); err != nil {
			panic(err)
		}
	}
	return fd
}

// runtimePayments builds idempotency.runtime.v1.Payments, never registered
// globally. Charge has the policy charge; Lookup is NO_SIDE_EFFECTS. Each
// call of it is another descriptor of the same service, as two versions
// (two processes, two plugins) would have.
func runtimePayments(charge *descriptorpb.MethodOptions) protoreflect.ServiceDescriptor {
	return buildFile(&descriptorpb.FileDescriptorProto{
		Name:    proto.String("idempotency/runtime/v1/payments.proto"),
		Package: proto.String("idempotency.runtime.v1"),
		Syntax:  proto.String("proto3"),
		MessageType: []*descriptorpb.DescriptorProto{receipt, {
			Name: proto.String("ChargeRequest"),
			Field: []*descriptorpb.FieldDescriptorProto{
				rtField("request_id", 1, descriptorpb.FieldDescriptorProto_TYPE_STRING),
				rtField("body", 2, descriptorpb.FieldDescriptorProto_TYPE_STRING),
			},
		}},
		Service: []*descriptorpb.ServiceDescriptorProto{{
			Name: proto.String("Payments"),
			Method: []*descriptorpb.MethodDescriptorProto{
				rtMethod("Charge", "ChargeRequest", charge),
				rtMethod("Lookup", "ChargeRequest", &descriptorpb.MethodOptions{IdempotencyLevel: descriptorpb.MethodOptions_NO_SIDE_EFFECTS.Enum()}),
			},
		}},
	}, false).Services().Get(0)
}

// proto2Orders is a proto2 file in the global registry whose key fields
// declare a default: Charge's is request_id, ChargeGroup's is
// meta.request_id inside a group. In the global registry, so that what its
// tests find does not depend on reading run-time descriptors.
var proto2Orders = buildFile(&descriptorpb.FileDescriptorProto{
	Name:    proto.String("idempotency/test/proto2_orders.proto"),
	Package: proto.String("idempotency.test.proto2"),
	Syntax:  proto.String("proto2"),
	MessageType: []*descriptorpb.DescriptorProto{receipt, {
		Name: proto.String("ChargeRequest"),
		Field: []*descriptorpb.FieldDescriptorProto{
			withDefault(rtField("request_id", 1, descriptorpb.FieldDescriptorProto_TYPE_STRING), "none"),
			rtField("body", 2, descriptorpb.FieldDescriptorProto_TYPE_STRING),
			withType(rtField("meta", 3, descriptorpb.FieldDescriptorProto_TYPE_GROUP), "Meta"),
		},
		NestedType: []*descriptorpb.DescriptorProto{{
			Name:  proto.String("Meta"),
			Field: []*descriptorpb.FieldDescriptorProto{withDefault(rtField("request_id", 1, descriptorpb.FieldDescriptorProto_TYPE_STRING), "none")},
		}},
	}},
	Service: []*descriptorpb.ServiceDescriptorProto{{
		Name: proto.String("Orders"),
		Method: []*descriptorpb.MethodDescriptorProto{
			rtMethod("Charge", "ChargeRequest", required("request_id")),
			rtMethod("ChargeGroup", "ChargeRequest", required("meta.request_id")),
		},
	}},
}, true).Services().Get(0)

// editionsOrders is an editions 2023 file in the global registry whose key
// field is inside a DELIMITED message field.
var editionsOrders = buildFile(&descriptorpb.FileDescriptorProto{
	Name:    proto.String("idempotency/test/editions_orders.proto"),
	Package: proto.String("idempotency.test.editions"),
	Syntax:  proto.String("editions"),
	Edition: descriptorpb.Edition_EDITION_2023.Enum(),
	MessageType: []*descriptorpb.DescriptorProto{receipt, {
		Name:  proto.String("Meta"),
		Field: []*descriptorpb.FieldDescriptorProto{rtField("request_id", 1, descriptorpb.FieldDescriptorProto_TYPE_STRING)},
	}, {
		Name: proto.String("ChargeRequest"),
		Field: []*descriptorpb.FieldDescriptorProto{
			delimited(withType(rtField("meta", 1, descriptorpb.FieldDescriptorProto_TYPE_MESSAGE), "Meta")),
			rtField("body", 2, descriptorpb.FieldDescriptorProto_TYPE_STRING),
		},
	}},
	Service: []*descriptorpb.ServiceDescriptorProto{{
		Name:   proto.String("Orders"),
		Method: []*descriptorpb.MethodDescriptorProto{rtMethod("Charge", "ChargeRequest", required("meta.request_id"))},
	}},
}, true).Services().Get(0)

func withDefault(f *descriptorpb.FieldDescriptorProto, def string) *descriptorpb.FieldDescriptorProto {
	f.DefaultValue = proto.String(def)
	return f
}

func withType(f *descriptorpb.FieldDescriptorProto, typeName string) *descriptorpb.FieldDescriptorProto {
	f.TypeName = proto.String(typeName)
	return f
}

func delimited(f *descriptorpb.FieldDescriptorProto) *descriptorpb.FieldDescriptorProto {
	f.Options = &descriptorpb.FieldOptions{Features: &descriptorpb.FeatureSet{MessageEncoding: descriptorpb.FeatureSet_DELIMITED.Enum()}}
	return f
}

// runtimeServiceDesc serves sd by hand: each request decoded into a
// dynamicpb message of the method's input; the handler writes one ledger
// row, noted with the request's body, through the call's transaction when
// there is one, and answers with a Receipt naming it.
func runtimeServiceDesc(sd protoreflect.ServiceDescriptor, db *testdb.DB) *grpc.ServiceDesc {
	desc := &grpc.ServiceDesc{ServiceName: string(sd.FullName()), HandlerType: (*any)(nil)}
	for i := 0; i < sd.Methods().Len(); i++ {
		md := sd.Methods().Get(i)
		full := "/" + string(sd.FullName()) + "/" + string(md.Name())
		handle := func(ctx context.Context, req any) (any, error) {
			m := req.(*dynamicpb.Message)
			note := m.Get(md.Input().Fields().ByName("body")).String()
			var id int64
			q := `INSERT INTO ledger (note) VALUES ($1) RETURNING id`
			var err error
			if tx, ok := idempotency.TxFromContext(ctx); ok {
				err = tx.QueryRow(ctx, q, note).Scan(&id)
			} else {
				err = db.Pool.QueryRow(ctx, q, note).Scan(&id)
			}
			resp := dynamicpb.NewMessage(md.Output())
			resp.Set(md.Output().Fields().ByName("ledger_id"), protoreflect.ValueOfInt64(id))
			return resp, err
		}
		desc.Methods = append(desc.Methods, grpc.MethodDesc{
			MethodName: string(md.Name()),
			Handler: func(srv any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
				req := dynamicpb.NewMessage(md.Input())
				if err := dec(req); err != nil {
					return nil, err
				}
				if icpt == nil {
					return handle(ctx, req)
				}
				return icpt(ctx, req, &grpc.UnaryServerInfo{Server: srv, FullMethod: full}, handle)
			},
		})
	}
	return desc
}

// runtimeServer serves the services on a loopback port, behind the server
// interceptor with store and opts, and returns its address.
func runtimeServer(t *testing.T, db *testdb.DB, store *idempotency.Store, opts []idempotency.ServerOption, sds ...protoreflect.ServiceDescriptor) string {
	t.Helper()
	srv := grpc.NewServer(grpc.UnaryInterceptor(idempotency.UnaryServerInterceptor(store, opts...)))
	for _, sd := range sds {
		srv.RegisterService(runtimeServiceDesc(sd, db), struct{}{})
	}
	return serve(t, srv)
}

// rtCall is one call of a run-time method: the request's fields by name
// (nested ones dotted), an optional metadata key, and what came back.
type rtCall struct {
	method   protoreflect.MethodDescriptor
	fields   map[string]string
	key      string
	opts     []grpc.CallOption
	ledgerID int64
	replayed bool
}

func (c *rtCall) do(conn *grpc.ClientConn) error {
	req := dynamicpb.NewMessage(c.method.Input())
	for path, v := range c.fields {
		setPath(req, path, v)
	}
	ctx := context.Background()
	if c.key != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, c.key)
	}
	resp := dynamicpb.NewMessage(c.method.Output())
	var tr metadata.MD
	full := "/" + string(c.method.Parent().FullName()) + "/" + string(c.method.Name())
	err := conn.Invoke(ctx, full, req, resp, append([]grpc.CallOption{grpc.Trailer(&tr)}, c.opts...)...)
	c.ledgerID = resp.Get(c.method.Output().Fields().ByName("ledger_id")).Int()
	c.replayed = len(tr.Get(idempotency.ReplayedTrailer)) > 0
	return err
}

// setPath sets the string field at a dotted path, creating the messages
// (or groups) on the way; a path that ends at a message only creates it.
func setPath(m protoreflect.Message, path string, v string) {
	fields := m.Descriptor().Fields()
	for {
		name, rest, nested := cutDot(path)
		fd := fields.ByName(protoreflect.Name(name))
		if !nested && fd.Message() != nil {
			m.Mutable(fd)
			return
		}
		if !nested {
			m.Set(fd, protoreflect.ValueOfString(v))
			return
		}
		m = m.Mutable(fd).Message()
		fields, path = fd.Message().Fields(), rest
	}
}

func cutDot(path string) (string, string, bool) {
	for i := range len(path) {
		if path[i] == '.' {
			return path[:i], path[i+1:], true
		}
	}
	return path, "", false
}

func newRuntimeDB(t *testing.T) (*testdb.DB, *idempotency.Store) {
	t.Helper()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	createLedger(t, db)
	return db, store
}

// Issue item 3: the (idempotency.v1.method) option and idempotency_level of
// a service built at run time are honoured, read from the file that
// declares the request's type, and per descriptor: two descriptors of one
// method name keep their own policies.
func TestPolicyOfServiceBuiltAtRunTime(t *testing.T) {
	t.Parallel()
	db, store := newRuntimeDB(t)
	v1 := runtimePayments(required("request_id"))
	conn := dial(t, runtimeServer(t, db, store, nil, v1))
	charge := v1.Methods().ByName("Charge")
	ledger := func(note string) int { return db.Count(t, `SELECT count(*) FROM ledger WHERE note = $1`, note) }

	t.Run("a call without a key anywhere is rejected, naming the field", func(t *testing.T) {
		c := &rtCall{method: charge, fields: map[string]string{"body": "keyless"}}
		require.Equal(t, "request_id", badRequestField(t, c.do(conn)))
		require.Equal(t, 0, ledger("keyless"))
	})

	t.Run("request_id is the key: a retry replays, the charge runs once", func(t *testing.T) {
		first := &rtCall{method: charge, fields: map[string]string{"request_id": "rt-1", "body": "rt-1"}}
		require.NoError(t, first.do(conn))
		require.False(t, first.replayed)
		again := &rtCall{method: charge, fields: map[string]string{"request_id": "rt-1", "body": "rt-1"}}
		require.NoError(t, again.do(conn))
		require.True(t, again.replayed)
		require.Equal(t, first.ledgerID, again.ledgerID)
		require.Equal(t, 1, ledger("rt-1"))
		require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'rt-1'`))
	})

	t.Run("through the library's client chain, the request's key is the key", func(t *testing.T) {
		// The client reads the same descriptor: it sends no generated key
		// beside request_id (which would win on the server and make each
		// logical call a new key), so two calls with one request_id run once.
		chained := dialWith(t, runtimeServer(t, db, store, nil, v1), grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor()))
		for range 2 {
			c := &rtCall{method: charge, fields: map[string]string{"request_id": "rt-3", "body": "rt-3"}}
			require.NoError(t, c.do(chained))
		}
		require.Equal(t, 1, ledger("rt-3"))
		require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'rt-3'`))
	})

	t.Run("a method its descriptor marks NO_SIDE_EFFECTS passes under WithKeyRequired", func(t *testing.T) {
		strict := dial(t, runtimeServer(t, db, store, []idempotency.ServerOption{idempotency.WithKeyRequired()}, runtimePayments(nil)))
		c := &rtCall{method: v1.Methods().ByName("Lookup"), fields: map[string]string{"body": "lookup"}}
		require.NoError(t, c.do(strict))
		require.Equal(t, 1, ledger("lookup"))
	})

	t.Run("another descriptor of the same method keeps its own policy", func(t *testing.T) {
		disabled := runtimePayments(withPolicy(&idempotencyv1.MethodPolicy{Mode: idempotencyv1.MethodPolicy_MODE_DISABLED}))
		other := dial(t, runtimeServer(t, db, store, nil, disabled))
		for range 2 {
			c := &rtCall{method: disabled.Methods().ByName("Charge"), fields: map[string]string{"request_id": "rt-2", "body": "rt-2"}}
			require.NoError(t, c.do(other))
			require.False(t, c.replayed)
		}
		require.Equal(t, 2, ledger("rt-2"), "MODE_DISABLED: every call runs")
		require.Equal(t, 0, db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'rt-2'`))

		c := &rtCall{method: charge, fields: map[string]string{"body": "keyless-again"}}
		require.Equal(t, "request_id", badRequestField(t, c.do(conn)), "the first descriptor still requires its key")
	})
}

// Issue item 4: a proto2 key field left unset is a missing key, not its
// declared default; the client's CaptureKey says the same.
func TestPolicyProto2DefaultIsNotAKey(t *testing.T) {
	t.Parallel()
	db, store := newRuntimeDB(t)
	addr := runtimeServer(t, db, store, nil, proto2Orders)
	conn := dial(t, addr)
	charge := proto2Orders.Methods().ByName("Charge")
	keyRows := func(key string) int {
		return db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = $1`, key)
	}

	t.Run("unset: rejected, naming the field, for every request", func(t *testing.T) {
		for _, body := range []string{"first", "second"} {
			c := &rtCall{method: charge, fields: map[string]string{"body": body}}
			require.Equal(t, "request_id", badRequestField(t, c.do(conn)), body)
		}
		require.Equal(t, 0, keyRows("none"))
		require.Equal(t, 0, db.Count(t, `SELECT count(*) FROM ledger`))
	})

	t.Run("set to the default's value: that is the key", func(t *testing.T) {
		for _, replayed := range []bool{false, true} {
			c := &rtCall{method: charge, fields: map[string]string{"request_id": "none", "body": "explicit"}}
			require.NoError(t, c.do(conn))
			require.Equal(t, replayed, c.replayed)
		}
		require.Equal(t, 1, keyRows("none"))
	})

	t.Run("CaptureKey reports no key for an unset field, the field when set", func(t *testing.T) {
		client := dialWith(t, addr, grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1))))
		captured := "unchanged"
		c := &rtCall{method: charge, fields: map[string]string{"body": "captured"}, opts: []grpc.CallOption{idempotency.CaptureKey(&captured)}}
		require.Equal(t, "request_id", badRequestField(t, c.do(client)))
		require.Equal(t, "", captured)

		c = &rtCall{method: charge, fields: map[string]string{"request_id": "p2-7", "body": "captured"}, opts: []grpc.CallOption{idempotency.CaptureKey(&captured)}}
		require.NoError(t, c.do(client))
		require.Equal(t, "p2-7", captured)
		require.Equal(t, 1, keyRows("p2-7"))
	})
}

// Issue item 12: a key field reached through an editions DELIMITED message
// field or a proto2 group works like one through a message field.
func TestPolicyKeyFieldThroughDelimitedMessage(t *testing.T) {
	t.Parallel()
	db, store := newRuntimeDB(t)
	conn := dial(t, runtimeServer(t, db, store, nil, editionsOrders, proto2Orders))
	for _, m := range []protoreflect.MethodDescriptor{
		editionsOrders.Methods().ByName("Charge"),
		proto2Orders.Methods().ByName("ChargeGroup"),
	} {
		t.Run(string(m.FullName()), func(t *testing.T) {
			key := "delimited-" + string(m.Parent().Parent().Name())
			var ids []int64
			for _, replayed := range []bool{false, true} {
				c := &rtCall{method: m, fields: map[string]string{"meta.request_id": key, "body": key}}
				require.NoError(t, c.do(conn))
				require.Equal(t, replayed, c.replayed)
				ids = append(ids, c.ledgerID)
			}
			require.Equal(t, ids[0], ids[1])
			require.Equal(t, 1, db.Count(t, `SELECT count(*) FROM ledger WHERE note = $1`, key))

			c := &rtCall{method: m, fields: map[string]string{"body": key}}
			require.Equal(t, "meta.request_id", badRequestField(t, c.do(conn)), "unset delimited message")
			c = &rtCall{method: m, fields: map[string]string{"meta": "", "body": key}}
			require.Equal(t, "meta.request_id", badRequestField(t, c.do(conn)), "unset key inside it (proto2: despite its default)")
		})
	}
}

// dialWith is dial with more options.
func dialWith(t *testing.T, addr string, opts ...grpc.DialOption) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+addr, append([]grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, opts...)...)
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}
