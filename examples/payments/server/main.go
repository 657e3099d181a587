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
	"log/slog"
	"net"
	"net/url"
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
	cfg, err := parseFlags(flag.CommandLine, os.Args[1:])
	if err != nil {
		os.Exit(2) // the flag package has printed why
	}
	logger := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	lis, err := net.Listen("tcp", cfg.addr)
	if err != nil {
		logger.Error("listen", "addr", cfg.addr, "err", err)
		os.Exit(1)
	}
	if err := run(ctx, lis, cfg.databaseURL, logger); err != nil {
		logger.Error("server stopped", "err", err)
		os.Exit(1)
	}
}

type config struct {
	addr, databaseURL string
}

// parseFlags reads the command line. The database URL's default comes
// from $DATABASE_URL, and -h shows it with the password masked.
func parseFlags(fs *flag.FlagSet, args []string) (config, error) {
	var c config
	fs.StringVar(&c.addr, "addr", "127.0.0.1:50051", "address to listen on")
	fs.StringVar(&c.databaseURL, "database-url", "", "PostgreSQL URL (default: $DATABASE_URL, else the local test database: "+redactURL(testdb.URL())+")")
	if err := fs.Parse(args); err != nil {
		return c, err
	}
	if c.databaseURL == "" {
		c.databaseURL = testdb.URL()
	}
	return c, nil
}

// redactURL masks the password of a database URL, for showing it.
func redactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparsable URL)"
	}
	return u.Redacted()
}

// run serves on lis until ctx is done, then stops gracefully.
func run(ctx context.Context, lis net.Listener, dbURL string, logger *slog.Logger) error {
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
		_ = store.RunCleaner(ctx, time.Minute, 1000, func(err error) { logger.Warn("cleaner", "err", err) })
	}()
	defer func() { <-cleaned }()

	srv := payments.NewGRPCServer(pool, store, logger)
	reflection.Register(srv)
	logger.Info("PaymentService listening", "addr", lis.Addr().String())

	served := make(chan error, 1)
	go func() { served <- srv.Serve(lis) }()
	select {
	case err := <-served:
		return err
	case <-ctx.Done():
	}
	logger.Info("shutting down: finishing calls in flight")
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
