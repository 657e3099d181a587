package main

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"net"
	"strings"
	"sync/atomic"

	"github.com/google/uuid"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/metadata"
	"google.golang.org/protobuf/proto"

	"github.com/exactlyonce/idempotency"
	testingv1 "github.com/exactlyonce/idempotency/internal/testpb/idempotency/testing/v1"
)

// Methods of the annotated test service that the variants call.
const (
	// methodWrite is MODE_REQUIRED: through the interceptor every call
	// needs a key. Its handler inserts one business row.
	methodWrite = testingv1.PolicyService_Required_FullMethodName
	// methodCharge is the service's other MODE_REQUIRED method (its
	// idempotency_level, overridden, is of no interest here). Its handler is
	// the payments-like charge.
	methodCharge = testingv1.PolicyService_RequiredDespiteLevel_FullMethodName
	// methodEcho has no annotation, so calls without a key pass through the
	// interceptor. Its handler touches no database.
	methodEcho = testingv1.PolicyService_Unannotated_FullMethodName
)

// insertBusinessRow is the business write of the trivial handler, the same
// with and without the interceptor.
const insertBusinessRow = `INSERT INTO ledger (note) VALUES ($1) RETURNING id`

// chargeAccount is the business write of the payments handler, the shape
// of examples/payments: one statement that raises the account's balance
// (the upsert locks the account row, so charges to one account queue up)
// and inserts the charge's ledger row.
const chargeAccount = `WITH account AS (
    INSERT INTO accounts (account_id, balance_cents) VALUES ($1, $2)
    ON CONFLICT (account_id) DO UPDATE SET balance_cents = accounts.balance_cents + EXCLUDED.balance_cents
    RETURNING balance_cents
), charge AS (
    INSERT INTO charges (charge_id, account_id, amount_cents) VALUES ($3, $1, $2)
)
SELECT balance_cents FROM account`

// paymentsTables are the payments handler's tables, as examples/payments
// creates them (its ledger is called charges here: the trivial handler
// has the name).
const paymentsTables = `
CREATE TABLE accounts (
    account_id    text PRIMARY KEY,
    balance_cents bigint NOT NULL DEFAULT 0
);
CREATE TABLE charges (
    charge_id    text PRIMARY KEY,
    account_id   text NOT NULL REFERENCES accounts,
    amount_cents bigint NOT NULL CHECK (amount_cents > 0),
    created_at   timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX charges_account_id_idx ON charges (account_id)`

// querier is what a handler writes through: the call's transaction, or a
// connection inside a transaction block.
type querier interface {
	QueryRow(ctx context.Context, sql string, args ...any) pgx.Row
}

// handler is one business write, run in whatever transaction the variant
// gives it, so that every variant of a handler does the same work.
type handler struct {
	name     string // suffix of its variants' names: "" or "/payments"
	method   string
	accounts []string // payments: the accounts calls are spread over
	write    func(ctx context.Context, q querier, req *testingv1.Request) (*testingv1.Response, error)
}

var handlerNames = []string{"trivial", "payments"}

func trivialHandler(payload string) *handler {
	return &handler{method: methodWrite, write: func(ctx context.Context, q querier, req *testingv1.Request) (*testingv1.Response, error) {
		var id int64
		if err := q.QueryRow(ctx, insertBusinessRow, req.GetBody()).Scan(&id); err != nil {
			return nil, err
		}
		return &testingv1.Response{Body: payload, LedgerId: id}, nil
	}}
}

// paymentsHandler charges the account named by the request's body; the
// response carries the new balance.
func paymentsHandler(payload string, accounts int) *handler {
	h := &handler{name: "/payments", method: methodCharge}
	for i := range accounts {
		h.accounts = append(h.accounts, fmt.Sprintf("acct-%04d", i))
	}
	h.write = func(ctx context.Context, q querier, req *testingv1.Request) (*testingv1.Response, error) {
		var balance int64
		charge := "ch_" + uuid.Must(uuid.NewV7()).String()
		if err := q.QueryRow(ctx, chargeAccount, req.GetBody(), req.GetAmount(), charge).Scan(&balance); err != nil {
			return nil, fmt.Errorf("charge %s: %w", req.GetBody(), err)
		}
		return &testingv1.Response{Body: payload, LedgerId: balance}, nil
	}
	return h
}

// request fills in the client's request for one call of h. Accounts are
// picked at random: a modest number of them, so that a charge sometimes
// waits for another's row lock, as in a real service, without that
// dominating.
func (h *handler) request(c *client) *testingv1.Request {
	if len(h.accounts) == 0 {
		return c.req
	}
	c.charge.Body = h.accounts[rand.IntN(len(h.accounts))]
	return c.charge
}

// runPlain is a handler in a BEGIN/write/COMMIT of its own: what a service
// without this library would run.
func runPlain(ctx context.Context, pool *pgxpool.Pool, h *handler, req *testingv1.Request) (resp *testingv1.Response, err error) {
	err = pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
		resp, err = h.write(ctx, tx, req)
		return err
	})
	return resp, err
}

// floorTable writes the floor's key rows: a table created by the library's
// own migrations, filled with the row the engine writes for a fresh call.
type floorTable struct {
	insert string
}

const floorTableName = "floor_keys"

