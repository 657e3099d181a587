package idempotency_test

import (
	"context"
	"sync"
	"testing"
	"time"

	"github.com/stretchr/testify/require"
	"google.golang.org/genproto/googleapis/rpc/errdetails"
	"google.golang.org/grpc"
	channelzpb "google.golang.org/grpc/channelz/grpc_channelz_v1"
	channelzsvc "google.golang.org/grpc/channelz/service"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/reflection"
	reflectionpb "google.golang.org/grpc/reflection/grpc_reflection_v1"
	reflectionv1alphapb "google.golang.org/grpc/reflection/grpc_reflection_v1alpha"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoreflect"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/dynamicpb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
	idempotencyv1 "github.com/exactlyonce/idempotency/proto/idempotency/v1"
)

// policyServer implements every method of the annotated test service the
// same way: one ledger row per execution, through the call's transaction
// when there is one.
type policyServer struct {
	testingv1.UnimplementedPolicyServiceServer
	db *testdb.DB
}

func (s *policyServer) write(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
	var id int64
	q := `INSERT INTO ledger (note) VALUES ($1) RETURNING id`
	var err error
	if tx, ok := idempotency.TxFromContext(ctx); ok {
		err = tx.QueryRow(ctx, q, req.GetBody()).Scan(&id)
	} else {
		err = s.db.Pool.QueryRow(ctx, q, req.GetBody()).Scan(&id)
	}
	return &testingv1.Response{Body: req.GetBody(), LedgerId: id}, err
}

func (s *policyServer) Required(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) Optional(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) Disabled(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) NoSideEffects(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) Idempotent(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) RequiredDespiteLevel(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) Unannotated(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) NaturalKey(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) ShortTTL(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) BadKeyField(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}
func (s *policyServer) NonStringKeyField(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	return s.write(ctx, r)
}

// Serializable answers with the isolation level of its transaction.
func (s *policyServer) Serializable(ctx context.Context, r *testingv1.Request) (*testingv1.Response, error) {
	resp, err := s.write(ctx, r)
	if err == nil {
		err = idempotency.MustTxFromContext(ctx).QueryRow(ctx, `SELECT current_setting('transaction_isolation')`).Scan(&resp.Body)
	}
	return resp, err
}

type policyEnv struct {
	db     *testdb.DB
	client testingv1.PolicyServiceClient
}

func newPolicyEnv(t *testing.T, opts ...idempotency.ServerOption) *policyEnv {
	t.Helper()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	createLedger(t, db)
	srv := grpc.NewServer(grpc.UnaryInterceptor(idempotency.UnaryServerInterceptor(store, opts...)))
	testingv1.RegisterPolicyServiceServer(srv, &policyServer{db: db})
	return &policyEnv{db: db, client: testingv1.NewPolicyServiceClient(dial(t, serve(t, srv)))}
}

type rpc func(context.Context, *testingv1.Request, ...grpc.CallOption) (*testingv1.Response, error)

// send calls m with key in the metadata (none when empty) and reports the
// response, whether it was replayed, and the error.
func send(m rpc, key string, req *testingv1.Request) (*testingv1.Response, bool, error) {
	ctx := context.Background()
	if key != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, key)
	}
	var tr metadata.MD
	resp, err := m(ctx, req, grpc.Trailer(&tr))
	return resp, len(tr.Get(idempotency.ReplayedTrailer)) > 0, err
}

func badRequestField(t *testing.T, err error) string {
	t.Helper()
	require.Equal(t, codes.InvalidArgument, status.Code(err), "%v", err)
	for _, d := range status.Convert(err).Details() {
		if br, ok := d.(*errdetails.BadRequest); ok {
			return br.GetFieldViolations()[0].GetField()
		}
	}
	t.Fatalf("no BadRequest detail in %v", err)
	return ""
}

