package idempotency_test

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"net/http/httptest"
	"strings"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

// A server that keeps idempotency keys in its own PostgreSQL database.
func ExampleUnaryServerInterceptor() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/test")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()

	store, err := idempotency.NewStore(pool)
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil { // or apply idempotency.Migrations with your own tool
		log.Fatal(err)
	}
	go func() { _ = store.RunCleaner(ctx, time.Minute, 1000, func(err error) { log.Print(err) }) }()

	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
		// After authentication, so that the scope can name the caller.
		idempotency.UnaryServerInterceptor(store,
			idempotency.WithScope(callerFromContext),
			idempotency.WithKeyRequired(), // for methods the .proto does not annotate
		),
	))
	// paymentsv1.RegisterPaymentServiceServer(srv, payments.NewServer(pool))

	lis, err := net.Listen("tcp", "127.0.0.1:50051")
	if err != nil {
		log.Fatal(err)
	}
	log.Fatal(srv.Serve(lis))
}

// callerFromContext names the authenticated caller; keys are unique per
// caller. Here the caller comes from metadata an auth layer has verified.
func callerFromContext(ctx context.Context) (string, error) {
	if v := metadata.ValueFromIncomingContext(ctx, "x-verified-client-id"); len(v) == 1 {
		return v[0], nil
	}
	return "", status.Error(codes.Unauthenticated, "no verified client id")
}

// The store's calls in the service's log, one line each, without their
// keys, beside OpenTelemetry's or any other tracer.
func ExampleLogTracer() {
	var pool *pgxpool.Pool             // the service's pool
	var metrics idempotency.Tracer     // idempotencyotel.NewTracer(...), say
	logs := idempotency.LogTracer(nil) // slog.Default()
	store, err := idempotency.NewStore(pool, idempotency.WithTracer(idempotency.JoinTracers(metrics, logs)))
	if err != nil {
		log.Fatal(err)
	}
	_ = store
}

// One interceptor gives every logical call one key and retries it under
// that key.
func ExampleUnaryClientInterceptor() {
	conn, err := grpc.NewClient("127.0.0.1:50051",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor()),
	)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
}

// A client with retries of its own: WithMaxAttempts(1) makes the
// interceptor the key alone, and the retry interceptor must come after it,
// inside, so every attempt carries the same key.
func ExampleUnaryClientInterceptor_ownRetries() {
	conn, err := grpc.NewClient("127.0.0.1:50051",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(
			idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1)), // outside: one key per logical call
			retry.UnaryClientInterceptor(retry.WithMax(5), retry.WithCodes(codes.Unavailable, codes.Aborted)),
		),
	)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
}

// gRPC's own retry policy runs below every interceptor, so the key
// interceptor (the key alone, WithMaxAttempts(1)) runs once per logical
// call and every attempt has its key.
func ExampleUnaryClientInterceptor_nativeRetry() {
	conn, err := grpc.NewClient("127.0.0.1:50051",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor(idempotency.WithMaxAttempts(1))),
		grpc.WithDefaultServiceConfig(`{
		  "methodConfig": [{
		    "name": [{"service": "payments.v1.PaymentService"}],
		    "retryPolicy": {
		      "maxAttempts": 5,
		      "initialBackoff": "0.01s",
		      "maxBackoff": "0.2s",
		      "backoffMultiplier": 2,
		      "retryableStatusCodes": ["UNAVAILABLE", "ABORTED", "RESOURCE_EXHAUSTED"]
		    }
		  }]
		}`),
	)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
}

// Choosing the key: WithOutgoingKey for a key derived from the request (an order
// ID), and CaptureKey to learn a generated key and retry the same logical
// call later.
func ExampleWithOutgoingKey() {
	var conn *grpc.ClientConn // with idempotency.UnaryClientInterceptor()
	var req, resp any         // your request and response messages
	ctx := idempotency.WithOutgoingKey(context.Background(), "order-1001")
	err := conn.Invoke(ctx, "/payments.v1.PaymentService/Charge", req, resp)

	var key string
	err = conn.Invoke(context.Background(), "/payments.v1.PaymentService/Charge", req, resp, idempotency.CaptureKey(&key))
	if status.Code(err) == codes.Unavailable {
		// Later, the same logical call: same key, so at most one charge.
		err = conn.Invoke(idempotency.WithOutgoingKey(context.Background(), key), "/payments.v1.PaymentService/Charge", req, resp)
	}
	_ = err
}

