package idempotency_test

import (
	"context"
	"net"
	"strconv"
	"sync/atomic"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/stretchr/testify/require"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protodesc"
	"google.golang.org/protobuf/reflect/protoregistry"
	"google.golang.org/protobuf/types/descriptorpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// The test service is declared by hand so that the core tests need no
// generated code: two unary methods taking and returning StringValue.
const (
	methodCharge = "/idempotency.test.Ledger/Charge"
	methodRefund = "/idempotency.test.Ledger/Refund"
)

type handlerFunc func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error)

func ledgerDesc() *grpc.ServiceDesc {
	method := func(name string) grpc.MethodDesc {
		return grpc.MethodDesc{MethodName: name, Handler: func(srv any, ctx context.Context, dec func(any) error, icpt grpc.UnaryServerInterceptor) (any, error) {
			req := &wrapperspb.StringValue{}
			if err := dec(req); err != nil {
				return nil, err
			}
			h := srv.(*ledger).handler
			info := &grpc.UnaryServerInfo{Server: srv, FullMethod: "/idempotency.test.Ledger/" + name}
			if icpt == nil {
				return h(ctx, req)
			}
			return icpt(ctx, req, info, func(ctx context.Context, req any) (any, error) {
				return h(ctx, req.(*wrapperspb.StringValue))
			})
		}}
	}
	return &grpc.ServiceDesc{
		ServiceName: "idempotency.test.Ledger",
		HandlerType: (*any)(nil),
		Methods:     []grpc.MethodDesc{method("Charge"), method("Refund")},
	}
}

type ledger struct{ handler handlerFunc }

// env is one test's world: its own schema with a migrated key table and a
// ledger table, a store, and a gRPC server on a loopback TCP socket.
type env struct {
	t     *testing.T
	db    *testdb.DB
	store *idempotency.Store
	conn  *grpc.ClientConn
	addr  string
	runs  atomic.Int64 // handler invocations, committed or not
	execs atomic.Int64 // calls whose execution committed (OutcomeExecuted)
	srv   *grpc.Server
}

type envConfig struct {
	handler      handlerFunc
	opts         []idempotency.Option
	storeOpts    []idempotency.StoreOption
	interceptors []grpc.UnaryServerInterceptor // outside ours
}

func newEnv(t *testing.T, cfg envConfig) *env {
	t.Helper()
	e := &env{t: t, db: testdb.New(t, 40)}
	ctx := context.Background()
	e.store = migratedStore(t, e.db, cfg.storeOpts...)
	_, err := e.db.Pool.Exec(ctx, `CREATE TABLE ledger (id bigserial PRIMARY KEY, note text NOT NULL)`)
	require.NoError(t, err)

	h := cfg.handler
	if h == nil {
		h = e.insertLedger
	}
	counted := func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		e.runs.Add(1)
		return h(ctx, req)
	}
	chain := append(append([]grpc.UnaryServerInterceptor{}, cfg.interceptors...), idempotency.UnaryServerInterceptor(e.store, append([]idempotency.Option{
		idempotency.WithOutcomeHook(func(_ context.Context, _ string, o idempotency.Outcome, _ error) {
			if o == idempotency.OutcomeExecuted {
				e.execs.Add(1)
			}
		}),
	}, cfg.opts...)...))
	e.srv = grpc.NewServer(grpc.ChainUnaryInterceptor(chain...))
	e.srv.RegisterService(ledgerDesc(), &ledger{handler: counted})
	e.addr = serve(t, e.srv)
	e.conn = dial(t, e.addr)
	return e
}

func dial(t *testing.T, addr string) *grpc.ClientConn {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	require.NoError(t, err)
	t.Cleanup(func() { _ = conn.Close() })
	return conn
}

