package idempotency_test

import (
	"context"
	"log"
	"net"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/exactlyonce/idempotency"
)

// A server that stores idempotency keys in its own PostgreSQL database.
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
	if err := store.Migrate(ctx); err != nil {
		log.Fatal(err)
	}
	go func() { _ = store.RunCleaner(ctx, time.Minute, 1000, func(err error) { log.Print(err) }) }()

	srv := grpc.NewServer(grpc.ChainUnaryInterceptor(
		// Usually after authentication, so the scope can name the caller.
		idempotency.UnaryServerInterceptor(store,
			idempotency.WithScope(callerFromContext),
			idempotency.WithKeyRequired(true),
		),
	))
	// pb.RegisterPaymentServiceServer(srv, &paymentServer{})

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

// A handler writes through the call's transaction: its rows commit together
// with the stored response, or not at all.
func ExampleMustTxFromContext() {
	charge := func(ctx context.Context, req *wrapperspb.Int64Value) (*wrapperspb.StringValue, error) {
		tx := idempotency.MustTxFromContext(ctx)
		var id string
		err := tx.QueryRow(ctx,
			`INSERT INTO ledger (amount_cents) VALUES ($1) RETURNING id::text`, req.GetValue()).Scan(&id)
		if err != nil {
			return nil, err // rolls back; the key is released and a retry runs again
		}
		return wrapperspb.String(id), nil
	}
	_ = charge
}