// A handler reads the key of the call it runs, to log it. The keys of the
// calls it makes to other systems are derived from it (see EffectKey and
// HTTPTransport), never the key itself.
func ExampleIncomingKey() {
	handler := func(ctx context.Context, req *wrapperspb.StringValue) (*wrapperspb.StringValue, error) {
		key, _ := idempotency.IncomingKey(ctx)
		log.Printf("charging %s under key %s", req.GetValue(), key)
		return req, nil
	}
	_ = handler
}

// A call charges a provider that honours Idempotency-Key, then fails in a
// way that releases its key; its re-run sends the provider the same
// derived key, the charge effect's, and gets the first charge back.
func ExampleHTTPTransport() {
	ctx := context.Background()
	pool, done := testdb.ForExample(ctx)
	defer done()
	store, err := idempotency.NewStore(pool)
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	charged := 0
	provider := httptest.NewServer(idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		charged++
		fmt.Fprintf(w, "provider charge %d", charged)
	})))
	defer provider.Close()

	providerHTTP := &http.Client{Transport: &idempotency.HTTPTransport{}}
	charge := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		// ctx is the call's, naming the effect: the provider sees the same
		// Idempotency-Key on every run.
		ctx = idempotency.WithEffect(ctx, "charge order-1001")
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, provider.URL+"/v1/charges", strings.NewReader(`{"cents":100}`))
		if err != nil {
			return nil, err
		}
		resp, err := providerHTTP.Do(req)
		var refused *idempotency.Error
		if errors.As(err, &refused) {
			return nil, err // refused before sending (ErrUnnamedEffect, ErrInvalidKey): retrying cannot help
		} else if err != nil {
			return nil, status.Errorf(codes.Unavailable, "provider: %v", err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		fmt.Printf("%s (replayed %t)\n", body, resp.Header.Get(idempotency.ReplayedHeader) == "true")
		return wrapperspb.String(string(body)), nil
	}
	call := idempotency.Call{Scope: "tenant-1", Key: "order-1001", Method: "checkout"}
	_, err = store.Execute(ctx, call, func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		if _, err := charge(ctx, tx); err != nil {
			return nil, err
		}
		return nil, status.Error(codes.Unavailable, "the ledger is down: nothing committed, the key is released")
	})
	fmt.Println("first run:", status.Code(err))
	res, err := store.Execute(ctx, call, charge)
	if err != nil {
		log.Fatal(err)
	}
	fmt.Println("second run:", res.Outcome)
	// Output:
	// provider charge 1 (replayed false)
	// first run: Unavailable
	// provider charge 1 (replayed true)
	// second run: executed
}