func TestPolicyFromProtoOptions(t *testing.T) {
	t.Parallel()
	e := newPolicyEnv(t)
	c := e.client
	req := func(body string) *testingv1.Request { return &testingv1.Request{Body: body} }
	keyRows := func(key string) int {
		return e.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = $1`, key)
	}

	t.Run("required: a call without a key is rejected, naming the metadata key", func(t *testing.T) {
		_, _, err := send(c.Required, "", req("r"))
		require.Equal(t, idempotency.MetadataKey, badRequestField(t, err))
		require.Equal(t, 0, e.db.Count(t, `SELECT count(*) FROM ledger WHERE note = 'r'`))
		first, _, err := send(c.Required, "req-key", req("r"))
		require.NoError(t, err)
		again, replayed, err := send(c.Required, "req-key", req("r"))
		require.NoError(t, err)
		require.True(t, replayed)
		require.Equal(t, first.GetLedgerId(), again.GetLedgerId())
	})

	t.Run("the explicit option wins over idempotency_level", func(t *testing.T) {
		_, _, err := send(c.RequiredDespiteLevel, "", req("rl"))
		require.Equal(t, idempotency.MetadataKey, badRequestField(t, err))
	})

	t.Run("isolation: the method's transaction runs at its level", func(t *testing.T) {
		resp, _, err := send(c.Serializable, "ser-key", req("s"))
		require.NoError(t, err)
		require.Equal(t, "serializable", resp.GetBody(), "on a database whose default is READ COMMITTED")
	})

	t.Run("optional: no key passes through, a key protects", func(t *testing.T) {
		_, replayed, err := send(c.Optional, "", req("o"))
		require.NoError(t, err)
		require.False(t, replayed)
		first, _, err := send(c.Optional, "opt-key", req("o"))
		require.NoError(t, err)
		again, replayed, err := send(c.Optional, "opt-key", req("o"))
		require.NoError(t, err)
		require.True(t, replayed)
		require.Equal(t, first.GetLedgerId(), again.GetLedgerId())
		require.Equal(t, 2, e.db.Count(t, `SELECT count(*) FROM ledger WHERE note = 'o'`))
	})

	for name, m := range map[string]rpc{
		"MODE_DISABLED":   c.Disabled,
		"NO_SIDE_EFFECTS": c.NoSideEffects,
		"IDEMPOTENT":      c.Idempotent,
	} {
		t.Run(name+": keys are ignored and every call runs", func(t *testing.T) {
			for _, key := range []string{"pass-key", "pass-key", "not a valid key"} {
				_, replayed, err := send(m, key, req(name))
				require.NoError(t, err)
				require.False(t, replayed)
			}
			require.Equal(t, 3, e.db.Count(t, `SELECT count(*) FROM ledger WHERE note = $1`, name))
			require.Equal(t, 0, keyRows("pass-key"))
		})
	}

	t.Run("key_field: the request's nested field is the key", func(t *testing.T) {
		natural := func(id string) *testingv1.Request {
			return &testingv1.Request{Body: "n", Meta: &testingv1.Meta{RequestId: id}}
		}
		first, replayed, err := send(c.NaturalKey, "", natural("order-7"))
		require.NoError(t, err)
		require.False(t, replayed)
		again, replayed, err := send(c.NaturalKey, "", natural("order-7"))
		require.NoError(t, err)
		require.True(t, replayed)
		require.Equal(t, first.GetLedgerId(), again.GetLedgerId())
		require.Equal(t, 1, keyRows("order-7"))

		_, _, err = send(c.NaturalKey, "", &testingv1.Request{Body: "n"})
		require.Equal(t, "meta.request_id", badRequestField(t, err), "unset message on the path")
		_, _, err = send(c.NaturalKey, "", natural(""))
		require.Equal(t, "meta.request_id", badRequestField(t, err), "empty field")
		_, _, err = send(c.NaturalKey, "", natural("has space"))
		require.Equal(t, "meta.request_id", badRequestField(t, err), "invalid key in the field")

		_, _, err = send(c.NaturalKey, "md-key", natural("order-8"))
		require.NoError(t, err)
		require.Equal(t, 1, keyRows("md-key"), "the metadata key wins over the field")
		require.Equal(t, 0, keyRows("order-8"))
	})

	t.Run("ttl: the method's TTL overrides the interceptor's", func(t *testing.T) {
		_, _, err := send(c.ShortTTL, "ttl-key", req("t"))
		require.NoError(t, err)
		var ttl time.Duration
		require.NoError(t, e.db.Pool.QueryRow(context.Background(),
			`SELECT expires_at - created_at FROM idempotency_keys WHERE key = 'ttl-key'`).Scan(&ttl))
		// 200 ms, the method's, not the interceptor's 24 hours; more when
		// the commit took half of it and the TTL counts from its end.
		require.GreaterOrEqual(t, ttl, 200*time.Millisecond)
		require.Less(t, ttl, time.Hour)
		require.Eventually(t, func() bool {
			return e.db.Count(t, `SELECT count(*) FROM idempotency_keys WHERE key = 'ttl-key' AND expires_at <= now()`) == 1
		}, liveness, 10*time.Millisecond, "the key to expire")
		_, replayed, err := send(c.ShortTTL, "ttl-key", req("t"))
		require.NoError(t, err)
		require.False(t, replayed, "expired after the method's TTL")
	})

	t.Run("a misconfigured option fails every call with Internal", func(t *testing.T) {
		for _, m := range []rpc{c.BadKeyField, c.NonStringKeyField} {
			for _, key := range []string{"", "cfg-key"} {
				_, _, err := send(m, key, req("bad"))
				require.Equal(t, codes.Internal, status.Code(err), "%v", err)
				require.ErrorContains(t, err, "key_field")
			}
		}
		require.Equal(t, 0, e.db.Count(t, `SELECT count(*) FROM ledger WHERE note = 'bad'`))
	})
}

func TestPolicyDefaultsForUnannotatedMethods(t *testing.T) {
	t.Parallel()
	loose := newPolicyEnv(t)
	_, _, err := send(loose.client.Unannotated, "", &testingv1.Request{Body: "u"})
	require.NoError(t, err, "without WithKeyRequired an unannotated method passes through")

	strict := newPolicyEnv(t, idempotency.WithKeyRequired(), idempotency.WithTTL(time.Hour))
	_, _, err = send(strict.client.Unannotated, "", &testingv1.Request{Body: "u"})
	require.Equal(t, idempotency.MetadataKey, badRequestField(t, err))
	_, _, err = send(strict.client.Optional, "", &testingv1.Request{Body: "u"})
	require.NoError(t, err, "an explicit MODE_OPTIONAL wins over WithKeyRequired")
	_, _, err = send(strict.client.Unannotated, "k", &testingv1.Request{Body: "u"})
	require.NoError(t, err)
	var ttl time.Duration
	require.NoError(t, strict.db.Pool.QueryRow(context.Background(),
		`SELECT expires_at - created_at FROM idempotency_keys WHERE key = 'k'`).Scan(&ttl))
	require.Equal(t, time.Hour, ttl, "the interceptor's TTL applies without a method TTL")
}

// The client reads the same descriptors: keys where the method needs one,
// none for natural keys, disabled methods or safe levels.
func TestClientFollowsProtoOptions(t *testing.T) {
	t.Parallel()
	icpt := idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1))
	svc := "/" + testingv1.PolicyService_ServiceDesc.ServiceName + "/"
	for method, want := range map[string]bool{
		"Required": true, "Optional": true, "Unannotated": true, "RequiredDespiteLevel": true, "ShortTTL": true,
		"Disabled": false, "NoSideEffects": false, "Idempotent": false, "NaturalKey": false,
	} {
		var sent []string
		err := icpt(context.Background(), svc+method, &testingv1.Request{}, &testingv1.Response{}, nil,
			func(ctx context.Context, _ string, _, _ any, _ *grpc.ClientConn, _ ...grpc.CallOption) error {
				sent = metadata.ValueFromOutgoingContext(ctx, idempotency.MetadataKey)
				return nil
			})
		require.NoError(t, err)
		require.Equal(t, want, len(sent) == 1, "%s: generated key %v", method, sent)
	}

	// A request that carries its own key: CaptureKey reports that key.
	var captured string
	req := &testingv1.Request{Meta: &testingv1.Meta{RequestId: "req-7"}}
	err := icpt(context.Background(), svc+"NaturalKey", req, &testingv1.Response{}, nil,
		func(context.Context, string, any, any, *grpc.ClientConn, ...grpc.CallOption) error { return nil }, idempotency.CaptureKey(&captured))
	require.NoError(t, err)
	require.Equal(t, "req-7", captured)
}

// Issue item 9: with the README's set-up (WithKeyRequired), gRPC's own
// services (health checks from Kubernetes probes, grpc_health_probe and
// Envoy; reflection; channelz) pass untouched, keyed or not, and the client
// interceptor sends them no key; methods whose idempotency_level says they
// are safe pass too. The services are grpc-go's own, on a real server.
func TestPolicyInfrastructureServicesNeedNoKey(t *testing.T) {
	t.Parallel()
	db := testdb.New(t, 8)
	store := migratedStore(t, db)
	createLedger(t, db)

	var mu sync.Mutex
	sentKeys := map[string][]string{} // the keys each method arrived with
	record := func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
		mu.Lock()
		sentKeys[info.FullMethod] = append(sentKeys[info.FullMethod], metadata.ValueFromIncomingContext(ctx, idempotency.MetadataKey)...)
		mu.Unlock()
		return handler(ctx, req)
	}
	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(record, idempotency.UnaryServerInterceptor(store, idempotency.WithKeyRequired())))
	healthpb.RegisterHealthServer(srv, health.NewServer())
	reflection.Register(srv)
	channelzsvc.RegisterChannelzServiceToServer(srv)
	testingv1.RegisterPolicyServiceServer(srv, &policyServer{db: db})
	addr := serve(t, srv)
	plain := dial(t, addr)
	keyed := dialWith(t, addr, grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1))))

	withKey := func(key string) context.Context {
		if key == "" {
			return context.Background()
		}
		return metadata.AppendToOutgoingContext(context.Background(), idempotency.MetadataKey, key)
	}

	for _, key := range []string{"", "probe-key", "not a valid key"} {
		ctx := withKey(key)
		resp, err := healthpb.NewHealthClient(plain).Check(ctx, &healthpb.HealthCheckRequest{})
		require.NoError(t, err, "health Check with key %q", key)
		require.Equal(t, healthpb.HealthCheckResponse_SERVING, resp.GetStatus())
		list, err := healthpb.NewHealthClient(plain).List(ctx, &healthpb.HealthListRequest{})
		require.NoError(t, err, "health List with key %q", key)
		require.Contains(t, list.GetStatuses(), "")
		servers, err := channelzpb.NewChannelzClient(plain).GetServers(ctx, &channelzpb.GetServersRequest{})
		require.NoError(t, err, "channelz GetServers with key %q", key)
		require.NotEmpty(t, servers.GetServer())
	}
	require.Equal(t, 0, db.Count(t, `SELECT count(*) FROM idempotency_keys`), "nothing stored for infrastructure calls")

	t.Run("the client interceptor sends health checks no key", func(t *testing.T) {
		mu.Lock()
		delete(sentKeys, healthpb.Health_Check_FullMethodName)
		mu.Unlock()
		_, err := healthpb.NewHealthClient(keyed).Check(context.Background(), &healthpb.HealthCheckRequest{})
		require.NoError(t, err)
		mu.Lock()
		defer mu.Unlock()
		require.Empty(t, sentKeys[healthpb.Health_Check_FullMethodName])
	})

	t.Run("reflection v1 and v1alpha answer", func(t *testing.T) {
		ctx := withKey("reflect-key")
		v1, err := reflectionpb.NewServerReflectionClient(plain).ServerReflectionInfo(ctx)
		require.NoError(t, err)
		require.NoError(t, v1.Send(&reflectionpb.ServerReflectionRequest{MessageRequest: &reflectionpb.ServerReflectionRequest_ListServices{}}))
		got, err := v1.Recv()
		require.NoError(t, err)
		require.NotEmpty(t, got.GetListServicesResponse().GetService())
		require.NoError(t, v1.CloseSend())

		alpha, err := reflectionv1alphapb.NewServerReflectionClient(plain).ServerReflectionInfo(ctx)
		require.NoError(t, err)
		require.NoError(t, alpha.Send(&reflectionv1alphapb.ServerReflectionRequest{MessageRequest: &reflectionv1alphapb.ServerReflectionRequest_ListServices{}}))
		gotAlpha, err := alpha.Recv()
		require.NoError(t, err)
		require.NotEmpty(t, gotAlpha.GetListServicesResponse().GetService())
		require.NoError(t, alpha.CloseSend())
	})

	t.Run("safe idempotency_level passes, the others still need a key", func(t *testing.T) {
		c := testingv1.NewPolicyServiceClient(plain)
		for _, m := range []rpc{c.NoSideEffects, c.Idempotent} {
			_, replayed, err := send(m, "", &testingv1.Request{Body: "safe"})
			require.NoError(t, err)
			require.False(t, replayed)
		}
		require.Equal(t, 2, db.Count(t, `SELECT count(*) FROM ledger WHERE note = 'safe'`))
		_, _, err := send(c.Unannotated, "", &testingv1.Request{Body: "unsafe"})
		require.Equal(t, idempotency.MetadataKey, badRequestField(t, err), "WithKeyRequired is in force")
	})
}

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