// insertLedger is the default handler: one business row, written through the
// call's transaction, and a response naming that row.
func (e *env) insertLedger(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
	var db interface {
		QueryRow(context.Context, string, ...any) pgx.Row
	} = e.db.Pool // calls without a key have no transaction
	if tx, ok := idempotency.TxFromContext(ctx); ok {
		db = tx
	}
	var id int64
	if err := db.QueryRow(ctx, `INSERT INTO ledger (note) VALUES ($1) RETURNING id`, req.GetValue()).Scan(&id); err != nil {
		return nil, err
	}
	return wrapperspb.String(req.GetValue() + "#" + time.Now().Format(time.RFC3339Nano) + "#" + strconv.FormatInt(id, 10)), nil
}

// reply is what a client saw of one call.
type reply struct {
	resp     *wrapperspb.StringValue
	raw      []byte // the response re-encoded, for byte comparisons
	err      error
	replayed bool
}

func (e *env) call(ctx context.Context, method, key, body string) reply {
	if key != "" {
		ctx = metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, key)
	}
	return invoke(ctx, e.conn, method, body)
}

func invoke(ctx context.Context, conn *grpc.ClientConn, method, body string) reply {
	var trailer metadata.MD
	resp := &wrapperspb.StringValue{}
	err := conn.Invoke(ctx, method, wrapperspb.String(body), resp, grpc.Trailer(&trailer))
	r := reply{err: err, replayed: len(trailer.Get(idempotency.ReplayedTrailer)) == 1 && trailer.Get(idempotency.ReplayedTrailer)[0] == "true"}
	if err == nil {
		r.resp = resp
		r.raw, _ = proto.Marshal(resp)
	}
	return r
}

func (e *env) ledgerRows() int { return e.db.Count(e.t, `SELECT count(*) FROM ledger`) }

func (e *env) keyRows() int { return e.db.Count(e.t, `SELECT count(*) FROM idempotency_keys`) }

func (e *env) keyState(key string) string {
	var st string
	err := e.db.Pool.QueryRow(context.Background(), `SELECT state FROM idempotency_keys WHERE key = $1`, key).Scan(&st)
	if err == pgx.ErrNoRows {
		return ""
	}
	require.NoError(e.t, err)
	return st
}

// init registers a descriptor for idempotency.test.Catalog in the global
// registry, as generated code would: Get is NO_SIDE_EFFECTS, Put is
// IDEMPOTENT, Buy is unmarked.
func init() {
	level := func(l descriptorpb.MethodOptions_IdempotencyLevel) *descriptorpb.MethodOptions {
		return &descriptorpb.MethodOptions{IdempotencyLevel: l.Enum()}
	}
	method := func(name string, opts *descriptorpb.MethodOptions) *descriptorpb.MethodDescriptorProto {
		return &descriptorpb.MethodDescriptorProto{
			Name: proto.String(name), InputType: proto.String(".google.protobuf.StringValue"),
			OutputType: proto.String(".google.protobuf.StringValue"), Options: opts,
		}
	}
	fd, err := protodesc.NewFile(&descriptorpb.FileDescriptorProto{
		Name:       proto.String("idempotency/test/catalog.proto"),
		Package:    proto.String("idempotency.test"),
		Dependency: []string{"google/protobuf/wrappers.proto"},
		Syntax:     proto.String("proto3"),
		Service: []*descriptorpb.ServiceDescriptorProto{{
			Name: proto.String("Catalog"),
			Method: []*descriptorpb.MethodDescriptorProto{
				method("Get", level(descriptorpb.MethodOptions_NO_SIDE_EFFECTS)),
				method("Put", level(descriptorpb.MethodOptions_IDEMPOTENT)),
				method("Buy", nil),
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

// migratedStore returns a store on db's schema with its table migrated.
func migratedStore(t testing.TB, db *testdb.DB, opts ...idempotency.StoreOption) *idempotency.Store {
	t.Helper()
	store, err := idempotency.NewStore(db.Pool, opts...)
	require.NoError(t, err)
	require.NoError(t, store.Migrate(context.Background()))
	return store
}

// serve starts srv on a loopback port, stopped when t ends, and returns the
// address.
func serve(t *testing.T, srv *grpc.Server) string {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	go func() { _ = srv.Serve(lis) }()
	t.Cleanup(srv.Stop)
	return lis.Addr().String()
}