// The engine without gRPC: apply each message of an at-least-once stream
// once, in the same transaction as its business write.
func ExampleStore_ProcessMessage() {
	ctx := context.Background()
	pool, done := testdb.ForExample(ctx)
	defer done()
	store, err := idempotency.NewStore(pool)
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE orders (id int PRIMARY KEY, status text); INSERT INTO orders VALUES (1001, 'new')`); err != nil {
		log.Fatal(err)
	}
	msgID, body := "order-1001-paid", []byte(`{"order":1001}`)

	for delivery := 1; delivery <= 2; delivery++ { // at least once: a redelivery
		outcome, err := store.ProcessMessage(ctx, idempotency.Message{Scope: "orders/billing", ID: msgID, Body: body},
			func(ctx context.Context, tx pgx.Tx) error {
				_, err := tx.Exec(ctx, `UPDATE orders SET status = 'paid' WHERE id = 1001`)
				return err
			})
		fmt.Printf("delivery %d: %s, %s\n", delivery, outcome, idempotency.DispositionOf(outcome, err))
	}
	// Output:
	// delivery 1: executed, ack
	// delivery 2: replayed, ack
}

// The engine itself, for a transport of the application's own: Func runs at
// most once per key, its writes and its result committed together.
func ExampleStore_Execute() {
	ctx := context.Background()
	pool, done := testdb.ForExample(ctx)
	defer done()
	store, err := idempotency.NewStore(pool)
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	if _, err := pool.Exec(ctx, `CREATE TABLE charges (id bigserial PRIMARY KEY, cents int NOT NULL)`); err != nil {
		log.Fatal(err)
	}
	charge := func(ctx context.Context, tx pgx.Tx) (proto.Message, error) {
		var id int64
		err := tx.QueryRow(ctx, `INSERT INTO charges (cents) VALUES (100) RETURNING id`).Scan(&id)
		return wrapperspb.String(fmt.Sprint("charge ", id)), err
	}
	call := idempotency.Call{Scope: "tenant-1", Key: "order-1001", Method: "charge"}
	for i := 0; i < 2; i++ {
		res, err := store.Execute(ctx, call, charge)
		if err != nil {
			log.Fatal(err)
		}
		fmt.Println(res.Outcome, res.Response.(*wrapperspb.StringValue).GetValue())
	}
	var n int
	if err := pool.QueryRow(ctx, `SELECT count(*) FROM charges`).Scan(&n); err != nil {
		log.Fatal(err)
	}
	fmt.Println("charges:", n)
	// Output:
	// executed charge 1
	// replayed charge 1
	// charges: 1
}

// The same guarantee for net/http: a retry with the same Idempotency-Key
// gets the first response, byte for byte.
func ExampleHTTPMiddleware() {
	ctx := context.Background()
	pool, done := testdb.ForExample(ctx)
	defer done()
	store, err := idempotency.NewStore(pool)
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	created := 0
	mux := http.NewServeMux()
	mux.Handle("POST /v1/charges", idempotency.HTTPMiddleware(store)(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		created++ // writes go through idempotency.MustTxFromContext(r.Context())
		w.Header().Set("Content-Type", "application/json")
		w.WriteHeader(http.StatusCreated)
		fmt.Fprintf(w, `{"charge":%d}`, created)
	})))
	srv := httptest.NewServer(mux)
	defer srv.Close()

	for i := 0; i < 2; i++ {
		req, err := http.NewRequest(http.MethodPost, srv.URL+"/v1/charges", strings.NewReader(`{"cents":100}`))
		if err != nil {
			log.Fatal(err)
		}
		req.Header.Set("Idempotency-Key", "order-1001")
		resp, err := srv.Client().Do(req)
		if err != nil {
			log.Fatal(err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		fmt.Println(resp.StatusCode, resp.Header.Get("Idempotency-Replayed"), string(body))
	}
	// Output:
	// 201  {"charge":1}
	// 201 true {"charge":1}
}

// Keys are checked before anything is sent or stored; a UUID is a good key.
func ExampleValidateKey() {
	for _, key := range []string{"0190f3b4-7c1e-7000-8000-000000000000", "", "has space", "ключ"} {
		fmt.Printf("%q: %v\n", key, idempotency.ValidateKey(key))
	}
	// Output:
	// "0190f3b4-7c1e-7000-8000-000000000000": <nil>
	// "": idempotency: invalid idempotency key: key is empty
	// "has space": idempotency: invalid idempotency key: byte 3 is 0x20; only printable ASCII 0x21-0x7E is allowed
	// "ключ": idempotency: invalid idempotency key: byte 0 is non-ASCII 'к'; only printable ASCII 0x21-0x7E is allowed
}

// A handler (or a message's Func) marks an error final when repeating the
// request can only give the same answer: it is stored with the key and
// replayed, while the handler's writes roll back. Other errors release the
// key, so a retry runs again.
func ExampleFinal() {
	unknownAccount := idempotency.Final(status.Error(codes.NotFound, "no account acct-9"))
	providerDown := status.Error(codes.Unavailable, "card processor timed out")

	for _, err := range []error{unknownAccount, providerDown} {
		fmt.Printf("%v: final=%t code=%v\n", err, idempotency.IsFinal(err), status.Code(err))
	}
	// Output:
	// rpc error: code = NotFound desc = no account acct-9: final=true code=NotFound
	// rpc error: code = Unavailable desc = card processor timed out: final=false code=Unavailable
}

// A client tells the library's outcomes from a handler's own errors with the
// same code by their ErrorInfo, and learns when to retry from RetryInfo.
func ExampleIsInProgress() {
	// As a client receives it: a status, rebuilt from the wire.
	err := status.ErrorProto(status.Convert(idempotency.ErrInProgress).Proto())
	delay, _ := idempotency.RetryDelay(err)
	fmt.Println(status.Code(err), idempotency.IsInProgress(err), idempotency.IsKeyReused(err), delay)

	handlersOwn := status.Error(codes.Aborted, "optimistic lock lost")
	fmt.Println(status.Code(handlersOwn), idempotency.IsInProgress(handlersOwn))
	// Output:
	// Aborted true false 0s
	// Aborted false
}

// The client's key for outgoing calls and the key of the call a server is
// running are separate: a handler that makes calls of its own forwards its
// key explicitly.
func ExampleWithOutgoingKey_separateFromCallKey() {
	ctx := idempotency.WithOutgoingKey(context.Background(), "abc")
	_, ok := idempotency.IncomingKey(ctx)
	fmt.Println("a client's chosen key is not the key of a served call:", !ok)
	// Output:
	// a client's chosen key is not the key of a served call: true
}
