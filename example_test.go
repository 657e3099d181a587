package idempotency_test

import (
	"context"
	"fmt"
	"log"
	"net"
	"time"

	"github.com/grpc-ecosystem/go-grpc-middleware/v2/interceptors/retry"
	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"

	"github.com/exactlyonce/idempotency"
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
	if err := store.Migrate(ctx); err != nil { // or apply store.Migrations() with your own tool
		log.Fatal(err)
	}
	go func() { _ = store.RunCleaner(ctx, time.Minute, 1000, func(err error) { log.Print(err) }) }()

	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
		// After authentication, so that the scope can name the caller.
		idempotency.UnaryServerInterceptor(store,
			idempotency.WithScope(callerFromContext),
			idempotency.WithKeyRequired(true), // for methods the .proto does not annotate
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

// The ready client chain: the key interceptor, then go-grpc-middleware's
// retry interceptor configured for keyed calls.
func ExampleUnaryClientInterceptors() {
	conn, err := grpc.NewClient("127.0.0.1:50051",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(idempotency.UnaryClientInterceptors()...),
	)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
}

// A chain built by hand: the key interceptor must come first, outside the
// retry interceptor, so every attempt carries the same key.
func ExampleUnaryClientInterceptor() {
	conn, err := grpc.NewClient("127.0.0.1:50051",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithChainUnaryInterceptor(
			idempotency.UnaryClientInterceptor(), // outside: one key per logical call
			retry.UnaryClientInterceptor(retry.WithMax(5), retry.WithCodes(codes.Unavailable, codes.Aborted)),
		),
	)
	if err != nil {
		log.Fatal(err)
	}
	defer conn.Close()
}

// gRPC's own retry policy runs below every interceptor, so the key
// interceptor runs once per logical call and every attempt has its key.
func ExampleUnaryClientInterceptor_nativeRetry() {
	conn, err := grpc.NewClient("127.0.0.1:50051",
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithUnaryInterceptor(idempotency.UnaryClientInterceptor()),
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

// Choosing the key: WithKey for a key derived from the request (an order
// ID), and CaptureKey to learn a generated key and retry the same logical
// call later.
func ExampleWithKey() {
	var conn *grpc.ClientConn // with idempotency.UnaryClientInterceptors()
	var req, resp any         // your request and response messages
	ctx := idempotency.WithKey(context.Background(), "order-1001")
	err := conn.Invoke(ctx, "/payments.v1.PaymentService/Charge", req, resp)

	var key string
	err = conn.Invoke(context.Background(), "/payments.v1.PaymentService/Charge", req, resp, idempotency.CaptureKey(&key))
	if status.Code(err) == codes.Unavailable {
		// Later, the same logical call: same key, so at most one charge.
		err = conn.Invoke(idempotency.WithKey(context.Background(), key), "/payments.v1.PaymentService/Charge", req, resp)
	}
	_ = err
}

// A handler that calls another system forwards its own key, so that system
// deduplicates the retries too.
func ExampleKeyFromContext() {
	forward := func(ctx context.Context, provider *grpc.ClientConn, req, resp any) error {
		key, _ := idempotency.KeyFromContext(ctx)
		ctx = metadata.AppendToOutgoingContext(ctx, idempotency.MetadataKey, key)
		return provider.Invoke(ctx, "/provider.v1.Cards/Capture", req, resp)
	}
	_ = forward
}

// The engine without gRPC: apply each message of an at-least-once stream
// once, in the same transaction as its business write.
func ExampleStore_ProcessMessage() {
	var store *idempotency.Store // idempotency.NewStore(pool)
	ctx := context.Background()
	msgID, body := "order-1001-paid", []byte(`{"order":1001}`)

	duplicate, err := store.ProcessMessage(ctx, idempotency.Message{Scope: "orders/billing", ID: msgID, Body: body},
		func(ctx context.Context, tx pgx.Tx) error {
			_, err := tx.Exec(ctx, `UPDATE orders SET status = 'paid' WHERE id = 1001`)
			return err
		})
	switch {
	case idempotency.IsFinal(err):
		fmt.Println("outcome recorded (a poison message, say); acknowledge or terminate")
	case err != nil:
		fmt.Println("not processed; negatively acknowledge so it comes back")
	case duplicate:
		fmt.Println("already processed; acknowledge")
	default:
		fmt.Println("processed; acknowledge")
	}
}
