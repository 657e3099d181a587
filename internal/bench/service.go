package main

import (
	"context"
	"net"
	"strings"
	"sync/atomic"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"

	"github.com/exactlyonce/idempotency"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// Methods of the annotated test service that the variants call.
const (
	// methodWrite is MODE_REQUIRED: through the interceptor every call
	// needs a key. Its handler inserts one business row.
	methodWrite = testingv1.PolicyService_Required_FullMethodName
	// methodEcho has no annotation, so calls without a key pass through the
	// interceptor. Its handler touches no database.
	methodEcho = testingv1.PolicyService_Unannotated_FullMethodName
)

// insertBusinessRow is the business write of the handler, the same with and
// without the interceptor.
const insertBusinessRow = `INSERT INTO ledger (note) VALUES ($1) RETURNING id`

// service is the benchmarked handler. Required writes one ledger row: in
// the idempotent call's transaction when the interceptor provides one,
// otherwise in a BEGIN/INSERT/COMMIT of its own (the baseline a service
// without this library would run). Unannotated answers without a database.
type service struct {
	testingv1.UnimplementedPolicyServiceServer
	pool    *pgxpool.Pool
	payload string // the response body, -response-bytes long
}

func (s *service) Required(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
	var id int64
	if tx, ok := idempotency.TxFromContext(ctx); ok {
		if err := tx.QueryRow(ctx, insertBusinessRow, req.GetBody()).Scan(&id); err != nil {
			return nil, err
		}
	} else {
		err := pgx.BeginFunc(ctx, s.pool, func(tx pgx.Tx) error {
			return tx.QueryRow(ctx, insertBusinessRow, req.GetBody()).Scan(&id)
		})
		if err != nil {
			return nil, err
		}
	}
	return &testingv1.Response{Body: s.payload, LedgerId: id}, nil
}

func (s *service) Unannotated(context.Context, *testingv1.Request) (*testingv1.Response, error) {
	return &testingv1.Response{Body: s.payload}, nil
}

// server is one gRPC server on a loopback port: with the interceptor on a
// store, or (store nil) without any interceptor.
type server struct {
	name     string
	addr     string
	grpc     *grpc.Server
	outcomes *outcomeCounts // nil without the interceptor
}

// outcomeCounts counts the interceptor's outcomes, through the library's
// own hook, so each variant can be checked to do what it claims.
type outcomeCounts [8]atomic.Int64

func (o *outcomeCounts) read() (c [8]int64) {
	if o == nil {
		return c
	}
	for i := range o {
		c[i] = o[i].Load()
	}
	return c
}

func startServer(name string, svc *service, store *idempotency.Store) (*server, error) {
	s := &server{name: name}
	var opts []grpc.ServerOption
	if store != nil {
		s.outcomes = new(outcomeCounts)
		opts = append(opts, grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(store,
			idempotency.WithOutcomeHook(func(_ context.Context, _ string, o idempotency.Outcome, _ error) {
				if int(o) >= 0 && int(o) < len(s.outcomes) {
					s.outcomes[o].Add(1)
				}
			}))))
	}
	s.grpc = grpc.NewServer(opts...)
	testingv1.RegisterPolicyServiceServer(s.grpc, svc)
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	s.addr = lis.Addr().String()
	go func() { _ = s.grpc.Serve(lis) }()
	return s, nil
}

// payload returns a printable response body of n bytes.
func payload(n int) string {
	const alphabet = "abcdefghijklmnopqrstuvwxyz0123456789"
	return strings.Repeat(alphabet, n/len(alphabet)+1)[:n]
}
