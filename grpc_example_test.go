package idempotency_test

import (
	"context"
	"log"
	"log/slog"
	"net"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"

	"github.com/exactlyonce/idempotency"
)

// A server with unary and streaming methods: unary calls are protected;
// streaming calls that ask for protection are refused, at startup for the
// annotated methods and on every call.
func ExampleStreamServerInterceptor() {
	ctx := context.Background()
	pool, err := pgxpool.New(ctx, "postgres://postgres@127.0.0.1:5432/test")
	if err != nil {
		log.Fatal(err)
	}
	defer pool.Close()
	store, err := idempotency.NewStore(pool, idempotency.WithTracer(idempotency.LogTracer(slog.Default())))
	if err != nil {
		log.Fatal(err)
	}
	if err := store.Migrate(ctx); err != nil { // or apply idempotency.Migrations with your own tool
		log.Fatal(err)
	}
	go func() { _ = store.RunCleaner(ctx, time.Minute, 1000, func(err error) { log.Print(err) }) }()

	opts := []idempotency.ServerOption{
		idempotency.WithScope(callerFromContext),
		idempotency.WithKeyRequired(), // for methods the .proto does not annotate
	}
	srv := grpc.NewServer(
		// After authentication, so that the scope can name the caller.
		grpc.ChainUnaryInterceptor(idempotency.UnaryServerInterceptor(store, opts...)),
		grpc.ChainStreamInterceptor(idempotency.StreamServerInterceptor(store, opts...)),
	)
	// paymentsv1.RegisterPaymentServiceServer(srv, payments.NewServer(pool))
	if err := idempotency.CheckStreamingMethods(srv); err != nil {
		log.Fatal(err) // a streaming method annotated with (idempotency.v1.method)
	}

	lis, err := net.Listen("tcp", "127.0.0.1:50051")
	if err != nil {
		log.Fatal(err)
	}
	log.Fatal(srv.Serve(lis))
}
