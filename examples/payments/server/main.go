// Command server runs the example PaymentService with the idempotency
// interceptor on PostgreSQL.
//
//	go run ./examples/payments/server -addr 127.0.0.1:50051 -database-url "$DATABASE_URL"
//
// It migrates its tables on start, registers gRPC server reflection (so
// grpcurl can list and call it), logs one line per keyed call, and shuts
// down gracefully on SIGINT or SIGTERM.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"google.golang.org/grpc"
	"google.golang.org/grpc/reflection"

	"github.com/exactlyonce/idempotency"
	"github.com/exactlyonce/idempotency/examples/payments"
	"github.com/exactlyonce/idempotency/internal/testdb"
)

func main() {
	addr := flag.String("addr", "127.0.0.1:50051", "address to listen on")
	dbURL := flag.String("database-url", testdb.URL(), "PostgreSQL URL (default: $DATABASE_URL, else the local test database)")
	flag.Parse()
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	lis, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	if err := run(ctx, lis, *dbURL, log.Default()); err != nil {
		log.Fatal(err)
	}
}

// run serves on lis until ctx is done, then stops gracefully.
func run(ctx context.Context, lis net.Listener, dbURL string, logger *log.Logger) error {
	defer lis.Close()
	pool, err := pgxpool.New(ctx, dbURL)
	if err != nil {
		return fmt.Errorf("database: %w", err)
	}
	defer pool.Close()
	store, err := idempotency.NewStore(pool)
	if err != nil {
		return err
	}
	if err := payments.Migrate(ctx, pool, store); err != nil {
		return fmt.Errorf("migrate (is PostgreSQL reachable at -database-url?): %w", err)
	}
	cleaned := make(chan struct{})
	go func() {
		defer close(cleaned)
		_ = store.RunCleaner(ctx, time.Minute, 1000, func(err error) { logger.Printf("cleaner: %v", err) })
	}()
	defer func() { <-cleaned }()

	srv := payments.NewGRPCServer(pool, store, logger)
	reflection.Register(srv)
	logger.Printf("PaymentService listening on %s", lis.Addr())

	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	logger.Print("shutting down: finishing calls in flight")
	done := make(chan struct{})
	go func() { srv.GracefulStop(); close(done) }()
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		srv.Stop()
	}
	if err := <-served; err != nil && !errors.Is(err, grpc.ErrServerStopped) {
		return err
	}
	return nil
}