func newFloorTable(schema string) *floorTable {
	// The engine's INSERT of a key row (sql.go), on the floor's table.
	return &floorTable{insert: `INSERT INTO ` + pgx.Identifier{schema, floorTableName}.Sanitize() +
		` (scope, key, method, fingerprint, state, response_type, response, status, created_at, expires_at)
SELECT $1, $2, $3, $4, $5, NULLIF($6, ''), $7, $8, c.t, c.t + $9 * interval '1 microsecond'
FROM (SELECT clock_timestamp() AS t) c`}
}

// run is the physical floor of a durable idempotency record: the plain
// handler plus one key row in its transaction, sent with the COMMIT, with
// the values the engine stores (fingerprint, marshalled response, expiry).
// No lock, no lookup, no savepoint, no deduplication: BEGIN, the write,
// then [INSERT; COMMIT] in one round trip.
func (f *floorTable) run(ctx context.Context, pool *pgxpool.Pool, h *handler, key string, req *testingv1.Request) (*testingv1.Response, error) {
	fp, err := idempotency.Fingerprint(h.method, req)
	if err != nil {
		return nil, err
	}
	pc, err := pool.Acquire(ctx)
	if err != nil {
		return nil, err
	}
	defer pc.Release()
	if _, err := pc.Exec(ctx, "BEGIN"); err != nil {
		return nil, err
	}
	committed := false
	defer func() {
		if !committed {
			// Else the pool would destroy a connection left in a transaction.
			_, _ = pc.Exec(context.WithoutCancel(ctx), "ROLLBACK")
		}
	}()
	resp, err := h.write(ctx, pc, req)
	if err != nil {
		return nil, err
	}
	b, err := proto.MarshalOptions{Deterministic: true}.Marshal(resp)
	if err != nil {
		return nil, err
	}
	batch := &pgx.Batch{}
	batch.Queue(f.insert, "", key, h.method, fp, "succeeded", string(resp.ProtoReflect().Descriptor().FullName()),
		b, []byte(nil), idempotency.DefaultTTL.Microseconds())
	batch.Queue("COMMIT")
	if err := pc.SendBatch(ctx, batch).Close(); err != nil {
		return nil, err
	}
	committed = true
	return resp, nil
}

// service is the benchmarked gRPC service. Required runs the trivial
// handler, RequiredDespiteLevel the payments one: in the idempotent call's
// transaction when the interceptor provides one, else with a floor key row
// (the floor server), else in a transaction of its own (plain).
// Unannotated answers without a database.
type service struct {
	testingv1.UnimplementedPolicyServiceServer
	pool              *pgxpool.Pool
	payload           string // the response body, -response-bytes long
	trivial, payments *handler
	floor             *floorTable // nil but on the floor server
}

func (s *service) Required(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
	return s.serve(ctx, s.trivial, req)
}

func (s *service) RequiredDespiteLevel(ctx context.Context, req *testingv1.Request) (*testingv1.Response, error) {
	return s.serve(ctx, s.payments, req)
}

func (s *service) serve(ctx context.Context, h *handler, req *testingv1.Request) (*testingv1.Response, error) {
	if tx, ok := idempotency.TxFromContext(ctx); ok {
		return h.write(ctx, tx, req)
	}
	if s.floor != nil {
		// The key the client sent, as the interceptor would have it.
		keys := metadata.ValueFromIncomingContext(ctx, idempotency.MetadataKey)
		if len(keys) != 1 {
			return nil, errors.New("floor: the call needs exactly one idempotency key")
		}
		return s.floor.run(ctx, s.pool, h, keys[0], req)
	}
	return runPlain(ctx, s.pool, h, req)
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

// outcomeCounts counts the engine's outcomes, through the library's own
// hook or Execute's result, so each variant can be checked to do what it
// claims.
type outcomeCounts [16]atomic.Int64

func (o *outcomeCounts) add(oc idempotency.Outcome) {
	if int(oc) >= 0 && int(oc) < len(o) {
		o[oc].Add(1)
	}
}

func (o *outcomeCounts) read() (c [16]int64) {
	if o == nil {
		return c
	}
	for i := range o {
		c[i] = o[i].Load()
	}
	return c
}

// outcomesByTransport is a store's tracer that counts the outcomes of its
// gRPC calls in grpc and of its HTTP calls in http (either may be nil).
func outcomesByTransport(grpc, http *outcomeCounts) idempotency.Tracer {
	return endTracer(func(_ context.Context, data idempotency.TraceCallEndData) {
		switch {
		case data.Transport == idempotency.TransportGRPC && grpc != nil:
			grpc.add(data.Outcome)
		case data.Transport == idempotency.TransportHTTP && http != nil:
			http.add(data.Outcome)
		}
	})
}

// startServer serves svc, through the interceptor on store when store is
// not nil; outcomes is where that store's tracer counts gRPC outcomes.
func startServer(name string, svc *service, store *idempotency.Store, outcomes *outcomeCounts) (*server, error) {
	s := &server{name: name}
	var opts []grpc.ServerOption
	if store != nil {
		s.outcomes = outcomes
		opts = append(opts, grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(store)))
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

// endTracer is an idempotency.Tracer that only looks at the end of each
// call.
type endTracer func(ctx context.Context, data idempotency.TraceCallEndData)

func (f endTracer) TraceCallStart(ctx context.Context, _ idempotency.TraceCallStartData) context.Context {
	return ctx
}

func (f endTracer) TraceCallEnd(ctx context.Context, data idempotency.TraceCallEndData) { f(ctx, data) }
